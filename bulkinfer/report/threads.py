"""Where the cores went during generation: CPU seconds by thread, of
bulkinfer's process and the processes it started (an engine core, the
watchdog), for the report's ``cpu_seconds.threads``.

On 2 cores an engine's OpenMP threads want both: every CPU second another
thread takes (bulkinfer's own, the watchdog's, a library's polling loop) is
taken from the engine's steps, so the report names them.

Read from Linux's ``/proc`` (proc(5): ``utime`` + ``stime`` of
``/proc/PID/task/TID/stat``, in clock ticks of ``SC_CLK_TCK``; the
descendants from ``/proc/PID/task/TID/children``); elsewhere, or where
``/proc`` cannot be read, nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from bulkinfer.engine.processes import tasks

# Threads that used less than this many CPU seconds are left out of the report.
MIN_SECONDS = 0.01

# (pid, tid) -> (process name, thread name, CPU seconds so far)
Snapshot = dict[tuple[int, int], tuple[str, str, float]]


def snapshot(me: str = "bulkinfer", root: int | None = None) -> Snapshot:
    """The CPU seconds so far of every thread of process ``root`` (default:
    this one) and its descendants. This process's threads are named as
    Python names them (``MainThread``, ``bulkinfer-engine-step``; native
    threads by their kernel name, e.g. OpenMP's workers ``python``, gloo's
    ``gloo_tcp_loop``); this process is ``me``, the others go by their
    kernel name (``VLLM::EngineCor``, ``bulkinfer-watch``)."""
    own = os.getpid()
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:
        ticks = os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return {}
    found: Snapshot = {}
    todo = [own if root is None else root]
    while todo:
        pid = todo.pop()
        process = me if pid == own else None
        for tid in sorted(tasks(pid)):
            stat = thread_stat(pid, tid)
            if stat is None:
                continue
            comm, seconds = stat[0], stat[1] / ticks
            process = process or comm  # the main thread (tid == pid) comes first
            thread = names.get(tid, comm) if pid == own else comm
            found[(pid, tid)] = (process, thread, seconds)
            todo += children(pid, tid)
    return found


def used(before: Snapshot, after: Snapshot) -> list[dict[str, Any]]:
    """CPU seconds from ``before`` to ``after`` by process and thread name
    (threads of one name in one process summed, ``threads`` counting them),
    most first; those under :data:`MIN_SECONDS` left out. A thread started
    in between counts from zero; one that ended in between is not counted
    (``/proc`` keeps nothing of it)."""
    sums: dict[tuple[str, str], list[float]] = {}
    for key, (process, thread, seconds) in after.items():
        spent = seconds - before.get(key, (process, thread, 0.0))[2]
        entry = sums.setdefault((process, thread), [0.0, 0])
        entry[0] += max(spent, 0.0)
        entry[1] += 1
    rows = [
        {"process": process, "thread": thread, "threads": int(n), "seconds": round(s, 2)}
        for (process, thread), (s, n) in sums.items()
        if s >= MIN_SECONDS
    ]
    return sorted(rows, key=lambda r: -r["seconds"])


def thread_stat(pid: int, tid: int) -> tuple[str, int] | None:
    """(kernel name, utime + stime in clock ticks) of one thread; None when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    head, _, rest = text.rpartition(b")")  # the name may hold spaces and parentheses
    fields = rest.split()
    try:
        return head.split(b"(", 1)[1].decode(errors="replace"), int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def children(pid: int, tid: int) -> list[int]:
    """The child processes thread ``tid`` of process ``pid`` started ([] when gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return []
