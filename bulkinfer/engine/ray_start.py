"""Replicas started as Ray actors on a cluster (``--ray ADDRESS``): the
connection, the placement group, the actors' resources and environment;
the actors and the replicas they serve are :mod:`bulkinfer.engine.cluster`.

Ray is an optional dependency (``pip install 'bulkinfer[ray]'``); importing
this module imports neither Ray nor vLLM.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from bulkinfer.config import EngineSettings, Settings
from bulkinfer.engine.args import MULTIPROCESSING_ENV
from bulkinfer.engine.cluster import RayReplica, RayReplicas, ReplicaActor
from bulkinfer.errors import ConfigError, EngineError

# How long the cluster may take to find room for every replica (seconds).
PLACEMENT_TIMEOUT_S = 120.0


def cpu_environment(cpus: int, node_cpus: int) -> dict[str, str]:
    """The environment of a replica's actor that reserves ``cpus`` Ray CPUs
    on a cluster whose largest node has ``node_cpus``: ``OMP_NUM_THREADS``
    is ``cpus``; a replica with a node to itself lets vLLM bind its threads
    to the cores (``VLLM_CPU_OMP_THREADS_BIND=auto``, as on one host), one
    that shares a node leaves them unbound (``nobind``: Ray does not pin
    CPUs, so bulkinfer cannot know which cores are its). A user's own
    ``VLLM_CPU_OMP_THREADS_BIND`` wins.

    Measured (``python -m bench.replicas --systems dp1,ray1``,
    ``bench/results/replicas-ray*.md``; AMD EPYC Zen 3, 2 cores): the engine
    core inside the actor's process with unbound threads ran at 0.69x and
    0.73x one local engine; in its own process with vLLM's binding at 1.05x
    and 0.99x: ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` keeps it there.
    """
    bind = "auto" if cpus >= node_cpus else "nobind"
    return {
        "OMP_NUM_THREADS": str(cpus),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind),
        MULTIPROCESSING_ENV: "1",  # the engine core in a process of its own, as measured
    }


def ray_engine(model: str, settings: Settings) -> RayReplicas:
    """``engine.data_parallel_size`` replicas as Ray actors on the cluster at
    ``ray.address``, started in parallel.

    Raises:
        ConfigError: Ray is not installed; the cluster cannot be reached, or
            has no room for the replicas within :data:`PLACEMENT_TIMEOUT_S`.
        EngineError: a replica's engine fails to start (the others are
            killed), or the cluster fails while they start.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'bulkinfer[ray]'") from None
    address = settings.ray.address
    assert address is not None
    if not ray.is_initialized():
        try:
            # include_dashboard only for a cluster started here (Ray refuses it when joining one)
            dashboard = False if address == "local" else None
            ray.init(address=address, include_dashboard=dashboard, logging_level=logging.WARNING)
        except Exception as exc:  # ConnectionError, ValueError, ...
            raise ConfigError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
    try:
        return _start_replicas(model, settings, address)
    except ray.exceptions.RayError as exc:  # the cluster itself (its GCS unreachable, ...)
        raise EngineError(f"the Ray cluster at {address!r} failed: {type(exc).__name__}: {exc}") from exc


def _start_replicas(model: str, settings: Settings, address: str) -> RayReplicas:
    """The replicas' placement group and actors, once connected (see :func:`ray_engine`)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    replicas = settings.engine.data_parallel_size
    resources = ray.cluster_resources()
    tp = settings.engine.tensor_parallel_size
    environment: dict[str, str] = {}
    if resources.get("GPU", 0) >= 1:
        bundle = {"GPU": float(tp), "CPU": 1.0}
    else:
        nodes = ray.nodes()
        cpus = settings.ray.cpus_per_replica or _cpus_per_replica(nodes, replicas)
        bundle = {"CPU": float(cpus)}
        environment = cpu_environment(cpus, max(_node_cpus(nodes), default=1))
    group = placement_group([bundle] * replicas, strategy="SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"the Ray cluster at {address!r} has no room for {replicas} replica(s) of {bundle} "
            f"within {PLACEMENT_TIMEOUT_S:g} s; it has {dict(resources)} (ray.cpus_per_replica, -dp)"
        )
    one = _one_replica(settings.engine)
    actor_class: Any = ray.remote(ReplicaActor)
    actors = [
        actor_class.options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            max_restarts=settings.ray.max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            runtime_env={"env_vars": environment} if environment else None,
        ).remote(model, one, settings.plan.stall_timeout_s)
        for i in range(replicas)
    ]
    try:
        described = ray.get([actor.describe.remote() for actor in actors])
    except BaseException as exc:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.util.remove_placement_group(group)
        if isinstance(exc, ray.exceptions.RayError):
            cause = getattr(exc, "cause", None) or exc
            raise EngineError(f"a replica's engine failed to start on the Ray cluster: {cause}") from exc
        raise
    engines = [RayReplica(actor, info, i) for i, (actor, info) in enumerate(zip(actors, described, strict=True))]
    return RayReplicas(engines, group, address)


def _cpus_per_replica(nodes: list[dict[str, Any]], replicas: int) -> int:
    """The cluster's CPUs divided among ``replicas``, at most one node's (a
    replica runs on one node), at least 1. ``nodes``: ``ray.nodes()``."""
    cpus = _node_cpus(nodes)
    return max(min(sum(cpus) // replicas, max(cpus, default=1)), 1)


def _node_cpus(nodes: list[dict[str, Any]]) -> list[int]:
    """The CPUs of each node that is alive (``ray.nodes()``)."""
    return [int(node.get("Resources", {}).get("CPU", 0)) for node in nodes if node.get("Alive")]


def _one_replica(settings: EngineSettings) -> EngineSettings:
    import dataclasses

    return dataclasses.replace(settings, data_parallel_size=1)
