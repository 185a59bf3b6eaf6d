"""``bulkinfer score``: pairs scored and documents reranked by a bi-encoder,
streamed as ``embed`` is.

The same pipeline as :func:`bulkinfer.jobs.embed.embed` (windows, the one
feed loop, spools, resume, lock, atomic publish, report JSON and HTML) with
scoring rows (:mod:`bulkinfer.prep.scores`): every text of a row is embedded
on its own by vLLM's pooling runner, and a pair's score (a document's
relevance to its query) is the cosine of the two vectors, computed in
float64 where the output record is built
(:func:`bulkinfer.io.records.score_record`): as vLLM's ``LLM.score`` does for
embedding models and sentence-transformers' ``util.cos_sim``.

Cross-encoders (``*ForSequenceClassification`` models, which read both
texts at once and output the score) are refused for now.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.errors import ConfigError
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.embed import embedding_settings, encoder_figures, encoder_planner
from bulkinfer.jobs.run import Job, RunReport, run
from bulkinfer.models import resolve_model
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.scores import SCORE_FIELDS, SCORE_TEXT_COLUMNS, ScorePlanner, to_score_request

# Where ``bulkinfer score`` writes without -o: JSONL beside the input (a
# score or a short ranking per row: text a person reads; -o x.parquet for Parquet).
DEFAULT_SUFFIX = ".scores.jsonl"
METHOD = "bi-encoder cosine"


def score(paths: RunPaths, settings: Settings, context: RunContext | None = None, truncate: bool = False) -> RunReport:
    """Score every row of ``paths.input`` (pair rows: ``text_1``, ``text_2``;
    rerank rows: ``query``, ``documents``, ``top_n``; see
    :mod:`bulkinfer.prep.scores`); write the output (see
    :func:`bulkinfer.io.records.score_record`), errors, report
    (``OUT.report.json``, ``job`` "score", with ``scoring``: ``method``
    "bi-encoder cosine", ``max_seq_length`` (tokens), ``normalize``,
    ``truncate``, ``truncated_inputs`` (texts cut)) and HTML report files.

    ``settings.model`` None means the default encoder (all-MiniLM-L6-v2);
    else a local embedding model directory or prepared model name. A text
    over the encoder's ``max_seq_length`` tokens fails its row
    (``context_length_exceeded``, naming the field and both counts) unless
    ``truncate``: then each text is cut to that length on its own (both
    sides of a pair, the query and every document), as
    sentence-transformers' ``encode`` cuts it. ``truncate`` is part of what
    ``--resume`` checks.

    ``context``: as for :func:`bulkinfer.jobs.run.run`. Returns and raises
    as that function (exit 0, or 3 when some rows failed), and:

    Raises:
        ConfigError: the model is a cross-encoder (its ``config.json``
            names a ``*ForSequenceClassification`` architecture), checked
            before any file is written.
    """
    settings = embedding_settings(settings)
    refuse_cross_encoder(settings.model)
    job = Job(
        parse=to_score_request,
        planner=functools.partial(encoder_planner, ScorePlanner, truncate),
        journal={"score": {"method": METHOD, "truncate": truncate}},
        calibrate=False,
        kind="score",
        describe=functools.partial(_describe, truncate),
        text_columns=SCORE_TEXT_COLUMNS,
        consumed=frozenset({"id", *SCORE_FIELDS}),
    )
    return run(paths, settings, context, job=job)


def refuse_cross_encoder(model: str | None) -> None:
    """Refuse a cross-encoder: a local model directory whose ``config.json``
    ``architectures`` names a ``*ForSequenceClassification`` class (a hub id
    is not looked into).

    Raises:
        ConfigError: it is one (the message says cross-encoder scoring is not built yet).
        ModelError: the model cannot be found (:func:`bulkinfer.models.resolve_model`).
    """
    import json

    path = Path(resolve_model(model))
    try:
        architectures = json.loads((path / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return
    cross = [name for name in architectures if isinstance(name, str) and name.endswith("ForSequenceClassification")]
    if cross:
        raise ConfigError(
            f"{model} is a cross-encoder ({cross[0]}): cross-encoder scoring is not built yet; "
            "`bulkinfer score` scores with an embedding model (a bi-encoder): leave out --model for the "
            "default encoder, or give a sentence-transformers embedding model"
        )


def _describe(truncate: bool, planner: Planner) -> dict[str, Any]:
    """The scoring figures of the report."""
    return {"scoring": {"method": METHOD, **encoder_figures(truncate, planner)}}
