"""The engine a run gets: one vLLM engine, replicas of it on this host, or
replicas as Ray actors on a cluster, by the settings. Importing this module
imports neither vLLM, torch nor Ray.
"""

from __future__ import annotations

import dataclasses
import threading

from bulkinfer.config import Settings
from bulkinfer.engine.args import detect_device
from bulkinfer.engine.base import Engine
from bulkinfer.engine.cluster import ray_engine
from bulkinfer.engine.replicas import Replicas, replica_environments
from bulkinfer.engine.sampling import check_sampling_defaults
from bulkinfer.engine.vllm import VllmEngine, import_vllm


def vllm_engine(model: str, settings: Settings) -> Engine:
    """The real engine: vLLM's ``SamplingParams`` checks the ``[sampling]``
    defaults first (ConfigError), then the engine starts; with
    ``engine.data_parallel_size`` N > 1, N replicas
    (:class:`~bulkinfer.engine.replicas.Replicas`), each an engine of its own
    on its share of the devices (:func:`~bulkinfer.engine.replicas.replica_environments`),
    started side by side (one at a time until its engine core process is
    spawned); with ``ray.address`` set, the replicas are
    Ray actors on that cluster (:func:`~bulkinfer.engine.cluster.ray_engine`).

    Raises:
        ConfigError: a default vLLM rejects; more replicas than devices.
        EngineError: an engine fails to start (the ones started are closed).
    """
    check_sampling_defaults(settings.sampling)
    if settings.ray.address is not None:
        return ray_engine(model, settings)
    replicas = settings.engine.data_parallel_size
    if replicas == 1:
        return VllmEngine(model, settings.engine, stall_timeout_s=settings.plan.stall_timeout_s)
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
