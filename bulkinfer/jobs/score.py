"""``bulkinfer score``: pairs scored and documents reranked, by a
bi-encoder or a cross-encoder, streamed as ``embed`` is.

The same pipeline as :func:`bulkinfer.jobs.embed.embed` (windows, the one
feed loop, spools, resume, lock, atomic publish, report JSON and HTML) with
scoring rows (:mod:`bulkinfer.prep.scores`) on vLLM's pooling runner, in
one of the two ways vLLM's ``LLM.score`` scores:

- an embedding model (a bi-encoder, the default): every text of a row is
  embedded on its own (task ``embed``) and a pair's score (a document's
  relevance to its query) is the cosine of the two vectors, computed in
  float64 where the output record is built
  (:func:`bulkinfer.io.records.score_record`), as sentence-transformers'
  ``util.cos_sim``;
- a cross-encoder (a ``*ForSequenceClassification`` model with one label):
  each pair is read at once (task ``classify``) and the classifier's output
  (after the model's activation: a sigmoid by default) is the score, as
  sentence-transformers' ``CrossEncoder.predict``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.errors import ConfigError
from bulkinfer.io.files import OutputColumns
from bulkinfer.io.output_files import RunPaths
from bulkinfer.io.readers import RawRow
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.embed import embedding_settings, encoder_figures, encoder_planner
from bulkinfer.jobs.run import Job, RunReport, run
from bulkinfer.models import resolve_model
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.scores import (
    CROSS_ENCODER,
    SCORE_FIELDS_READ,
    SCORE_TEXT_COLUMNS,
    CrossScorePlanner,
    ScorePlanner,
    to_score_request,
)

# Where ``bulkinfer score`` writes without -o: JSONL beside the input (a
# score or a short ranking per row: text a person reads; -o x.parquet for Parquet).
DEFAULT_SUFFIX = ".scores.jsonl"
BI_ENCODER = "bi-encoder cosine"


def score(
    paths: RunPaths,
    settings: Settings,
    context: RunContext | None = None,
    truncate: bool = False,
    check_row: Callable[[RawRow], RawRow] | None = None,
) -> RunReport:
    """Score every row of ``paths.input`` (pair rows: ``text_1``, ``text_2``;
    rerank rows: ``query``, ``documents``, ``top_n``; see
    :mod:`bulkinfer.prep.scores`); write the output (see
    :func:`bulkinfer.io.records.score_record`), errors, report
    (``OUT.report.json``, ``job`` "score", with ``scoring``: ``method``
    "bi-encoder cosine" or "cross-encoder" (:func:`scoring_method`),
    ``max_seq_length`` (tokens), ``normalize``, ``truncate``,
    ``truncated_inputs`` (texts cut; pairs for a cross-encoder)) and HTML
    report files.

    ``settings.model`` None means the default encoder (all-MiniLM-L6-v2);
    else a local embedding model or one-label cross-encoder directory, or a
    prepared model name. A bi-encoder's text over ``max_seq_length`` tokens
    (a cross-encoder's pair, both texts with their special tokens) fails its
    row (``context_length_exceeded``, naming the field and both counts)
    unless ``truncate``: then a bi-encoder cuts each text on its own (both
    sides of a pair, the query and every document), as
    sentence-transformers' ``encode`` does, and a cross-encoder cuts a pair
    longest first, as ``CrossEncoder.predict`` does. The method and
    ``truncate`` are part of what ``--resume`` checks.

    ``context`` and ``check_row``: as for :func:`bulkinfer.jobs.run.run`.
    Returns and raises as that function (exit 0, or 3 when some rows failed), and:

    Raises:
        ConfigError: a cross-encoder with more than one label, checked
            before any file is written.
    """
    settings = embedding_settings(settings)
    method = scoring_method(settings.model)
    kind = planner_kind(method)
    job = Job(
        parse=to_score_request,
        planner=functools.partial(encoder_planner, kind, truncate),
        journal={"score": {"method": method, "truncate": truncate}},
        # a score row's own column is its shape's (score or results): an output with no rows has neither
        columns=OutputColumns(empty=(("id", "string"), ("prompt_tokens", "int64"))),
        calibrate=False,
        kind="score",
        describe=functools.partial(_describe, truncate),
        text_columns=SCORE_TEXT_COLUMNS,
        consumed=SCORE_FIELDS_READ,
    )
    return run(paths, settings, context, job=job, check_row=check_row)


def planner_kind(method: str) -> type[ScorePlanner]:
    """The planner of a scoring ``method`` (:func:`scoring_method`)."""
    return CrossScorePlanner if method == CROSS_ENCODER else ScorePlanner


def scoring_method(model: str | None) -> str:
    """How ``model`` scores: ``"cross-encoder"`` for a local model directory
    whose ``config.json`` ``architectures`` names a
    ``*ForSequenceClassification`` class, else ``"bi-encoder cosine"`` (an
    embedding model; a hub id is not looked into).

    Raises:
        ConfigError: a cross-encoder without exactly one label (vLLM's
            scoring needs ``num_labels == 1``: one relevance score per pair).
        ModelError: the model cannot be found (:func:`bulkinfer.models.resolve_model`).
    """
    import json

    path = Path(resolve_model(model))
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return BI_ENCODER
    architectures = config.get("architectures") or [] if isinstance(config, dict) else []
    cross = [name for name in architectures if isinstance(name, str) and name.endswith("ForSequenceClassification")]
    if not cross:
        return BI_ENCODER
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ConfigError(
            f"{model} is a classifier with {labels} labels ({cross[0]}): scoring needs a cross-encoder with "
            "one label (one relevance score per pair), as vLLM's scoring does"
        )
    return CROSS_ENCODER


def _describe(truncate: bool, planner: Planner) -> dict[str, Any]:
    """The scoring figures of the report."""
    return {"scoring": scoring_figures(truncate, planner)}


def scoring_figures(truncate: bool, planner: Planner) -> dict[str, Any]:
    """How a score job scores (``method``, from its planner's kind) and
    :func:`~bulkinfer.jobs.embed.encoder_figures` (``truncated_inputs``
    counts pairs for a cross-encoder, texts for a bi-encoder)."""
    figures = encoder_figures(truncate, planner)
    method = CROSS_ENCODER if isinstance(planner, CrossScorePlanner) else BI_ENCODER
    if method == CROSS_ENCODER:
        figures["normalize"] = None  # a classifier's score: nothing is normalized
    return {"method": method, **figures}
