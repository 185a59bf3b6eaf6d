"""``--ray`` settings and placement arithmetic (issue 13). The real actors,
their death and the driver's are in tests/e2e/test_ray_e2e.py."""

from __future__ import annotations

import sys

import pytest

from bulkinfer.config import load_settings
from bulkinfer.engine.ray_start import _cpus_per_replica, cpu_environment, ray_engine
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
        generated_tokens = prefilled_tokens = running_prompt_tokens = ended_sequences = 0

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


class FakeActor:
    """A Ray actor handle whose method calls return their names (as refs)
    and record them: ``describe`` and ``close``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        outer = self

        class Method:
            def __init__(self, name: str):
                self.name = name

            def remote(self) -> str:
                outer.calls.append(self.name)
                return f"{self.name}#{len(outer.calls)}"

        self.describe, self.close = Method("describe"), Method("close")


def test_a_replica_asked_while_ray_restarts_it_asks_again_and_rejoins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``describe`` sent while Ray restarts the actor fails with
    ActorUnavailableError ("The actor is restarting": seen with Ray 2.60 on
    every SIGKILLed replica): the replica is restarting, not dead, so it
    asks again and takes requests once the engine is up; a replica whose
    restarts are used up (ActorDiedError) is dead."""
    import ray

    from bulkinfer.engine.cluster import RayReplica

    answers: dict[str, object] = {
        "describe#1": ray.exceptions.ActorUnavailableError("The actor is restarting.", None),
        "describe#2": {"node": "10.0.0.2"},
    }

    def get(ref: str) -> object:
        if isinstance(answers[ref], Exception):
            raise answers[ref]  # type: ignore[misc]
        return answers[ref]

    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (list(refs), []))
    monkeypatch.setattr(ray, "get", get)
    actor = FakeActor()
    replica = RayReplica(actor, {"max_model_len": 64, "max_num_seqs": 4, "settings": {}, "node": "10.0.0.1"}, 0)
    replica._restarting = actor.describe.remote()  # as step() does when the actor died
    assert replica.available is False and not replica.dead  # restarting: asked again
    assert replica.available is True and replica.node == "10.0.0.2"
    assert "replica 0 on 10.0.0.2 is up again: it takes requests" in capsys.readouterr().err
    assert replica.close_engine() == "close#3"  # up: its engine is shut down before the kill
    answers["describe#4"] = ray.exceptions.ActorDiedError()
    replica._restarting = actor.describe.remote()
    assert replica.available is False and replica.dead
    assert replica.close_engine() is None and actor.calls == ["describe", "describe", "close", "describe"]


def test_closing_shuts_every_engine_down_before_the_actors_are_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.kill`` alone left each engine's shared-memory queues in
    /dev/shm (4 files and 2 semaphores after a 2-replica run, Ray 2.60): the
    engines are shut down first, all at once, and only then killed."""
    import ray

    from bulkinfer.engine.cluster import ENGINE_CLOSE_S, RayReplica, RayReplicas

    order: list[str] = []
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (order.append(f"wait {sorted(refs)} {kw}"), (refs, []))[1])
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: order.append(f"kill {no_restart}"))
    monkeypatch.setattr(ray.util, "remove_placement_group", lambda group: order.append("remove"))
    monkeypatch.setattr(ray, "shutdown", lambda: order.append("shutdown"))
    info = {"max_model_len": 64, "max_num_seqs": 4, "settings": {}, "node": "10.0.0.1"}
    up, dead = RayReplica(FakeActor(), info, 0), RayReplica(FakeActor(), info, 1)
    dead.dead = True
    RayReplicas([up, dead], "group", "10.0.0.1:6379").close()
    waited = f"wait ['close#1'] {{'num_returns': 1, 'timeout': {ENGINE_CLOSE_S}}}"
    assert order == [waited, "kill True", "kill True", "remove", "shutdown"]
