"""Polling library threads moved to SCHED_IDLE (bulkinfer.engine.pollers),
on a stand-in process whose threads carry gloo's kernel name; the real
engine's are counted in the end-to-end tests (the report's
``engine.sched_idle_threads``)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bulkinfer.engine.pollers import idle_engine_pollers, idle_pollers

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")

# Two threads named as gloo names its transport thread, one named otherwise; their ids on stdout.
STAND_IN = r"""
import threading, time
ready = []
def named(name):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name)
    ready.append(threading.get_native_id())
    time.sleep(60)
for name in ("gloo_tcp_loop", "gloo_tcp_loop", "worker"):
    threading.Thread(target=named, args=(name,), daemon=True).start()
while len(ready) < 3:
    time.sleep(0.01)
print(*ready, flush=True)
time.sleep(60)
"""


@pytest.fixture
def stand_in() -> object:
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    tids = [int(t) for t in proc.stdout.readline().split()]
    yield SimpleNamespace(pid=proc.pid, tids=tids)
    proc.kill()
    proc.wait()


def test_the_gloo_threads_and_only_they_move_to_sched_idle(stand_in: SimpleNamespace) -> None:
    names = {t: open(f"/proc/{stand_in.pid}/task/{t}/comm").read().strip() for t in stand_in.tids}
    assert idle_pollers([stand_in.pid]) == 2
    for tid, name in names.items():
        idle = os.sched_getscheduler(tid) == os.SCHED_IDLE
        assert idle == (name == "gloo_tcp_loop"), (tid, name)
    assert os.sched_getscheduler(stand_in.pid) != os.SCHED_IDLE


def test_only_a_cpu_engine_of_one_worker_has_them_moved(stand_in: SimpleNamespace) -> None:
    procs = [SimpleNamespace(pid=stand_in.pid)]
    assert idle_engine_pollers("cuda", {}, False, procs) == 0
    assert idle_engine_pollers("cpu", {"tensor_parallel_size": 2}, False, procs) == 0
    assert idle_engine_pollers("cpu", {"data_parallel_size": 2}, False, procs) == 0
    assert all(os.sched_getscheduler(t) != os.SCHED_IDLE for t in stand_in.tids)
    assert idle_engine_pollers("cpu", {"tensor_parallel_size": 1}, False, procs) == 2


def test_the_switch_leaves_them_as_they_are(stand_in: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKINFER_IDLE_POLLERS", "0")
    assert idle_engine_pollers("cpu", {}, False, [SimpleNamespace(pid=stand_in.pid)]) == 0
    assert all(os.sched_getscheduler(t) != os.SCHED_IDLE for t in stand_in.tids)


def test_a_process_that_is_gone_moves_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert idle_pollers([proc.pid]) == 0
