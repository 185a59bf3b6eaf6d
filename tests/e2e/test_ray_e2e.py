"""End to end (issue 13): ``--ray`` on a local Ray cluster of two nodes (a
head and one more node process on this machine, one CPU each), with the real
engine and model: the replicas are Ray actors, one per node. ``kill -9`` of
the driver during a ``--ray`` run ends its actors; ``--resume`` on the same
cluster, during which one actor is killed with SIGKILL, still ends every id
exactly once, the dead replica's requests done by the other."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray  # noqa: F401  (bulkinfer[ray]: make install has it)
from e2e_helpers import SMALL_KV_CACHE, kill_9_mid_run, resume_to_the_end, spool_lines, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.devices(2, reason="two replicas, one CPU each")]

ROWS = 28

# Each replica's KV cache: the smallest holds these 28-row jobs; the CPU default (25% of memory) would take each
# replica ~10 s more to allocate. bulkinfer sizes it by itself only where the engines run on this machine (not a
# cluster's).
KV_CACHE = SMALL_KV_CACHE


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray cluster of two nodes on this machine, one CPU each: its address.

    The runs leave the replicas' threads unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``,
    a user's own setting, which bulkinfer passes on): bulkinfer sees a node
    of one CPU per replica and would let vLLM bind each replica to the cores
    (``auto``), and on one machine both bound to cores 0 and 1, two threads
    each: on 2 cores (AMD EPYC) each replica's start took ~77 s bound, ~47 s
    unbound (two local replicas, a core each: ~42 s)."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            yield str(nodes.address)
    finally:
        nodes.shutdown()


def replica_actors(_driver: int = 0) -> list[psutil.Process]:
    """The processes of the replicas' Ray actors (Ray titles them ``ray::ReplicaActor...``)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if " ".join(proc.info["cmdline"] or ()).startswith("ray::ReplicaActor"):
            found.append(proc)
    return found


# The shared memory (/dev/shm/psm_*) the surviving replica's engine maps when the other is killed (kill_a_replica),
# and what the killed one's maps.
SURVIVOR_SHM: set[str] = set()
KILLED_SHM: set[str] = set()


def shared_memory_of(proc: psutil.Process) -> set[str]:
    """The ``/dev/shm/psm_*`` files ``proc`` and its descendants map (vLLM's shared-memory queues)."""
    found = set()
    for one in [proc, *proc.children(recursive=True)]:
        try:
            found |= {m.path for m in one.memory_maps() if m.path.startswith("/dev/shm/psm_")}
        except psutil.Error:  # gone meanwhile
            pass
    return found


def kill_a_replica(resumed: subprocess.Popen[str], kept: int) -> None:
    """SIGKILL of one replica's actor once five more rows are on disk."""
    spool = Path(str(resumed.args[resumed.args.index("-o") + 1])).parent / ".out.jsonl.partial.jsonl"
    wait_until(lambda: spool_lines(spool) >= kept + 5, resumed)
    actors = replica_actors()
    assert len(actors) == 2, actors
    SURVIVOR_SHM.update(shared_memory_of(actors[1]))
    KILLED_SHM.update(shared_memory_of(actors[0]))
    os.kill(actors[0].pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, cluster: str) -> dict[str, Any]:
    flags = ["--ray", cluster, "-dp", "2", "--max-in-flight", "8", *KV_CACHE]
    return kill_9_mid_run(tmp_path_factory.mktemp("ray"), *flags, rows=ROWS, engines=replica_actors)


@pytest.fixture(scope="module")
def resumed(killed: dict[str, Any], cluster: str) -> dict[str, Any]:
    return {**resume_to_the_end(killed, during_resume=kill_a_replica), "cluster": cluster}


def test_kill_9_of_the_driver_ends_its_ray_actors(killed: dict[str, Any]) -> None:
    """Checked by the chain: Ray ended the actors (their engines with them)
    when the driver was killed; the lock refused a second run meanwhile."""
    assert 5 <= killed["kept"] < ROWS


def test_resume_on_the_same_cluster_ends_every_id_once(resumed: dict[str, Any]) -> None:
    """``--resume`` on the same cluster finishes every id exactly once."""
    assert resumed["engine"]["ray_address"] == resumed["cluster"]
    assert resumed["engine"]["data_parallel_size"] == 2
    ids = [row["id"] for row in resumed["outputs"]]
    assert len(ids) == len(set(ids)) == ROWS


def test_a_replica_killed_mid_run_hands_its_requests_to_the_other(resumed: dict[str, Any]) -> None:
    """SIGKILL of one replica's actor during the resumed run: it ends with
    exit 0 (checked by the chain), and the report shows the death and the
    requests that went to the other replica."""
    assert "died" in resumed["stderr"] and "go to the others" in resumed["stderr"], resumed["stderr"][-3000:]
    replicas = resumed["engine"]["replicas"]
    assert sum(r["deaths"] for r in replicas) == 1
    assert sum(r["requeued"] for r in replicas) >= 1
    assert sum(r["rows"] for r in replicas) == ROWS - resumed["resumed"]["completed"]
    assert resumed["request_counts"]["completed"] == ROWS


def test_a_replica_alive_at_the_end_shuts_its_engine_down_and_leaves_no_shared_memory(resumed: dict[str, Any]) -> None:
    """The replica that survived the resumed run closed its engine through
    vLLM's shutdown before Ray killed its actor: its engine's shared-memory
    queues are gone from /dev/shm (``ray.kill`` alone left them there)."""
    assert SURVIVOR_SHM, "the surviving replica's engine mapped no /dev/shm/psm_* file"
    assert not [path for path in SURVIVOR_SHM if os.path.exists(path)]


def test_the_engine_of_a_killed_actor_leaves_no_shared_memory(resumed: dict[str, Any]) -> None:
    """Ray kills an actor's resource tracker and engine processes with it:
    the engine's watchdog unlinks what they held open in /dev/shm (the
    killed replica's 2 files stayed there before). Not after the driver's
    kill -9: Ray ends the whole tree of each actor at once, watchdog
    included (the README says so)."""
    assert len(KILLED_SHM) >= 2, KILLED_SHM  # vLLM's two queues of one engine
    assert not [path for path in KILLED_SHM if os.path.exists(path)]
