"""``bulkinfer calibrate``: measure this machine with a short fixed workload;
``plan`` estimates run times from what it stores
(:mod:`bulkinfer.report.calibration`)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.engine.args import detect_device, this_machine
from bulkinfer.engine.base import EngineFactory
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.engine.log import EngineLog
from bulkinfer.errors import EngineError, ModelError
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.compile_choice import measure_compile
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.jobs.tune import TOPICS, dtype_machine, measured_settings, print_to_stderr, probe_dtype, tune
from bulkinfer.models import resolve_model
from bulkinfer.report.calibration import calibration_path, generated_by_attempt, record_calibration, record_choice
from bulkinfer.stop import StopToken

CALIBRATION_ROWS = 64


CALIBRATION_MAX_TOKENS = 64


def calibrate(
    settings: Settings,
    engine_factory: EngineFactory = vllm_engine,
    verbose: bool = False,
    stop: StopToken | None = None,
    tune_scheduler: bool = False,
    compile_break_even: bool = False,
) -> dict[str, Any]:
    """Measure this machine for the model: the dtype probe (unless the
    settings force a dtype) and, with ``tune_scheduler``, vLLM's scheduler
    limits (both stored per model and machine, see
    :mod:`bulkinfer.jobs.tune`); then a short fixed workload (64 chat prompts
    x 64 completion tokens, ``ignore_eos``) with what was chosen, its
    throughput recorded as the model's calibration on this machine (source
    ``"calibrate"``, see :mod:`bulkinfer.report.calibration`). With
    ``compile_break_even``, on CPU, eager against compiled engines first
    (:func:`~bulkinfer.jobs.compile_choice.measure_compile`: the break-even
    runs decide by; the compile cache is warm afterwards). Returns
    ``{"calibration": that entry, "dtype_probe", "tuned", "compile"}`` (the
    stored choices, or None).
    The engines' log goes to ``$BULKINFER_HOME/calibrate.log`` unless
    ``verbose``.

    Raises:
        ModelError, EngineError: as ``run``; EngineError also when the engine
        generated less than the workload (too little to estimate from).
    """
    model = resolve_model(settings.model)  # a model that cannot be found fails here, before the engine's log opens
    topics = TOPICS
    sampling = dataclasses.replace(
        settings.sampling, max_tokens=CALIBRATION_MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    fixed = dataclasses.replace(settings, sampling=sampling, apply_chat_template=True)
    with tempfile.TemporaryDirectory(prefix="bulkinfer-calibrate-") as tmp:
        src = Path(tmp) / "calibrate.jsonl"
        src.write_bytes(b"".join(
            orjson.dumps({"id": f"c{i}", "prompt": f"Write a short paragraph about {topics[i % len(topics)]}."}) + b"\n"
            for i in range(CALIBRATION_ROWS)
        ))  # fmt: skip
        paths = RunPaths.build(src, Path(tmp) / "out.jsonl")
        log_path = calibration_path().with_name("calibrate.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with EngineLog(log_path, verbose) as log:
            try:
                probe = tuned = compiled = None
                if settings.engine.dtype == "auto" and detect_device() == "cpu":
                    result = probe_dtype(model, settings, engine_factory, say=print_to_stderr)
                    probe = record_choice("dtype", model, dtype_machine(), result)
                if tune_scheduler:
                    tuned = tune(model, settings, engine_factory, say=print_to_stderr)
                if compile_break_even and detect_device() == "cpu":
                    measured, _ = measured_settings(model, settings, "cpu", engine_factory)  # the runs' dtype
                    compiled = measure_compile(model, measured, engine_factory, say=print_to_stderr)
                context = RunContext(stop=stop or StopToken(), verbose=verbose, engine_factory=engine_factory)
                report = run(paths, fixed, context).report
            except (EngineError, ModelError) as exc:
                raise log.explain(exc) from exc
    entry = record_calibration(report, this_machine(), source="calibrate")
    if entry is None:
        rows, tokens = generated_by_attempt(report)
        raise EngineError(
            f"the calibration generated {rows} rows and {tokens} completion tokens, "
            f"less than the {CALIBRATION_ROWS} x {CALIBRATION_MAX_TOKENS} it asked for; nothing recorded"
        )
    return {"calibration": entry, "dtype_probe": probe, "tuned": tuned, "compile": compiled}
