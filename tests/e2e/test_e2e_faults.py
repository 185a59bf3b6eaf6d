"""Faults with the real CLI, the real vLLM engine and the default model: the
engine core killed mid-run (what the OOM killer does), ``kill -9`` during
the model load, and signals during the engine start. (A poison row among good
ones is part of tests/e2e/test_e2e.py's shared run.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from bench.faults import vllm_children, vllm_processes_since
from bulkinfer.io.spool import spool_records

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_data"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def start(src: Path, out: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--plain-progress", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def wait_until(predicate, proc: subprocess.Popen[str], timeout: float = 600) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended first: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_engine_core_killed_mid_run_exits_5_and_resume_completes(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in read_jsonl(SAMPLE / "sharegpt.jsonl")[:30]))
    flags = ["--max-tokens", "48", "--temperature", "0", "--max-in-flight", "4"]  # rows finish a few at a time
    run = start(src, out, *flags)
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    wait_until(lambda: spool.exists() and spool.read_bytes().count(b"\n") >= 3, run)
    core = [p for p in vllm_children(run.pid) if "EngineCore" in " ".join(p.cmdline())]
    assert core, "no engine core process found"
    killed = time.monotonic()
    core[0].kill()  # what the out-of-memory killer does
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 5, stderr[-3000:]
    assert time.monotonic() - killed < 30  # measured: 2.1 s (bench/results/faults.md)
    error = next((line for line in stderr.splitlines() if line.startswith("bulkinfer: error:")), stderr[-2000:])
    # how the death is seen first can vary (the process table, vLLM's own engine-dead flag); the line says so
    assert "vLLM engine" in error and "--resume" in error, error
    assert any(how in error for how in ("killed by SIGKILL", "engine core died", "engine died")), error
    kept = [record for _, record in spool_records(spool)]
    assert len(kept) >= 3 and not out.exists()

    resumed = subprocess.run(
        [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--resume", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(r["id"] for r in read_jsonl(out)) == sorted(r["id"] for r in read_jsonl(src))
    report = orjson.loads((tmp_path / "out.report.json").read_bytes())
    assert report["resumed"]["completed"] == len(kept)


def test_kill_9_during_the_model_load_leaves_no_engine_process(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(orjson.dumps({"id": "a", "prompt": "hello"}) + b"\n")
    run = start(src, out)
    wait_until(lambda: bool(vllm_children(run.pid)), run)  # the engine core is loading the model now
    seen = vllm_children(run.pid)
    started = psutil.Process(run.pid).create_time()
    run.kill()
    run.wait()
    _, alive = psutil.wait_procs(seen, timeout=30)
    assert not alive, f"engine processes outlived bulkinfer: {alive}"
    time.sleep(1.0)
    assert vllm_processes_since(started) == [], "a process started for the engine is still alive"


def test_a_double_sigint_during_the_engine_start_exits_130_at_once(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(orjson.dumps({"id": "a", "prompt": "hello"}) + b"\n")
    run = start(src, out)
    wait_until(lambda: bool(vllm_children(run.pid)), run)
    time.sleep(2.0)
    seen = vllm_children(run.pid)
    sent = time.monotonic()
    run.send_signal(signal.SIGINT)
    time.sleep(0.2)
    if run.poll() is None:
        run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=30)
    assert run.returncode == 130, stderr[-3000:]
    assert time.monotonic() - sent < 2  # measured: ~0.3 s
    # the first SIGINT's message, or the second's when it came while the first was being handled
    assert "stopped by SIGINT before any row was run" in stderr or "stopped at once by a second SIGINT" in stderr
    _, alive = psutil.wait_procs(seen, timeout=10)
    assert not alive
    # nothing in the next run's way; the engine's log of the start is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "in.jsonl", "out.log"]
