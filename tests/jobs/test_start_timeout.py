"""A run's model load and engine start may take ``plan.start_timeout_s``
(``--start-timeout-s``): past it the CLI ends the run with exit 5 and a message
naming the setting, the engine's processes killed, nothing run and nothing
left in the way of the next run. The engine here is a stand-in that takes
long to start (tests/fault_driver.py, the CLI's signal handling and exit);
tests/e2e/test_e2e_faults.py ends a real engine's start."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson
from fakes import FakeEngine

from bulkinfer.cli import StopSignals
from bulkinfer.config import load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run

HERE = Path(__file__).resolve().parents[1]  # tests/, where fault_driver.py is


def make_input(tmp_path: Path, n: int = 6) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "word " * (i + 1)}) + b"\n" for i in range(n)))
    return src


def driver(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(HERE / "fault_driver.py"), str(src), str(out), "--step-delay", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_start_past_its_deadline_ends_the_run_with_exit_5_and_the_next_run_finishes(tmp_path: Path) -> None:
    src, out = make_input(tmp_path), tmp_path / "out.jsonl"
    began = time.monotonic()
    stuck = driver(src, out, "--slow-start", "60", "--start-timeout", "1")
    assert stuck.returncode == 5, stuck.stderr[-2000:]
    assert time.monotonic() - began < 30  # the deadline and its watcher's 0.5 s poll, not the 60 s start
    [error] = [line for line in stuck.stderr.splitlines() if line.startswith("bulkinfer: error:")]
    assert error == (
        "bulkinfer: error: the model load and engine start took over 1 s (plan.start_timeout_s): stopped before "
        "any row was run; if the model needs longer, raise --start-timeout-s, else see the engine's log"
    )
    assert not out.exists()
    again = driver(src, out, "--slow-start", "0.2", "--start-timeout", "30")  # neither --resume nor --overwrite
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(orjson.loads(line)["id"] for line in out.read_bytes().splitlines()) == [f"r{i}" for i in range(6)]


def test_a_start_within_its_deadline_runs_and_the_deadline_ends_with_the_load(tmp_path: Path) -> None:
    """A 0.5 s start under a 1.5 s deadline, then generation that outlasts the
    deadline: only the load is timed. The tokenizer is loaded first: its
    first load in a process (importing transformers) takes seconds, and a
    deadline passed here would end the test's own process."""
    from bulkinfer.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    paths = RunPaths.build(make_input(tmp_path, 12), tmp_path / "out.jsonl")

    def factory(model: str, s: object) -> FakeEngine:
        time.sleep(0.5)
        return FakeEngine(step_delay=0.35)  # 6 steps of two rows: 2.1 s of generation

    settings = load_settings(None, {"plan.max_in_flight": 2, "plan.start_timeout_s": 1.5})
    context = RunContext(engine_factory=factory, tokenizer_factory=lambda m, t: tokenizer)
    with StopSignals() as stop:
        result = run(paths, settings, context.replace(stop=stop))
        assert stop.load_deadline is None
    assert result.exit_code == 0 and result.report["seconds"]["generate"] > 1.5
