"""``--ray`` settings and placement arithmetic (issue 13). The real actors,
their death and the driver's are in tests/e2e/test_ray_e2e.py."""

from __future__ import annotations

import sys

import pytest

from bulkinfer.config import load_settings
from bulkinfer.engine.cluster import _cpus_per_replica, cpu_environment, ray_engine
from bulkinfer.errors import ConfigError
from bulkinfer.io.journal import results_settings, settings_changes


def node(cpus: float, alive: bool = True) -> dict[str, object]:
    return {"Alive": alive, "Resources": {"CPU": cpus}}


@pytest.mark.parametrize(
    ("nodes", "replicas", "expected"),
    [
        ([node(1), node(1)], 2, 1),  # the test cluster: one per node
        ([node(1), node(1)], 1, 1),  # one replica cannot span two nodes
        ([node(32), node(32), node(32)], 3, 32),
        ([node(32), node(32)], 8, 8),  # four per node
        ([node(8), node(8, alive=False)], 2, 4),  # a dead node's CPUs do not count
        ([node(1)], 4, 1),  # at least one (Ray then waits for room, bounded)
    ],
)
def test_cpus_per_replica_divides_the_cluster_within_one_node(
    nodes: list[dict[str, object]], replicas: int, expected: int
) -> None:
    assert _cpus_per_replica(nodes, replicas) == expected


def test_ray_settings_come_from_the_flag_and_the_config_table() -> None:
    settings = load_settings(None, {"ray.address": "auto", "engine.data_parallel_size": 4})
    assert (settings.ray.address, settings.ray.max_restarts, settings.ray.cpus_per_replica) == ("auto", 3, None)
    with pytest.raises(ConfigError, match=r"--ray-max-restarts must be an integer >= -1 \(-1: without limit\), got -2"):
        load_settings(None, {"ray.max_restarts": -2}, {"ray.max_restarts": "--ray-max-restarts"})
    with pytest.raises(ConfigError, match="ray.cpus_per_replica must be an integer >= 1, got 0"):
        load_settings(None, {"ray.cpus_per_replica": 0})
    with pytest.raises(ConfigError, match="--ray must be a Ray address"):
        load_settings(None, {"ray.address": " "}, {"ray.address": "--ray"})


def test_where_the_replicas_run_is_no_change_of_results_on_resume() -> None:
    here = results_settings(load_settings(None, {}))
    there = results_settings(load_settings(None, {"ray.address": "ray://head:10001", "ray.max_restarts": 0}))
    assert "ray" not in here and settings_changes(here, there) == []


def test_without_ray_installed_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"--ray needs Ray: pip install 'bulkinfer\[ray\]'"):
        ray_engine("model", load_settings(None, {"ray.address": "local"}))


def test_a_replica_with_a_node_to_itself_lets_vllm_bind_its_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    own = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine core in a process of its own
    assert cpu_environment(32, 32) == {"OMP_NUM_THREADS": "32", "VLLM_CPU_OMP_THREADS_BIND": "auto", **own}
    assert cpu_environment(8, 32) == {"OMP_NUM_THREADS": "8", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **own}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")
    assert cpu_environment(8, 32)["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"


def test_a_failure_of_the_cluster_itself_is_an_engine_error_naming_it() -> None:
    """The GCS unreachable mid-run (seen here under load) is exit 5 with a
    message, not a traceback."""
    import ray

    from bulkinfer.engine.cluster import RayReplicas
    from bulkinfer.errors import EngineError
    from bulkinfer.schema import Completion

    class Unreachable:
        max_model_len, max_num_seqs, settings = 2048, 4, {"fake": True}
        generated_tokens = prefilled_tokens = running_prompt_tokens = 0

        def running_lengths(self) -> list[int]:
            return []

        def add(self, request_id: str, request: object) -> Completion | None:
            return None

        def step(self, wait: float | None = None) -> list[Completion]:
            raise ray.exceptions.RpcError("Timed out while waiting for GCS to become available.")

        def has_unfinished(self) -> bool:
            return True

    from tests.engine.test_replicas import request

    replicas = RayReplicas([Unreachable()], None, "10.0.0.1:6379")  # type: ignore[list-item]
    replicas.add("r0", request("r0", 10))
    with pytest.raises(EngineError, match=r"the Ray cluster at '10.0.0.1:6379' failed: RpcError: Timed out .*--resume"):
        replicas.step(wait=0.01)
