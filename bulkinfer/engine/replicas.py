"""Several engine replicas behind the one :class:`~bulkinfer.engine.base.Engine`
protocol: the feed loop, the plan, the journal, the spools and the report
stay one; each request goes to the replica with the least work in flight.

Work in flight is counted in tokens, not requests: a request costs its prompt
tokens plus the completion tokens it may generate (``max_tokens`` x ``n``)
from the moment it is added until it finishes. Two replicas holding the same
number of requests can hold very different work when prompts range from ten
to thousands of tokens; vLLM's own data-parallel load balancer counts
requests (waiting x 4 + running, ``vllm/v1/engine/coordinator.py``).

Each replica is an engine of its own (its own engine core process, as in
vLLM's ``examples/features/data_parallel/data_parallel_offline.py``: one
engine per rank) on its share of the devices: :func:`replica_environments`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bulkinfer.engine.args import MULTIPROCESSING_ENV
from bulkinfer.engine.base import Engine
from bulkinfer.errors import ConfigError, EngineError
from bulkinfer.schema import Completion, Request

# Without an event to wait on (engines that do not signal their steps), the
# replicas are polled this often (seconds).
POLL_S = 0.005


class ReplicaLost(EngineError):
    """A replica died in a way its runner survives (a Ray actor, which Ray
    restarts): :class:`Replicas` hands its unfinished requests to the
    others. A replica that will not come back says so with its ``dead``."""


def replica_environments(replicas: int, tensor_parallel_size: int, device: str) -> list[dict[str, str]]:
    """The environment each of ``replicas`` engines starts with, so that each
    runs on its own devices.

    CPU: the cores this process may use (``os.sched_getaffinity``) cut into
    ``replicas`` equal contiguous shares, as vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` (``"0"``, ``"1"``; ``"0,1,2,3"``); the
    cores left over by the division are not used; each engine core and
    worker in processes of their own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``:
    vLLM binds a worker's threads per process). GPU:
    ``CUDA_VISIBLE_DEVICES``, ``tensor_parallel_size`` devices each in
    order, of those this process sees (its own ``CUDA_VISIBLE_DEVICES``, else
    ``torch.cuda.device_count()``).

    Raises:
        ConfigError: fewer cores (GPUs) than ``replicas`` (x ``tensor_parallel_size``).
    """
    if device == "cpu":
        cores = (
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        )
        share = len(cores) // replicas
        if share < 1:
            raise ConfigError(
                f"data_parallel_size {replicas} needs at least {replicas} CPU cores, one per replica; "
                f"this process may use {len(cores)}"
            )
        return [
            {
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[i * share : (i + 1) * share])),
                MULTIPROCESSING_ENV: "1",  # several engines in one process: each in processes of its own
            }
            for i in range(replicas)
        ]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    need = replicas * tensor_parallel_size
    if len(devices) < need:
        raise ConfigError(
            f"data_parallel_size {replicas} x tensor_parallel_size {tensor_parallel_size} needs {need} GPUs; "
            f"{len(devices)} visible"
        )
    tp = tensor_parallel_size
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp : (i + 1) * tp])} for i in range(replicas)]


@dataclass(slots=True)
class ReplicaStats:
    """What one replica did: rows finished, their prompt and completion
    tokens, and its busy seconds (time with at least one request in it)."""

    rows: int = 0
    requeued: int = 0  # its unfinished requests handed to the others when it died
    deaths: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0
    busy_since: float | None = None

    def to_dict(self) -> dict[str, Any]:
        rate = self.completion_tokens / self.busy_s if self.busy_s > 0 else 0.0
        return {
            "rows": self.rows,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "busy_seconds": round(self.busy_s, 3),
            "completion_tokens_per_s": round(rate, 3),
            "deaths": self.deaths,
            "requeued": self.requeued,
        }


class Replicas:
    """``engines`` (started, one per replica) as one engine.

    A replica whose step raises :class:`ReplicaLost` (a Ray actor that died)
    gives its unfinished requests back: they go to the replicas still up at
    once (held until one is, while all are restarting), and the replica takes
    new ones when its ``available`` says it is up again. Any other
    :class:`EngineError` stops the run.

    Args:
        engines: the replicas; they share nothing.
        step_done: an event each replica sets when one of its steps returns
            (:class:`~bulkinfer.engine.vllm.VllmEngine` takes it); None: poll
            every :data:`POLL_S` seconds.
        clock: seconds, monotonic (busy time).
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        step_done: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engines = list(engines)
        self.max_model_len = min(e.max_model_len for e in self.engines)
        self.max_num_seqs = sum(e.max_num_seqs for e in self.engines)
        self._step_done = step_done
        self._clock = clock
        # request id -> (replica or None while no replica is up, tokens it holds, the request)
        self._where: dict[str, tuple[int | None, int, Request]] = {}
        self._load = [0] * len(self.engines)  # tokens in flight per replica
        self._pending: list[list[tuple[str, Request]]] = [[] for _ in self.engines]  # held while it steps
        self._homeless: list[str] = []  # request ids waiting for a replica to be up
        self.stats = [ReplicaStats() for _ in self.engines]

    @property
    def settings(self) -> dict[str, Any]:
        """The first replica's engine settings, ``data_parallel_size``, and
        ``replicas``: each one's :class:`ReplicaStats` with ``balance``
        (slowest / fastest busy seconds; 1.0 is even)."""
        busy = [s.busy_s for s in self.stats]
        balance = max(busy) / min(busy) if busy and min(busy) > 0 else None
        return {
            **self.engines[0].settings,
            "data_parallel_size": len(self.engines),
            "replicas": [s.to_dict() for s in self.stats],
            "replica_balance": None if balance is None else round(balance, 3),
        }

    @property
    def generated_tokens(self) -> int:
        return sum(e.generated_tokens for e in self.engines)

    @property
    def prefilled_tokens(self) -> int:
        return sum(e.prefilled_tokens for e in self.engines)

    @property
    def cached_tokens(self) -> int:
        return sum(e.cached_tokens for e in self.engines)

    @property
    def running_prompt_tokens(self) -> int:
        return sum(e.running_prompt_tokens for e in self.engines)

    @property
    def ended_sequences(self) -> int:
        return sum(e.ended_sequences for e in self.engines)

    def running_lengths(self) -> list[int]:
        return [n for e in self.engines for n in e.running_lengths()]

    def step_counts(self) -> dict[str, int] | None:
        """The replicas' step-hook counts since they started (preemptions,
        rows moved into KV-block order: see
        :func:`bulkinfer.engine.batch_order.step_counts`), summed over the
        replicas that count; None when none does. Call between steps."""
        totals: dict[str, int] = {}
        for engine in self.engines:
            counts = getattr(engine, "step_counts", None)
            for name, n in ((counts() if counts is not None else None) or {}).items():
                totals[name] = totals.get(name, 0) + n
        return totals or None

    def add(self, request_id: str, request: Request) -> Completion | None:
        """Hand ``request`` to the replica that is up with the fewest tokens
        in flight (the first of equals). A replica whose step is running gets
        it when that step returns (an engine takes no request mid-step, and
        the other replicas must not wait for it): a rejection then comes back
        from :meth:`step` as a completion with its ``error``; one now is
        returned. With no replica up it waits for one (see :meth:`step`)."""
        tokens = request.prompt_length + request.max_completion_tokens
        up = [i for i, engine in enumerate(self.engines) if getattr(engine, "available", True)]
        if not up:
            self._where[request_id] = (None, tokens, request)
            self._homeless.append(request_id)
            return None
        index = min(up, key=self._load.__getitem__)
        self._where[request_id] = (index, tokens, request)
        self._load[index] += tokens
        stats = self.stats[index]
        if stats.busy_since is None:
            stats.busy_since = self._clock()
        if getattr(self.engines[index], "stepping", False):
            self._pending[index].append((request_id, request))
            return None
        rejected = self.engines[index].add(request_id, request)
        if rejected is not None:
            self._finished(index, rejected)
        return rejected

    def step(self, wait: float | None = None) -> list[Completion]:
        """The requests any replica finished: every replica steps on its own
        (in its own thread or process); this collects what the steps
        returned, hands a replica the requests held for it and starts its
        next step, waiting up to ``wait`` seconds (None: until something
        finishes).

        Raises:
            EngineError: a replica died in a way that stops the run (a local
                engine), or every replica is dead for good; finished rows are
                kept (``--resume`` continues).
        """
        deadline = None if wait is None else self._clock() + wait
        while True:
            if self._step_done is not None:
                self._step_done.clear()
            done = self._rehome()
            for index, engine in enumerate(self.engines):
                if self._load[index] > 0:
                    try:
                        done += self._step_replica(index, engine)
                    except ReplicaLost as lost:
                        done += self._requeue(index, lost)
            if done or not self._where:
                return done
            left = None if deadline is None else deadline - self._clock()
            if left is not None and left <= 0:
                return []
            self._pause(None if left is None else max(left, 0.0))

    def _pause(self, left: float | None) -> None:
        """Wait until a replica's step may have returned (at most ``left``
        seconds): on ``step_done``, at most 0.2 s so that a dead replica is
        still noticed; without it, :data:`POLL_S`."""
        pause = POLL_S if self._step_done is None else 0.2
        if left is not None:
            pause = min(pause, left)
        if self._step_done is not None:
            self._step_done.wait(pause)
        else:
            time.sleep(pause)

    def _step_replica(self, index: int, engine: Engine) -> list[Completion]:
        """One replica's finished requests, if its step returned; then the
        requests held for it go in and its next step starts at once."""
        done = list(engine.step(wait=0))
        if self._pending[index] and not getattr(engine, "stepping", False):
            pending, self._pending[index] = self._pending[index], []
            for request_id, request in pending:
                rejected = engine.add(request_id, request)
                if rejected is not None:
                    done.append(rejected)
            done += engine.step(wait=0)
        for completion in done:
            self._finished(index, completion)
        return done

    def _requeue(self, index: int, lost: ReplicaLost) -> list[Completion]:
        """Replica ``index`` died: its unfinished requests go to the replicas
        that are up (or wait for one). Returns the rejections among them."""
        from bulkinfer.engine.log import terminal

        mine = [rid for rid, (where, _, _) in self._where.items() if where == index]
        stats = self.stats[index]
        stats.deaths += 1
        stats.requeued += len(mine)
        print(f"bulkinfer: warning: {lost}; its {len(mine)} unfinished request(s) go to the others", file=terminal())
        self._pending[index] = []
        self._load[index] = 0
        if stats.busy_since is not None:
            stats.busy_s += self._clock() - stats.busy_since
            stats.busy_since = None
        return self._add_again(mine)

    def _rehome(self) -> list[Completion]:
        """Requests waiting for a replica go to one that is up again; raises
        EngineError when every replica is dead for good."""
        if not self._homeless:
            return []
        if all(getattr(engine, "dead", False) for engine in self.engines):
            raise EngineError(
                f"every replica died and none will restart; {len(self._homeless)} request(s) unfinished; "
                "finished rows are kept: continue with --resume"
            )
        if not any(getattr(engine, "available", True) for engine in self.engines):
            return []
        waiting, self._homeless = self._homeless, []
        return self._add_again(waiting)

    def _add_again(self, request_ids: list[str]) -> list[Completion]:
        """Route these requests (added before) afresh; the rejections among them."""
        done = []
        for rid in request_ids:
            _, _, request = self._where.pop(rid)
            rejected = self.add(rid, request)
            if rejected is not None:
                done.append(rejected)
        return done

    def _finished(self, index: int, completion: Completion) -> None:
        _, tokens, _ = self._where.pop(completion.request_id)
        self._load[index] -= tokens
        stats = self.stats[index]
        if completion.error is None:
            stats.rows += 1
            stats.prompt_tokens += completion.prompt_tokens
            stats.completion_tokens += completion.completion_tokens
        if self._load[index] == 0 and stats.busy_since is not None:
            stats.busy_s += self._clock() - stats.busy_since
            stats.busy_since = None

    def has_unfinished(self) -> bool:
        return bool(self._homeless) or any(e.has_unfinished() for e in self.engines)

    def abort_unfinished(self) -> None:
        """Abort what every replica holds; forget every request routed."""
        for index, engine in enumerate(self.engines):
            engine.abort_unfinished()
            self._pending[index] = []
            self._load[index] = 0
            stats = self.stats[index]
            if stats.busy_since is not None:
                stats.busy_s += self._clock() - stats.busy_since
                stats.busy_since = None
        self._where.clear()
        self._homeless.clear()

    def close(self) -> None:
        """Close every replica at once, each in a thread of its own (each
        bounded, see its own ``close``): one after the other, two local
        replicas took vLLM's 5 s shutdown bound each. Raises the first
        replica's error, once every replica has closed."""
        errors: list[BaseException] = []

        def close(engine: Engine) -> None:
            try:
                engine.close()
            except BaseException as exc:  # raised below, once the others closed too
                errors.append(exc)

        closers = [
            threading.Thread(target=close, args=(engine,), name=f"bulkinfer-close-replica-{i}", daemon=True)
            for i, engine in enumerate(self.engines)
        ]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join()
        if errors:
            raise errors[0]
