"""The engine a run gets: one vLLM engine, replicas of it on this host, or
replicas as Ray actors on a cluster, by the settings: a registry of
backends (:data:`BACKENDS`), the first that serves the settings starts it. Importing this module
imports neither vLLM, torch nor Ray.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

from bulkinfer.config import Settings
from bulkinfer.engine.args import detect_device, import_vllm
from bulkinfer.engine.base import Engine
from bulkinfer.engine.ray_start import ray_engine
from bulkinfer.engine.replicas import Replicas, replica_environments
from bulkinfer.engine.sampling import check_sampling_defaults
from bulkinfer.engine.vllm import VllmEngine


@dataclass(frozen=True, slots=True)
class Backend:
    """A way to run a job's engine: ``name`` (as the report and errors say
    it), ``serves(settings)`` (whether it is the one for these settings) and
    ``start(model_path, settings)`` (the engine; raises ConfigError,
    EngineError)."""

    name: str
    serves: Callable[[Settings], bool]
    start: Callable[[str, Settings], Engine]


def _one_engine(model: str, settings: Settings) -> Engine:
    return VllmEngine(model, settings.engine, stall_timeout_s=settings.plan.stall_timeout_s)


def _replicas(model: str, settings: Settings) -> Engine:
    """``engine.data_parallel_size`` engines on this host, side by side
    (:class:`~bulkinfer.engine.replicas.Replicas`)."""
    replicas = settings.engine.data_parallel_size
    one = dataclasses.replace(settings.engine, data_parallel_size=1)
    step_done = threading.Event()
    environments = replica_environments(replicas, settings.engine.tensor_parallel_size, detect_device())
    import_vllm()  # here, not in two threads at once
    started: list[Engine | BaseException | None] = [None] * len(environments)

    def start(i: int) -> None:
        try:
            started[i] = VllmEngine(model, one, settings.plan.stall_timeout_s, environments[i], step_done)
        except BaseException as exc:  # the caller raises it
            started[i] = exc

    # side by side: each start holds the process's environment only until its engine core is spawned
    threads = [
        threading.Thread(target=start, args=(i,), name=f"bulkinfer-replica-{i}", daemon=True) for i in range(replicas)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)  # a stop signal's exception reaches this (main) thread between waits
    engines = [e for e in started if not isinstance(e, BaseException) and e is not None]
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        for engine in engines:
            engine.close()
        raise failed[0]
    return Replicas(engines, step_done)


# The backends, tried in order: the first that serves the settings starts the engine.
# A new backend (another engine library, a remote service) registers here; no job changes.
BACKENDS: list[Backend] = [
    Backend("ray", lambda settings: settings.ray.address is not None, ray_engine),
    Backend("replicas", lambda settings: settings.engine.data_parallel_size > 1, _replicas),
    Backend("vllm", lambda settings: True, _one_engine),
]


def backend_for(settings: Settings) -> Backend:
    """The first of :data:`BACKENDS` that serves ``settings``."""
    return next(backend for backend in BACKENDS if backend.serves(settings))


def vllm_engine(model: str, settings: Settings) -> Engine:
    """The real engine: vLLM's ``SamplingParams`` checks the ``[sampling]``
    defaults first (ConfigError), then the backend that serves the settings
    starts (:func:`backend_for`): with ``ray.address`` set, replicas as Ray
    actors on that cluster (:func:`~bulkinfer.engine.ray_start.ray_engine`);
    with ``engine.data_parallel_size`` N > 1, N replicas
    (:class:`~bulkinfer.engine.replicas.Replicas`), each an engine of its own
    on its share of the devices (:func:`~bulkinfer.engine.replicas.replica_environments`),
    started side by side (one at a time until its engine core process is
    spawned); else one vLLM engine.

    Raises:
        ConfigError: a default vLLM rejects; more replicas than devices.
        EngineError: an engine fails to start (the ones started are closed).
    """
    check_sampling_defaults(settings.sampling)
    return backend_for(settings).start(model, settings)
