"""``bulkinfer plan``: what an input file holds and what its run will cost,
without loading an engine.

It reads, validates and tokenizes exactly as ``run`` does (same reader, same
row rules, same planner), so its counts are the counts a run would report.
The time estimate is a range of seconds built from the calibrations of the
same model on this machine (``bulkinfer calibrate``, and runs of 64 rows or
more, stored under ``$BULKINFER_HOME/calibration.json``); with none, the plan
says so instead of giving a number (see
:func:`bulkinfer.report.plan_estimate.estimate`).
"""

from __future__ import annotations

import functools
import json
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.args import detect_device, this_machine
from bulkinfer.errors import ConfigError
from bulkinfer.io.readers import open_reader
from bulkinfer.jobs.engine_choice import block_size_choice, input_sample
from bulkinfer.jobs.tune import known_dtype
from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.prep.grammar import Grammars
from bulkinfer.prep.planner import Planner, efficiency, static_batch_tokens
from bulkinfer.prep.prefix import CPU_BLOCK_TOKENS, GPU_BLOCK_TOKENS
from bulkinfer.prep.rows import ROW_FIELDS_READ, to_request
from bulkinfer.prep.vocabulary import check_defaults, vocabulary
from bulkinfer.prep.windows import iter_windows
from bulkinfer.report.calibration import load_calibrations
from bulkinfer.report.plan_estimate import estimate
from bulkinfer.schema import RowError

DEFAULT_CONTEXT = 2048
MAX_EXAMPLES = 20


def context_length(model_path: str, settings: Settings) -> int:
    """The context a run would use, in tokens: ``--max-model-len``, else the
    model config's ``max_position_embeddings``, else 2048."""
    if settings.engine.max_model_len:
        return settings.engine.max_model_len
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return int(config.get("max_position_embeddings") or DEFAULT_CONTEXT)
    except (OSError, ValueError):
        return DEFAULT_CONTEXT


def block_tokens(settings: Settings) -> int | None:
    """The KV-cache block size a run would use, in tokens, or None when its
    prefix cache is off (``[engine] enable_prefix_caching = false``):
    ``[engine] block_size``, else vLLM's default for this device (128 on
    CPU, 16 on GPU; see :mod:`bulkinfer.prep.prefix`)."""
    extra = settings.engine.extra_args
    if extra.get("enable_prefix_caching") is False:
        return None
    if extra.get("block_size"):
        return int(extra["block_size"])
    return GPU_BLOCK_TOKENS if detect_device() == "cuda" else CPU_BLOCK_TOKENS


def percentile(sorted_values: Any, q: float) -> int:
    """Nearest-rank percentile (q in 0..100) of an ascending sequence."""
    if not len(sorted_values):
        return 0
    rank = max(1, -(-len(sorted_values) * q // 100))
    return int(sorted_values[int(min(rank, len(sorted_values))) - 1])


def plan_file(input_path: Path, settings: Settings, job: str = "run", truncate: bool = False) -> dict[str, Any]:
    """Read and tokenize ``input_path`` as ``run`` would (``job`` "run"),
    or as ``score`` would (``job`` "score", ``truncate`` as its
    ``--truncate``: the default encoder without a model, each row's texts
    or pairs tokenized and checked against ``max_seq_length``); return the plan.

    Keys: ``rows`` {``total``, ``valid``, ``failed``, ``skipped``},
    ``errors`` {type: count}, ``error_examples`` (first 20), ``prompt_tokens``
    {``min``, ``median``, ``p90``, ``p99``, ``max``, ``total``}, ``buckets``
    (as in the run report), ``padding_efficiency`` {``arrival``,
    ``bucketed``, ``sorted``} for static batches of ``batch_size``,
    ``max_completion_tokens`` (sum of the rows' ``max_tokens`` times their ``n``),
    ``prefix`` (the prompt tokens rows share in whole KV-cache blocks within a
    window, see :class:`~bulkinfer.prep.prefix.PrefixStats`; None when the
    prefix cache is off), ``block_size`` (the KV cache's block a run would
    choose on this CPU, as the run report's ``engine_choice.block_size``:
    ``block_size`` in tokens or None for vLLM's, ``why``; None on GPU, for a
    Ray cluster or a score job), ``estimate``
    (``generate_seconds`` and ``load_seconds`` as ``{"low", "high"}``, the
    ``calibrations`` it comes from, ``derivation``, ``assumes``; or None),
    ``estimate_source`` (where the estimate comes from, or why there is
    none), ``context``, ``seconds`` (the plan's own time); for a score job,
    ``scoring`` (``method`` "bi-encoder cosine" or "cross-encoder",
    ``max_seq_length``, ``normalize``, ``truncate``, ``truncated_inputs``)
    and no estimate (calibrations are of generation).

    Raises:
        InputFileError, ModelError: as ``run``; ConfigError: an unknown ``job``,
            or as ``score`` (a classifier of more than one label).
    """
    started = time.monotonic()
    parse: Any = to_request
    block_choice: dict[str, Any] | None = None
    if job == "score":
        settings, model, planner, parse, consumed = _score_parts(settings, truncate)
    elif job == "run":
        consumed = ROW_FIELDS_READ
        model = resolve_model(settings.model)
        tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
        vocab, grammars = vocabulary(tokenizer, model), Grammars(tokenizer, settings.engine)
        check_defaults(vocab, settings.sampling, grammars)
        settings = settings.resolve_chat_template(tokenizer)
        sample = functools.partial(input_sample, input_path, tokenizer, settings, to_request)
        settings, block_choice = block_size_choice(settings, detect_device(), sample)  # as the run chooses it
        length = context_length(model, settings)
        planner = Planner(tokenizer, settings.plan, length, block_tokens(settings), vocab, grammars)
    else:
        raise ConfigError(f"--job: expected run or score, got {job!r}")
    reader = open_reader(input_path, None if settings.passthrough else consumed)
    errors: Counter[str] = Counter()
    examples: list[dict[str, Any]] = []

    def on_error(error: RowError) -> None:
        errors[error.type] += 1
        if len(examples) < MAX_EXAMPLES:
            examples.append({"line": error.line, "id": error.id, "type": error.type, "message": error.message})

    lengths = array("i")
    max_completion = 0
    for window in iter_windows(reader, settings, on_error, parse=parse):
        planned, window_errors = planner.plan_window(window)
        for error in window_errors:
            on_error(error)
        lengths.extend(r.prompt_length for r in planned)
        max_completion += sum(r.max_completion_tokens for r in planned)
    planner.padding.finish()
    padding = planner.padding.to_report()
    batch = settings.plan.padding_batch_size
    ordered = sorted(lengths)
    real, padded = static_batch_tokens(ordered[::-1], batch)
    failed = sum(errors.values())
    total_prompt = sum(ordered)
    plan: dict[str, Any] = {
        "input": str(input_path),
        "model_path": model,
        "context": planner.max_model_len,
        "chat_template_applied": settings.apply_chat_template,
        "rows": {
            "total": len(ordered) + failed + reader.blank_lines,
            "valid": len(ordered),
            "failed": failed,
            "skipped": reader.blank_lines,
        },
        "errors": dict(errors),
        "error_examples": examples,
        "passthrough_fields": planner.passthrough_fields(),
        "sampling_set_by_rows": planner.sampling_set_by_rows(),
        "prompt_tokens": {
            "min": ordered[0] if ordered else 0,
            "median": percentile(ordered, 50),
            "p90": percentile(ordered, 90),
            "p99": percentile(ordered, 99),
            "max": ordered[-1] if ordered else 0,
            "total": total_prompt,
        },
        "buckets": padding["buckets"],
        "padding_efficiency": {
            "batch_size": batch,
            "arrival": padding["padding_efficiency"]["arrival"],
            "bucketed": padding["padding_efficiency"]["sorted"],
            "sorted": efficiency(real, padded),
        },
        "max_completion_tokens": max_completion,
        "prefix": planner.prefix.to_report() if planner.prefix is not None else None,
        "block_size": block_choice,
        "estimate": None,
    }
    if job == "score":
        from bulkinfer.jobs.score import scoring_figures

        plan["chat_template_applied"] = None
        plan["scoring"] = scoring_figures(truncate, planner)
        plan["estimate_source"] = "none for a score job: calibrations are of generation"
    else:
        plan["estimate"], plan["estimate_source"] = estimate(
            load_calibrations(),
            model,
            settings.model or DEFAULT_MODEL,
            this_machine(),
            max_completion,
            _run_engine(model, settings),
        )
    plan["seconds"] = time.monotonic() - started
    return plan


def _run_engine(model: str, settings: Settings) -> dict[str, Any]:
    """The engine settings a run would generate with, as far as they are
    known before it (``dtype``, ``enforce_eager``; None where not): the
    user's; on CPU the dtype probe's stored choice (:func:`known_dtype`);
    compilation is chosen per job by the run unless set."""
    dtype: str | None = settings.engine.dtype
    if dtype == "auto":
        choice = known_dtype(model) if detect_device() == "cpu" else None
        dtype = choice["dtype"] if choice else None
    return {"dtype": dtype, "enforce_eager": settings.engine.enforce_eager}


def _score_parts(settings: Settings, truncate: bool) -> tuple[Settings, str, Planner, Any, frozenset[str]]:
    """What a score job's plan reads the file with, as ``bulkinfer score``
    would: the settings (the default encoder without a model), the model
    directory, the planner (a bi- or cross-encoder's, sized by the model's
    ``max_position_embeddings`` or ``--max-model-len``, as vLLM sizes it),
    the row parser and the fields the rows consume.

    Raises:
        ConfigError, ModelError: as :func:`bulkinfer.jobs.score.scoring_method`.
    """
    from bulkinfer.jobs.embed import embedding_settings, sized_encoder_planner
    from bulkinfer.jobs.score import planner_kind, scoring_method
    from bulkinfer.prep.scores import SCORE_FIELDS_READ, to_score_request

    settings = embedding_settings(settings)
    model = resolve_model(settings.model)
    kind = planner_kind(scoring_method(model))
    tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
    planner = sized_encoder_planner(kind, truncate, tokenizer, settings, context_length(model, settings), model)
    return settings, model, planner, to_score_request, SCORE_FIELDS_READ
