"""What the end-to-end modules share: the CLI in a subprocess, JSONL files,
the engine processes of a run, and ``kill -9`` of a real run then ``--resume``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_data"
# Questions the default model answers right with a margin in float32 and bfloat16 (the smallest gap between its two
# likeliest tokens over the first ten of the answer: 0.75-1.25 nats on an AMX Xeon, 2026-11-28). Not France: its
# chat answer is a near tie in float32 itself (0.08 nats), and bfloat16 on that Xeon answers "L'Etoile, ...".
CAPITALS = {"japan": "Tokyo", "kenya": "Nairobi", "sweden": "Stockholm"}

# The smallest KV cache vLLM starts the default model with in float32 (bulkinfer's floor: one 8,192-token request
# and two blocks of 128 tokens, 46,080 bytes each), for the runs whose cache bulkinfer does not size (a stream, a Ray
# cluster): 0.36 GiB, touched at each engine start (vLLM zeroes it), where vLLM's CPU default is 25% of memory.
SMALL_KV_CACHE = ["--kv-cache-memory-bytes", str(8448 * 46_080)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[Any]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def read_report(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = orjson.loads(path.read_bytes())
    return report


def bulkinfer(
    *args: str, timeout: float = 900, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m bulkinfer ARGS`` from the repository's root, with ``env``
    added to the environment; its output captured."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "bulkinfer", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
        cwd=ROOT,
    )


def start(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m bulkinfer ARGS`` in the background, with ``env`` added to
    the environment; standard error kept (read it once it ended). Its SIGINT
    and SIGHUP are the default, as a terminal's job has them: the tests may
    run as a background job of a script, which ignores SIGINT, and
    bulkinfer keeps a signal it was started ignoring (nohup)."""
    return subprocess.Popen(
        [sys.executable, "-m", "bulkinfer", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=_default_stop_signals,
    )


def _default_stop_signals() -> None:
    """In the child before it runs bulkinfer: SIGINT and SIGHUP not ignored."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def wait_until(predicate: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 600) -> None:
    """Polls ``predicate`` every 50 ms; fails if ``proc`` ends first or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended first (exit {proc.returncode}): {proc.stderr.read() if proc.stderr else ''}"
            )
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def spool_lines(spool: Path) -> int:
    return spool.read_bytes().count(b"\n") if spool.exists() else 0


def engine_children(driver: int, spawned: bool = False) -> list[psutil.Process]:
    """The vLLM processes (``VLLM::...`` titles) a bulkinfer run started; with
    ``spawned``, also those multiprocessing spawned (``spawn_main``) that have
    not imported enough yet to take their ``VLLM::`` title."""
    marks = ("VLLM", "spawn_main") if spawned else ("VLLM",)
    try:
        return [
            p for p in psutil.Process(driver).children(recursive=True) if any(m in " ".join(p.cmdline()) for m in marks)
        ]
    except psutil.Error:
        return []


# The flags of a killed `run`: short completions, deterministic.
RUN_FLAGS = ("--max-tokens", "24", "--temperature", "0")


def kill_9_mid_run(
    tmp_path: Path,
    *extra: str,
    rows: int = 32,
    engines: Callable[[int], list[psutil.Process]] | None = engine_children,
    command: str = "run",
    data: list[Any] | None = None,
) -> dict[str, Any]:
    """``kill -9`` of a real ``bulkinfer COMMAND`` (flags ``extra``; ``run``
    also gets :data:`RUN_FLAGS`) on ``data`` (default: the first ``rows``
    ShareGPT rows) once five rows are on disk: its engine processes
    (``engines(driver pid)``; None: the engine runs in the driver's process)
    must go too; a second run meanwhile is refused by the lock. Returns what
    :func:`resume_to_the_end` takes: ``src``, ``out``, ``command``,
    ``flags``, ``rows`` (of the input) and ``kept`` (rows on disk at the kill)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = data if data is not None else read_jsonl(SAMPLE / "sharegpt.jsonl")[:rows]
    write_jsonl(src, data)
    # four requests in flight: rows finish a few at a time, so the kill lands mid-run
    job_flags = RUN_FLAGS if command == "run" else ()
    flags = [*job_flags, "--plain-progress", "--max-in-flight", "4", *extra]
    first = start(command, str(src), "-o", str(out), *flags)
    spool = tmp_path / ".out.jsonl.partial.jsonl"
    # the lock check first, once a row is on disk: a second CLI takes seconds to start on 2 busy cores, and
    # checked after the fifth row a 28-row run across two Ray replicas once finished in that time (CI, a Zen 4)
    wait_until(lambda: spool_lines(spool) >= 1, first)
    second = bulkinfer(command, str(src), "-o", str(out), "--resume", *flags)
    assert second.returncode == 7 and "another bulkinfer run" in second.stderr
    wait_until(lambda: spool_lines(spool) >= 5, first)

    engine = engines(first.pid) if engines is not None else []
    assert engine or engines is None, "no engine processes found"
    first.kill()
    first.wait()
    _, alive = psutil.wait_procs(engine, timeout=60)
    assert not alive, f"engine processes outlived bulkinfer: {alive}"
    return {
        "src": src,
        "out": out,
        "command": command,
        "flags": flags,
        "rows": len(data),
        "kept": spool_lines(spool),
    }


def row_key(record: dict[str, Any]) -> Any:
    """A row's or record's id: ``custom_id`` (OpenAI lines), else ``id``."""
    return record.get("custom_id") or record.get("id")


def without_flight_limit(flags: list[str]) -> list[str]:
    """``flags`` without ``--max-in-flight N``: a run that nothing stops
    mid-run needs no few rows at a time, and runs its rows at once."""
    kept: list[str] = []
    for i, flag in enumerate(flags):
        if flag != "--max-in-flight" and (i == 0 or flags[i - 1] != "--max-in-flight"):
            kept.append(flag)
    return kept


def resume_to_the_end(
    killed: dict[str, Any],
    during_resume: Callable[[subprocess.Popen[str], int], None] | None = None,
    exit_code: int = 0,
    flight_limit: bool = True,
) -> dict[str, Any]:
    """``--resume`` of a run :func:`kill_9_mid_run` killed, to the end
    (``during_resume(process, rows kept)``, when given, acts on it while it
    runs; ``flight_limit`` False: without the killed run's ``--max-in-flight``),
    ending with ``exit_code`` (3: some rows failed): every id
    exactly once in the output or the errors file. Returns the resumed
    run's report, with ``kept``, ``stderr``, ``outputs`` (its rows),
    ``error_records`` (its errors file's records) and ``src`` (the input file)."""
    src, out, rows = killed["src"], killed["out"], killed["rows"]
    flags = killed["flags"] if flight_limit else without_flight_limit(killed["flags"])
    resumed = start(killed["command"], str(src), "-o", str(out), "--resume", *flags)
    if during_resume is not None:
        during_resume(resumed, killed["kept"])
    _, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == exit_code, stderr[-3000:]
    errors_file = out.parent / "out.errors.jsonl"
    errors = read_jsonl(errors_file) if errors_file.exists() else []
    ids = [row_key(r) for r in read_jsonl(out) + errors]
    assert sorted(ids) == sorted(row_key(r) for r in read_jsonl(src))
    report = read_report(out.parent / "out.report.json")
    assert report["resumed"]["completed"] >= 5
    counts = report["request_counts"]
    assert counts["completed"] + counts["failed"] == rows and (counts["failed"] == 0) == (exit_code == 0)
    outputs = read_jsonl(out)
    return {
        **report,
        "kept": killed["kept"],
        "stderr": stderr,
        "outputs": outputs,
        "error_records": errors,
        "src": str(src),
    }


def stored_dtype_choice() -> dict[str, Any] | None:
    """The dtype this machine has stored for the default model (probed, or
    forced by ``BULKINFER_E2E_DTYPE``), or None."""
    from bulkinfer.jobs.tune import dtype_machine
    from bulkinfer.models import resolve_model
    from bulkinfer.report.calibration import stored_choice

    return stored_choice("dtype", resolve_model(None), dtype_machine())


def check_dtype_decision(report: dict[str, Any]) -> None:
    """The engine ran the dtype bulkinfer decided (read back from vLLM's
    config), and the decision is this machine's stored one, or float32 on a
    CPU without native bfloat16 where nothing is stored."""
    if report["engine"]["device"] != "cpu":  # on a GPU vLLM's own default dtype applies: nothing is chosen
        assert "dtype" not in report["engine_choice"], report["engine_choice"]
        return
    choice = report["engine_choice"]["dtype"]
    assert report["engine"]["dtype"] == choice["dtype"]
    stored = stored_dtype_choice()
    if stored is None:
        assert choice["dtype"] == "float32" and "no native bfloat16" in choice["why"], choice
    else:
        assert (choice["dtype"], choice["why"]) == (stored["dtype"], stored["why"])
