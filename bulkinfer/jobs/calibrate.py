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
from bulkinfer.engine.args import this_machine
from bulkinfer.engine.base import EngineFactory
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.engine.log import EngineLog
from bulkinfer.errors import EngineError, ModelError
from bulkinfer.jobs.output_files import RunPaths
from bulkinfer.jobs.run import run
from bulkinfer.models import resolve_model
from bulkinfer.report.calibration import calibration_path, generated_by_attempt, record_calibration
from bulkinfer.stop import StopToken

CALIBRATION_ROWS = 64


CALIBRATION_MAX_TOKENS = 64


def calibrate(
    settings: Settings,
    engine_factory: EngineFactory = vllm_engine,
    verbose: bool = False,
    stop: StopToken | None = None,
) -> dict[str, Any]:
    """Measure this machine: run a short fixed workload (64 chat prompts x 64
    completion tokens, ``ignore_eos``) through the real engine, record its
    throughput as the model's calibration on this machine (source
    ``"calibrate"``, see :mod:`bulkinfer.report.calibration`), and return
    that entry. The engine's log goes to ``$BULKINFER_HOME/calibrate.log``
    unless ``verbose``.

    Raises:
        ModelError, EngineError: as ``run``; EngineError also when the engine
        generated less than the workload (too little to estimate from).
    """
    resolve_model(settings.model)  # a model that cannot be found fails here, before the engine's log opens
    topics = ["the sea", "a city at night", "an old clock", "bread", "a mountain road", "winter", "a library", "rain"]
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
                report = run(paths, fixed, engine_factory=engine_factory, verbose=verbose, stop=stop).report
            except (EngineError, ModelError) as exc:
                raise log.explain(exc) from exc
    entry = record_calibration(report, this_machine(), source="calibrate")
    if entry is None:
        rows, tokens = generated_by_attempt(report)
        raise EngineError(
            f"the calibration generated {rows} rows and {tokens} completion tokens, "
            f"less than the {CALIBRATION_ROWS} x {CALIBRATION_MAX_TOKENS} it asked for; nothing recorded"
        )
    return entry
