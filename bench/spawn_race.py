"""Why an engine start spawns its processes under one lock: a process
spawned in one thread while another thread adds an environment variable.

Python's ``subprocess`` (and multiprocessing's spawn) creates the child with
vfork where it can; the child shares this process's memory and reads the
``environ`` array until its exec, and a ``setenv`` of a *new* name in
another thread reallocates that array. The exec then fails with EFAULT,
``OSError: [Errno 14] Bad address: '.../python'``, as the second of two
replicas' watchdogs did while the first replica's start set its variables
(``bulkinfer/engine/processes.py``, ``environment_until_spawned``).

One thread adds and removes variables without pause; this one spawns
``python -c pass`` for ``--seconds`` with vfork, then with fork
(``subprocess._USE_VFORK``, CPython's switch, 3.10-3.13), and counts the
spawns that failed, by errno.

Usage: ``python -m bench.spawn_race [--seconds 20]``; prints one line per
start method. No engine; seconds of two cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import threading
import time


def spawn_for(seconds: float, vfork: bool) -> tuple[int, dict[str, int]]:
    """Spawns ``python -c pass`` for ``seconds`` while another thread adds
    and removes 500 variables over and over. Returns (spawns, failures by
    errno name)."""
    subprocess._USE_VFORK = vfork  # type: ignore[misc]
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            os.environ[f"BULKINFER_SPAWN_RACE_{i % 500}"] = "x" * 50
            if i % 500 == 499:
                for j in range(500):
                    os.environ.pop(f"BULKINFER_SPAWN_RACE_{j}", None)
            i += 1

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    failed: dict[str, int] = {}
    spawns, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            spawns += 1
            try:
                subprocess.run([sys.executable, "-c", "pass"], check=True)
            except OSError as exc:
                name = os.strerror(exc.errno) if exc.errno else type(exc).__name__
                failed[name] = failed.get(name, 0) + 1
    finally:
        stop.set()
        thread.join()
        subprocess._USE_VFORK = True  # type: ignore[misc]
    return spawns, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="spawning time per start method")
    args = parser.parse_args()
    print(f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs")
    for vfork in (True, False):
        spawns, failed = spawn_for(args.seconds, vfork)
        print(f"{'vfork' if vfork else 'fork'}: {spawns} spawns, failed {sum(failed.values())} {failed}")


if __name__ == "__main__":
    main()
