"""``bulkinfer embed``: every row's text through an embedding model, streamed as ``run`` is.

The same pipeline as :func:`bulkinfer.jobs.run.run` (windows, length-sorted
feeding through the one feed loop, spools, resume, lock, atomic publish,
report JSON and HTML), with embedding rows
(:mod:`bulkinfer.prep.embeddings`), vLLM's pooling runner
(``runner="pooling"``, ``PoolingParams(task="embed")``) and an
``embedding`` column written as ``fixed_size_list<float32>[dim]`` in Parquet.

Normalisation follows the model's sentence-transformers config: vectors are
L2-normalized when its ``modules.json`` lists a ``Normalize`` module (the
default encoder, all-MiniLM-L6-v2, does), as ``SentenceTransformer.encode``
and vLLM's own pooler config read it; the report says which
(``embedding.normalize``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_ENCODER
from bulkinfer.engine.base import Engine
from bulkinfer.io.files import OutputColumns
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import Job, RunReport, run
from bulkinfer.models import encoder_config
from bulkinfer.prep.embeddings import EMBED_FIELDS_READ, TEXT_FIELDS, EmbedPlanner, to_embed_request
from bulkinfer.prep.planner import Planner

# Where ``bulkinfer embed`` writes without -o: Parquet beside the input.
DEFAULT_SUFFIX = ".embeddings.parquet"


def embed(paths: RunPaths, settings: Settings, context: RunContext | None = None, truncate: bool = False) -> RunReport:
    """Embed every row of ``paths.input``; write the output (one vector per
    row, see :func:`bulkinfer.io.records.embedding_record`), errors, report
    (``OUT.report.json``: rows/s and prompt tokens/s in ``throughput``,
    seconds by phase, and ``embedding``: ``max_seq_length``, ``normalize``,
    ``truncate``, ``truncated_inputs``) and HTML report files.

    ``settings.model`` None means the default encoder (all-MiniLM-L6-v2,
    prepared under ``$BULKINFER_HOME``); else a local embedding model
    directory or prepared model name. An input over the encoder's
    ``max_seq_length`` tokens fails its row (``context_length_exceeded``,
    with both counts) unless ``truncate`` (then it is cut to that length,
    as sentence-transformers does). ``truncate`` is part of what
    ``--resume`` checks.

    ``context``: the invocation's choices, as for :func:`bulkinfer.jobs.run.run`.
    Returns and raises as that function (exit 0, or 3 when some rows failed).
    """
    return run(paths, embedding_settings(settings), context, job=embed_job(truncate))


def embed_job(truncate: bool, kind: type[EmbedPlanner] = EmbedPlanner) -> Job:
    """The :class:`~bulkinfer.jobs.run.Job` of an embedding run (see :func:`embed`), planned by ``kind``."""
    return Job(
        parse=to_embed_request,
        planner=functools.partial(encoder_planner, kind, truncate),
        journal={"embed": {"truncate": truncate}},
        columns=OutputColumns(  # an embedding row's own columns (bulkinfer.io.records.embedding_record)
            ("embedding",), (("id", "string"), ("embedding", "list<float32>"), ("prompt_tokens", "int64"))
        ),
        calibrate=False,
        kind="embed",
        describe=functools.partial(_describe, truncate),
        text_columns=TEXT_FIELDS,
        consumed=EMBED_FIELDS_READ,
    )


def embedding_settings(settings: Settings) -> Settings:
    """``settings`` for an embedding engine: the default encoder when no
    model is given, and vLLM's ``runner="pooling"`` unless ``[engine] runner`` is set."""
    engine = dataclasses.replace(settings.engine, extra_args={"runner": "pooling", **settings.engine.extra_args})
    return dataclasses.replace(settings, model=settings.model or DEFAULT_ENCODER, engine=engine)


def encoder_planner(
    kind: type[EmbedPlanner], truncate: bool, tokenizer: Any, settings: Settings, engine: Engine, model_path: str
) -> Planner:
    """An encoder job's planner (``kind``: :class:`EmbedPlanner` or a
    subclass) for ``engine``: :func:`sized_encoder_planner` at its ``max_model_len``."""
    return sized_encoder_planner(kind, truncate, tokenizer, settings, engine.max_model_len, model_path)


def sized_encoder_planner(
    kind: type[EmbedPlanner], truncate: bool, tokenizer: Any, settings: Settings, max_model_len: int, model_path: str
) -> EmbedPlanner:
    """An encoder job's planner: the encoder's ``max_seq_length`` (at most
    ``max_model_len``, tokens) and normalisation from its sentence-transformers config."""
    config = encoder_config(model_path)
    limit = min(config.max_seq_length or max_model_len, max_model_len)
    return kind(tokenizer, settings.plan, limit, truncate=truncate, normalize=config.normalize)


def encoder_figures(truncate: bool, planner: Planner) -> dict[str, Any]:
    """What an encoder job's report says of its inputs: ``max_seq_length``
    (tokens), ``normalize``, ``truncate`` and ``truncated_inputs`` (texts cut)."""
    return {
        "max_seq_length": planner.max_model_len,
        "normalize": getattr(planner, "normalize", None),
        "truncate": truncate,
        "truncated_inputs": getattr(planner, "truncated_inputs", 0),
    }


def _describe(truncate: bool, planner: Planner) -> dict[str, Any]:
    """The embedding figures of the report."""
    return {"embedding": encoder_figures(truncate, planner)}
