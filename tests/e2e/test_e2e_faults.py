"""Faults with the real CLI, the real vLLM engine and the default model.

One job lives through three runs, each a test that needs the one before
(module fixtures, in order):

1. its engine core is killed mid-run (what the OOM killer does): exit 5
   within seconds, the finished rows kept;
2. ``--resume``; a second run meanwhile is refused by the lock; the resumed
   run is killed with ``kill -9`` mid-run: its engine processes go too;
3. ``--resume`` again finishes: every id exactly once, and the
   ``--engine-arg`` the three runs were given reached vLLM.

Then ``kill -9`` during the model load, a double SIGINT during the engine
start, and a start past ``--start-timeout-s``. The first two runs and these keep vLLM's engine in child
processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as replicas and GPUs run it;
one CPU engine runs in bulkinfer's process by default, as the third run does).
(A poison row among good ones is part of test_e2e.py's run.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from e2e_helpers import (
    SAMPLE,
    bulkinfer,
    engine_children,
    read_jsonl,
    read_report,
    spool_lines,
    start,
    wait_until,
    without_flight_limit,
)
from e2e_helpers import write_jsonl as write_rows

from bench.faults import vllm_children, vllm_processes_since
from bulkinfer.io.spool import spool_records

pytestmark = pytest.mark.e2e

ROWS = 30
# four requests in flight: rows finish a few at a time, so each kill lands mid-run; any vLLM EngineArgs field
# reaches the engine (read back from vLLM's own config into the report)
# vLLM's engine core and worker in processes of their own (a user's choice; bulkinfer's for replicas and GPUs)
PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
FLAGS = ["--max-tokens", "32", "--temperature", "0", "--max-in-flight", "4", "--plain-progress",
         "--engine-arg", "enable_prefix_caching=false"]  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("faults")
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    write_rows(src, read_jsonl(SAMPLE / "sharegpt.jsonl")[:ROWS])
    return {"src": src, "out": out, "spool": tmp / ".out.jsonl.partial.jsonl", "tmp": tmp}


def run_args(job: dict[str, Any], *extra: str) -> list[str]:
    return ["run", str(job["src"]), "-o", str(job["out"]), *FLAGS, *extra]


@pytest.fixture(scope="module")
def core_killed(job: dict[str, Any]) -> dict[str, Any]:
    run = start(*run_args(job), env=PROCESSES)
    wait_until(lambda: spool_lines(job["spool"]) >= 3, run)
    core = [p for p in vllm_children(run.pid) if "EngineCore" in " ".join(p.cmdline())]
    assert core, "no engine core process found"
    killed = time.monotonic()
    core[0].kill()  # what the out-of-memory killer does
    _, stderr = run.communicate(timeout=60)
    return {"code": run.returncode, "stderr": stderr, "seconds": time.monotonic() - killed,
            "kept": [record for _, record in spool_records(job["spool"])]}  # fmt: skip


def test_engine_core_killed_mid_run_exits_5_and_keeps_the_finished_rows(
    job: dict[str, Any], core_killed: dict[str, Any]
) -> None:
    stderr = core_killed["stderr"]
    assert core_killed["code"] == 5, stderr[-3000:]
    assert core_killed["seconds"] < 30  # measured: 2.1 s (bench/results/faults.md)
    error = next((line for line in stderr.splitlines() if line.startswith("bulkinfer: error:")), stderr[-2000:])
    # how the death is seen first can vary (the process table, vLLM's own engine-dead flag); the line says so
    assert "vLLM engine" in error and "--resume" in error, error
    assert any(how in error for how in ("killed by SIGKILL", "engine core died", "engine died")), error
    assert len(core_killed["kept"]) >= 3 and not job["out"].exists()


@pytest.fixture(scope="module")
def driver_killed(job: dict[str, Any], core_killed: dict[str, Any]) -> dict[str, Any]:
    before = len(core_killed["kept"])
    run = start(*run_args(job, "--resume"), env=PROCESSES)
    wait_until(lambda: spool_lines(job["spool"]) >= before + 3, run)
    refused = bulkinfer(*run_args(job, "--resume"))
    engines = engine_children(run.pid)
    run.kill()
    run.wait()
    _, alive = psutil.wait_procs(engines, timeout=60)
    return {"refused": refused, "engines": engines, "alive": alive, "kept": len(list(spool_records(job["spool"])))}


def test_kill_9_of_a_resumed_run_takes_its_engine_processes_along(driver_killed: dict[str, Any]) -> None:
    refused = driver_killed["refused"]
    assert refused.returncode == 7 and "another bulkinfer run" in refused.stderr
    assert driver_killed["engines"], "no engine processes found"
    assert not driver_killed["alive"], f"engine processes outlived bulkinfer: {driver_killed['alive']}"


def test_resume_after_both_kills_completes_every_id_once(job: dict[str, Any], driver_killed: dict[str, Any]) -> None:
    # nothing stops this run: its rows run at once, not four at a time (a plan setting, free to change on --resume)
    resumed = bulkinfer(*without_flight_limit(run_args(job, "--resume")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(r["id"] for r in read_jsonl(job["out"])) == sorted(r["id"] for r in read_jsonl(job["src"]))
    report = read_report(job["tmp"] / "out.report.json")
    assert report["resumed"]["completed"] == driver_killed["kept"]
    assert report["engine"]["in_process"] is True  # the default for one CPU engine: resumed in bulkinfer's process
    assert report["request_counts"]["completed"] == ROWS
    assert report["engine"]["enable_prefix_caching"] is False


def test_kill_9_during_the_model_load_leaves_no_engine_process(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [{"id": "a", "prompt": "hello"}])
    run = start("run", str(src), "-o", str(out), "--plain-progress", env=PROCESSES)
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
    write_rows(src, [{"id": "a", "prompt": "hello"}])
    run = start("run", str(src), "-o", str(out), "--plain-progress", env=PROCESSES)
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


def test_a_start_past_its_timeout_exits_5_and_takes_the_engine_processes_along(tmp_path: Path) -> None:
    """``--start-timeout-s 12``: the deadline passes during the load (where depends on the CPU: the
    tokenizer's load 3-10 s, importing vLLM 6-13 s, then vLLM's engine core in its child processes, spawned
    6-7 s in on an AMX Xeon, where the whole load took 17-27 s: 20 s once let it finish); the run exits 5 with
    the message, and no process started for the engine outlives it."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [{"id": "a", "prompt": "hello"}])
    run = start("run", str(src), "-o", str(out), "--plain-progress", "--start-timeout-s", "12", env=PROCESSES)
    started = psutil.Process(run.pid).create_time()
    seen: dict[int, psutil.Process] = {}
    while run.poll() is None:  # vLLM's engine core, also while it still imports (before it takes its VLLM:: title)
        seen.update((p.pid, p) for p in engine_children(run.pid, spawned=True))
        time.sleep(0.2)
    _, stderr = run.communicate(timeout=30)
    assert run.returncode == 5, stderr[-3000:]
    message = "bulkinfer: error: the model load and engine start took over 12 s (plan.start_timeout_s)"
    assert message in stderr
    assert message in (tmp_path / "out.log").read_text()  # the engine's log says why it ends there
    print(f"engine processes seen before the deadline: {len(seen)}")
    _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
    assert not alive, f"engine processes outlived bulkinfer: {alive}"
    time.sleep(1.0)
    assert vllm_processes_since(started) == []
    # no row ran: no spool, no output (the journal of the job's settings may be there: it holds no rows, and the
    # next run, with or without --resume, starts clean: tests/jobs/test_start_timeout.py)
    assert {p.name for p in tmp_path.iterdir()} <= {".out.lock", ".out.jsonl.journal.json", "in.jsonl", "out.log"}
