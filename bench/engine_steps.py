"""Does the progress line see every engine step apart? A real run of the
labelling job (``bench.eta_trace``'s ``steady``: rows of 4-16 random words,
``max_tokens`` 8) with the in-process engine core's steps
(``vllm.v1.engine.core.EngineCore.step``) and the progress line's ticks
(:meth:`bulkinfer.report.progress.Progress.tick`) timed; counts, for each
tick whose token counts moved, the engine steps that ran a model since the
last such tick: 1 everywhere means the ETA's step model
(:meth:`bulkinfer.report.eta.WorkEstimate.observe`) saw each step apart.

``python -m bench.engine_steps [--rows 5000] [--tag T]`` writes
``bench/results/engine-steps-T.{json,md}``. One engine: nothing else on the cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from bench.measure import machine, versions

RESULTS = Path(__file__).resolve().parent / "results"


def record(rows: int) -> list[list[Any]]:
    """The run's events: ``["e", t, model_ran]`` per engine step,
    ``["t", t, generated, prefilled]`` per progress tick."""
    import vllm.v1.engine.core as core

    import bulkinfer.report.progress as progress
    from bench.scale import write_rows
    from bulkinfer import load_settings, run

    events: list[list[Any]] = []
    for name in ("step", "step_with_batch_queue"):
        original = getattr(core.EngineCore, name)

        def timed(self: Any, _original: Any = original) -> Any:
            out = _original(self)
            events.append(["e", time.monotonic(), bool(out[1])])
            return out

        setattr(core.EngineCore, name, timed)
    tick = progress.Progress.tick

    def on_tick(self: Any, generated: int, prefilled: int, *args: Any) -> None:
        events.append(["t", time.monotonic(), generated, prefilled])
        tick(self, generated, prefilled, *args)

    progress.Progress.tick = on_tick  # type: ignore[assignment,method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "steady.jsonl"
        write_rows(src, rows)
        settings = load_settings(overrides={"sampling.max_tokens": 8})
        result = run(src, Path(tmp) / "out.jsonl", settings=settings, overwrite=True, progress_plain=True)
    if not result.report["engine"].get("in_process"):
        raise SystemExit("bench.engine_steps: the engine ran in processes of its own: its steps are not seen here")
    return events


def steps_per_tick(events: list[list[Any]]) -> Counter[int]:
    """For each tick whose counts moved: the steps that ran a model since the last one."""
    counts: Counter[int] = Counter()
    ran, last = 0, None
    for event in events:
        if event[0] == "e":
            ran += event[2]
        elif last is None or event[2:4] != last:
            counts[ran] += 1
            ran, last = 0, event[2:4]
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--tag", default="default")
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.engine_steps", *(argv if argv is not None else sys.argv[1:])])
    counts = steps_per_tick(record(args.rows))
    print(dict(counts), file=sys.stderr)
    m = machine()
    doc = {
        "command": command,
        "machine": m,
        "versions": versions(),
        "steps_per_tick": {str(k): n for k, n in sorted(counts.items())},
    }
    (RESULTS / f"engine-steps-{args.tag}.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    table = "\n".join(f"| {k} | {n} |" for k, n in sorted(counts.items()))
    (RESULTS / f"engine-steps-{args.tag}.md").write_text(
        f"# Engine steps per progress tick ({m['cpu']} ({m.get('cpu_kind', '')}), {m['logical_cores']} cores)\n\n"
        f"Command: `{command}`. Ticks whose token counts moved, by the engine steps that ran a model since "
        "the last one (1: each step seen apart).\n\n| steps | ticks |\n| --: | --: |\n" + table + "\n"
    )


if __name__ == "__main__":
    main()
