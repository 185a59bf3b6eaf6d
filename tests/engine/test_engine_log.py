"""The engine's log: file descriptors 1 and 2 (the engine's processes, C
code, logging, warnings) go to OUT.log; bulkinfer's own lines reach the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bulkinfer.engine.log import EngineLog, ReaderGone
from bulkinfer.errors import EngineError

SCRIPT = """
import os, subprocess, sys, warnings
from pathlib import Path
from bulkinfer.engine.log import EngineLog, terminal
with EngineLog(Path(sys.argv[1])) as log:
    assert log.active
    os.write(1, b"fd one\\n")
    os.write(2, b"fd two\\n")
    child = "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"
    subprocess.run([sys.executable, "-c", child], check=True)
    warnings.warn("a library's warning", FutureWarning, stacklevel=1)
    print("print to stdout")
    print("bulkinfer: my own line", file=terminal())
print("after", file=sys.stderr)
"""


def test_file_descriptors_and_child_processes_go_to_the_log(tmp_path: Path) -> None:
    path = tmp_path / "out.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, check=True)
    text = path.read_text()
    for expected in ("fd one", "fd two", "child stdout", "child stderr", "FutureWarning", "print to stdout"):
        assert expected in text
    assert "my own line" not in text and "after" not in text
    assert proc.stderr.splitlines() == ["bulkinfer: my own line", "after"]
    assert proc.stdout == ""


def test_verbose_and_nested_captures_do_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with EngineLog(tmp_path / "v.log", verbose=True) as log:
        os.write(2, b"live\n")
    assert not log.active and not (tmp_path / "v.log").exists()
    assert "live" in capfd.readouterr().err
    with EngineLog(tmp_path / "outer.log"):
        with EngineLog(tmp_path / "inner.log") as inner:
            os.write(2, b"nested\n")
        assert not inner.active
    assert "nested" in (tmp_path / "outer.log").read_text()
    assert not (tmp_path / "inner.log").exists()


def test_an_engine_failure_quotes_the_logs_last_error(tmp_path: Path) -> None:
    path = tmp_path / "out.log"
    path.write_text("ValueError: from an earlier run\n")
    with EngineLog(path, append=True) as log:
        os.write(2, b"Traceback (most recent call last):\n  File 'x', line 1\n")
        os.write(2, b"(EngineCore pid=42) RuntimeError: CPU out of memory\nINFO shutting down\n")
    error = log.explain(EngineError("the vLLM engine process VLLM::EngineCore (pid 42) exited with code 1"))
    assert isinstance(error, EngineError)
    assert "the engine's log says: (EngineCore pid=42) RuntimeError: CPU out of memory" in str(error)
    assert f"engine log: {path}" in str(error)
    assert "from an earlier run" not in str(error)


def test_a_fresh_log_replaces_the_last_runs(tmp_path: Path) -> None:
    path = tmp_path / "out.log"
    path.write_text("old run\n")
    with EngineLog(path):
        os.write(2, b"new run\n")
    assert path.read_text() == "new run\n"


@pytest.mark.parametrize("redirect", [">", ">>"])
def test_a_log_that_is_where_standard_output_and_error_go_keeps_every_line_in_order(
    tmp_path: Path, redirect: str
) -> None:
    """``bulkinfer run in.jsonl -o out.jsonl > out.log 2>&1`` (or ``>>``, from cron): the engine's
    log is the file the shell opened; nothing is truncated or written over."""
    path = tmp_path / "out.log"
    path.write_text("yesterday's run\n")
    script = (
        "import os, sys\nfrom pathlib import Path\nfrom bulkinfer.engine.log import EngineLog, terminal\n"
        "print('bulkinfer: before', file=sys.stderr, flush=True)\n"
        "with EngineLog(Path(sys.argv[1])) as log:\n"
        "    assert log.active and log.shared\n"
        "    os.write(1, b'engine line\\n')\n"
        "    print('bulkinfer: progress', file=terminal())\n"
        "    os.write(2, b'ValueError: the engine failed\\n')\n"
        "print('bulkinfer: summary', file=sys.stderr)\n"
        "print(log.last_error())\n"
    )
    command = f'"{sys.executable}" -c "$0" "$1" {redirect} "$1" 2>&1'
    subprocess.run(["sh", "-c", command, script, str(path)], check=True)
    kept = ["yesterday's run"] if redirect == ">>" else []
    lines = [*kept, "bulkinfer: before", "engine line", "bulkinfer: progress", "ValueError: the engine failed"]
    assert path.read_text().splitlines() == [*lines, "bulkinfer: summary", "ValueError: the engine failed"]


def test_a_reader_that_went_away_loses_bulkinfers_lines_never_the_command() -> None:
    """``bulkinfer ... 2>&1 | head``: a closed pipe on standard output or error
    (click turned it into exit 1 at once) drops the lines and keeps the exit code."""
    read, write = os.pipe()
    os.close(read)
    bulkinfer = Path(sys.executable).parent / "bulkinfer"
    done = subprocess.run([str(bulkinfer), "models"], stdout=write, stderr=subprocess.PIPE, timeout=60)
    os.close(write)
    assert (done.returncode, done.stderr) == (0, b"")
    read, write = os.pipe()
    os.close(read)
    stream = ReaderGone(os.fdopen(write, "w"))
    assert stream.write("a progress line\n") == 16
    stream.flush()  # the pipe's error comes at the flush: the stream is gone from then on
    assert stream.gone and stream.write("the summary\n") == 12
    stream.close()


THREADS = """
import os, random, sys, threading, time
from pathlib import Path
import bulkinfer.engine.log as log
before = [os.fstat(fd)[1:3] for fd in (1, 2)]
start = threading.Barrier(8)
def captures(k):
    start.wait()
    for _ in range(40):
        with log.EngineLog(Path(sys.argv[1]) / f"{k}.log"):
            time.sleep(random.random() / 1000)
threads = [threading.Thread(target=captures, args=(k,)) for k in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
restored = [os.fstat(fd)[1:3] for fd in (1, 2)] == before and log._terminal is None
print("restored" if restored else "not restored")
"""


def test_captures_in_several_threads_at_once_leave_the_descriptors_as_they_were(tmp_path: Path) -> None:
    """Eight threads capturing at once (runs of the Python API each with its
    own engine): the check that no capture is active and the move of the
    file descriptors are one step, so every capture's exit puts back what it
    moved (interleaved, a thread restored another's log as standard output,
    and an exit found no terminal: AssertionError)."""
    proc = subprocess.run([sys.executable, "-c", THREADS, str(tmp_path)], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "restored", "")
