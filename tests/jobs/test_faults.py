"""Crash safety: kill a run at chosen moments, resume it, and check that every
input row ends in exactly one output or error record.

The runs use a slow fake engine (tests/fault_driver.py) so that the kill lands
where intended; tests/e2e/test_e2e.py does the same with the real engine once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from fakes import wait_for

HERE = Path(__file__).resolve().parents[1]  # tests/, where fault_driver.py is
N_ROWS = 40


def make_input(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    rows = [orjson.dumps({"id": f"r{i}", "prompt": "word " * (i % 7 + 1)}) for i in range(N_ROWS)]
    rows.insert(5, b"{broken json")  # line 6: one error record
    src.write_bytes(b"\n".join(rows) + b"\n")
    return src


def driver(src: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "fault_driver.py"), str(src), str(out), *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def spool_lines(out: Path) -> int:
    spool = out.with_name(f".{out.name}.partial.jsonl")
    return spool.read_bytes().count(b"\n") if spool.exists() else 0


def assert_every_row_once(out: Path) -> None:
    ids = [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()]
    errors = [orjson.loads(line) for line in out.with_name("out.errors.jsonl").read_bytes().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(N_ROWS)), "output ids differ from the input's"
    assert len(ids) == len(set(ids))
    assert [(e["line"], e["error"]["type"]) for e in errors] == [(6, "invalid_json")]


def resume(src: Path, out: Path, expected_code: int = 3) -> None:
    """Resume; 3 = finished with the one bad row; 0 = was already complete."""
    proc = driver(src, out, "--resume", "--step-delay", "0")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == expected_code, stderr.decode()


def test_sigkill_during_generation_then_resume(tmp_path: Path) -> None:
    src, out = make_input(tmp_path), tmp_path / "out.jsonl"
    proc = driver(src, out)
    wait_for(lambda: spool_lines(out) >= 8)
    proc.kill()
    proc.wait()
    assert not out.exists()
    assert 8 <= spool_lines(out) < N_ROWS
    resume(src, out)
    assert_every_row_once(out)


@pytest.mark.parametrize("point", ["before_publish", "between_publish", "after_publish"])
def test_sigkill_during_the_final_rename_then_resume(tmp_path: Path, point: str) -> None:
    src, out = make_input(tmp_path), tmp_path / "out.jsonl"
    proc = driver(src, out, "--step-delay", "0", env={"BULKINFER_FAILPOINT": point})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert out.exists() == (point == "after_publish")
    resume(src, out, expected_code=0 if point == "after_publish" else 3)
    assert_every_row_once(out)


def test_sigterm_exits_143_then_resume(tmp_path: Path) -> None:
    src, out = make_input(tmp_path), tmp_path / "out.jsonl"
    proc = driver(src, out)
    wait_for(lambda: spool_lines(out) >= 4)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr.decode()
    assert b"stopped by SIGTERM" in stderr
    resume(src, out)
    assert_every_row_once(out)


def test_second_run_is_refused_at_once_and_lock_freed_by_sigkill(tmp_path: Path) -> None:
    src, out = make_input(tmp_path), tmp_path / "out.jsonl"
    first = driver(src, out, "--step-delay", "0.2")
    wait_for(lambda: spool_lines(out) >= 1)
    # the CLI, then (on its way out) whether it had imported the engine's libraries
    cli = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('bulkinfer', run_name='__main__')\n"
        "finally:\n"
        "    print('heavy imports:', sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)), file=sys.stderr)\n"
    )
    second = subprocess.run(
        [sys.executable, "-c", cli, "run", str(src), "-o", str(out), "--resume"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 7, second.stderr
    assert "another bulkinfer run" in second.stderr
    # refused before any model or engine loads (0.2 s on an idle machine: a timed bound flaked under load)
    assert "heavy imports: []" in second.stderr, second.stderr
    first.kill()
    first.wait()
    resume(src, out)  # the kernel freed the lock of the killed holder
    assert_every_row_once(out)


def test_sigterm_stops_a_stream_whose_reader_stopped_reading(tmp_path: Path, tiny_home: Path) -> None:
    """Records fill the pipe to a reader that never reads: the writer blocks in
    write(2). A SIGTERM there ends the stream (143) at once, not after SIGKILL.
    A home of its own (the stream's log goes there) with the tiny model's
    ``models/``: an empty one made the driver convert the real default model
    first (40-47 s of this test in the CIs of 2026-12-07)."""
    (tmp_path / "models").symlink_to(tiny_home / "models", target_is_directory=True)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "fault_driver.py"), "-", "-", "--step-delay", "0"],
        env={**os.environ, "BULKINFER_HOME": str(tmp_path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,  # never read
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None
    rows = [orjson.dumps({"id": f"r{i}", "prompt": "hi", "padding": "x" * 100_000}) + b"\n" for i in range(6)]
    proc.stdin.write(b"".join(rows))
    proc.stdin.flush()  # left open: the stream goes on
    wchan = Path(f"/proc/{proc.pid}/wchan")
    wait_for(lambda: "pipe_write" in wchan.read_text(), timeout=60)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=20)
    finally:
        proc.kill()
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert code == 143, stderr
    assert "stopped by SIGTERM while the output's reader was not reading" in stderr
