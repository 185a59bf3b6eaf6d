"""The processes of a vLLM engine: starting them with their own
environment (:func:`environment_until_spawned`), finding them
(:func:`engine_processes`) and telling whether and how they ended
(:func:`alive`, :func:`exit_description`). psutil and multiprocessing are
imported when used.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any


def exit_description(code: int | None) -> str:
    """How a process with exit code ``code`` ended, in words (a negative code:
    killed by that signal; None: unknown, as for vLLM's workers, which are the
    engine core's children, not bulkinfer's)."""
    if code is None:
        return "ended; how is not known here (a kill by the out-of-memory killer shows in `dmesg`)"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else str(-code)
        hint = " (the out-of-memory killer sends this: see `dmesg`)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


def core_exit_code(proc: Any) -> int | None:
    """The exit code of ``proc``, an engine core process vLLM started (its
    ``multiprocessing`` handle; negative: a signal), waiting up to a second
    for it to be known; None for None (another process) or still unknown."""
    deadline = time.monotonic() + 1.0
    while proc is not None:
        code = proc.exitcode  # multiprocessing reaps the process here
        if isinstance(code, int) or time.monotonic() >= deadline:
            return code if isinstance(code, int) else None
        time.sleep(0.05)
    return None


def tasks(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (Linux's ``/proc/PID/task``); [] when it is gone or there is no ``/proc``."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return []


# One engine start at a time sets its environment, until its engine core process is spawned with it.
_SPAWNING = threading.Lock()


@contextlib.contextmanager
def environment_until_spawned(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` set in ``os.environ`` until this process has started a
    new ``multiprocessing`` process (vLLM's engine core, which inherits them)
    or the block ends, then restored. Starts in other threads wait meanwhile
    (:data:`_SPAWNING`), then go on while this one waits for its engine to
    load: replicas load side by side, each with its own variables.

    Every process an engine start spawns before its engine core (its
    watchdog) is spawned inside this block too: Python spawns with vfork,
    whose child reads this process's environment array until its exec, and
    another start adding a variable (its own, or vLLM's config setting
    ``LD_PRELOAD``) reallocates that array: the exec failed with EFAULT
    ("OSError: [Errno 14] Bad address: '.../python'"): with a thread adding
    variables, 465 of 1,201 spawns failed with vfork, none of 877 with fork
    (``python -m bench.spawn_race``, ``bench/results/spawn-race-xeon-m167.txt``).

    Meanwhile a ``__main__.__file__`` that is no file (``"<stdin>"`` under
    ``python -``) is hidden: the spawn start method runs the parent's main
    file again in the child (Python's multiprocessing docs, "Safe importing
    of main module"), and vLLM's engine core failed with FileNotFoundError
    on ``<stdin>``; without one the child starts as under ``python -c``."""
    import multiprocessing
    import sys

    _SPAWNING.acquire()
    before = set(_children(multiprocessing))
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    hidden = isinstance(main_file, str) and not os.path.isfile(main_file)
    if hidden:
        del main.__file__  # type: ignore[union-attr]
    once, ended = threading.Lock(), threading.Event()

    def restore() -> None:
        if once.acquire(blocking=False):  # the first of the watcher and the block's end
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if hidden:
                main.__file__ = main_file  # type: ignore[union-attr]
            _SPAWNING.release()

    def watch() -> None:
        while not ended.wait(0.05):
            if set(_children(multiprocessing)) - before:
                restore()
                return

    watcher = threading.Thread(target=watch, name="bulkinfer-engine-spawn", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        ended.set()
        restore()


def _children(multiprocessing: Any) -> list[Any]:
    """The processes ``multiprocessing`` started in this process, alive
    (another thread may be starting one: the set is read again)."""
    for _ in range(100):
        try:
            return list(multiprocessing.active_children())
        except RuntimeError:  # "Set changed size during iteration"
            continue
    return []


def engine_processes(cores: Mapping[int, Any], earlier: set[int]) -> list[Any]:
    """psutil processes of the engine cores ``cores`` (pid -> handle) and
    their descendants (the workers); where vLLM gave no handles, this
    process's descendants but ``earlier`` (those that were there before, and
    the watchdog). The resource tracker is never one."""
    import psutil

    found = []
    for pid in cores:
        try:
            core = psutil.Process(pid)
            found += [core, *core.children(recursive=True)]
        except psutil.Error:
            continue
    if not cores:
        found = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
    return [p for p in found if "resource_tracker" not in " ".join(_cmdline(p))]


def alive(proc: Any) -> bool:
    """A psutil process that still runs (a zombie has exited)."""
    try:
        return bool(proc.is_running() and proc.status() != "zombie")
    except Exception:  # psutil.NoSuchProcess and kin
        return False


def process_name(proc: Any) -> str:
    """A psutil process's name, or "" when it cannot be read."""
    try:
        return str(proc.name())
    except Exception:
        return ""


def _cmdline(proc: Any) -> list[str]:
    try:
        return list(proc.cmdline())
    except Exception:
        return []
