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
from bulkinfer.engine.vllm import VllmEngine


def vllm_engine(model: str, settings: Settings) -> Engine:
    """The real engine: vLLM's ``SamplingParams`` checks the ``[sampling]``
    defaults first (ConfigError), then the engine starts; with
    ``engine.data_parallel_size`` N > 1, N replicas
    (:class:`~bulkinfer.engine.replicas.Replicas`), each an engine of its own
    on its share of the devices (:func:`~bulkinfer.engine.replicas.replica_environments`),
    started one after another; with ``ray.address`` set, the replicas are
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
    engines: list[Engine] = []
    try:
        for environment in replica_environments(replicas, settings.engine.tensor_parallel_size, detect_device()):
            engines.append(VllmEngine(model, one, settings.plan.stall_timeout_s, environment, step_done))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return Replicas(engines, step_done)
