"""Replicas behind one engine (issue 13): requests go where the tokens in
flight are fewest, every request ends exactly once, a replica busy stepping
gets its requests when its step returns, and each replica gets its own
devices. Fake engines: the orchestration, not inference (tests/e2e runs
``--data-parallel-size 2`` with the real engine)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.engine.replicas import ReplicaLost, Replicas, replica_environments
from bulkinfer.errors import ConfigError, EngineError
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.schema import Completion, Request


def request(rid: str, prompt_tokens: int, max_tokens: int = 10, n: int = 1) -> Request:
    return Request(
        seq=0,
        line=1,
        id=rid,
        prompt=None,
        messages=None,
        max_tokens=max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=None,
        stop=(),
        options={"n": n},
        prompt_token_ids=[1] * prompt_tokens,
    )


def test_requests_go_where_the_tokens_in_flight_are_fewest() -> None:
    a, b = FakeEngine(), FakeEngine()
    replicas = Replicas([a, b])
    replicas.add("big", request("big", 1000))  # 1010 tokens on a
    for i in range(5):
        replicas.add(f"s{i}", request(f"s{i}", 90))  # 100 tokens each: all fit on b before it passes a
    assert [rid for rid, _ in a.queue] == ["big"]
    assert [rid for rid, _ in b.queue] == ["s0", "s1", "s2", "s3", "s4"]
    replicas.add("n3", request("n3", 10, max_tokens=100, n=3))  # 310 tokens: b holds 500 < 1010
    assert [rid for rid, _ in b.queue][-1] == "n3"
    assert replicas.max_num_seqs == a.max_num_seqs + b.max_num_seqs


def test_every_request_ends_once_and_both_replicas_report_their_work() -> None:
    replicas = Replicas([FakeEngine(), FakeEngine()])
    for i in range(12):
        replicas.add(f"r{i}", request(f"r{i}", 5 + i))
    finished: list[Completion] = []
    while len(finished) < 12:
        finished += replicas.step(wait=1.0)
    assert sorted(c.request_id for c in finished) == sorted(f"r{i}" for i in range(12))
    assert replicas.step(wait=0.01) == [] and not replicas.has_unfinished()
    stats = replicas.settings["replicas"]
    assert [s["rows"] for s in stats] == [6, 6]
    assert sum(s["prompt_tokens"] for s in stats) == sum(5 + i for i in range(12))
    assert replicas.settings["data_parallel_size"] == 2 and replicas.settings["fake"] is True


class SteppingEngine(FakeEngine):
    """A fake whose step runs in the background: ``stepping`` until the next
    ``step`` call returns it; an ``add`` meanwhile is a test failure (the
    real engine would block the caller until its step ended)."""

    def __init__(self) -> None:
        super().__init__()
        self.stepping = False
        self.adds_while_stepping = 0

    def add(self, request_id: str, request: Request) -> Completion | None:
        self.adds_while_stepping += self.stepping
        return super().add(request_id, request)

    def step(self, wait: float | None = None) -> list[Completion]:
        if not self.stepping:  # a step starts; it returns at the next call
            self.stepping = True
            return []
        self.stepping = False
        return super().step(wait)


def test_abort_unfinished_empties_every_replica_and_the_next_requests_run_clean() -> None:
    a, b = FakeEngine(), FakeEngine()
    replicas = Replicas([a, b])
    for i in range(6):
        replicas.add(f"old{i}", request(f"old{i}", 10))
    replicas.abort_unfinished()
    assert sorted(a.aborted + b.aborted) == [f"old{i}" for i in range(6)]
    assert not replicas.has_unfinished() and replicas.step(wait=0.01) == []
    replicas.add("new", request("new", 10))  # a later run's request: routed and finished alone
    finished: list[Completion] = []
    while replicas.has_unfinished():
        finished += replicas.step(wait=0.01)
    assert [c.request_id for c in finished] == ["new"]
    assert sum(s.rows for s in replicas.stats) == 1


def test_a_replica_busy_stepping_gets_its_requests_when_its_step_returns() -> None:
    a, b = SteppingEngine(), SteppingEngine()
    replicas = Replicas([a, b])
    replicas.add("r0", request("r0", 5))
    replicas.add("r1", request("r1", 5))
    assert replicas.step(wait=0) == []  # both start a step
    assert a.stepping and b.stepping
    replicas.add("r2", request("r2", 5))  # held: a is stepping
    assert [rid for rid, _ in a.queue] == ["r0"]
    finished: list[Completion] = []
    while len(finished) < 3:
        finished += replicas.step(wait=1.0)
    assert sorted(c.request_id for c in finished) == ["r0", "r1", "r2"]
    assert a.adds_while_stepping == b.adds_while_stepping == 0


def test_a_rejection_of_a_held_request_comes_back_from_step() -> None:
    a = SteppingEngine()
    a.reject = {"bad"}
    replicas = Replicas([a])
    replicas.add("ok", request("ok", 5))
    replicas.step(wait=0)  # a steps
    assert replicas.add("bad", request("bad", 5)) is None  # held
    finished: list[Completion] = []
    while len(finished) < 2:
        finished += replicas.step(wait=1.0)
    errors = [c for c in finished if c.error is not None]
    assert [c.request_id for c in errors] == ["bad"] and not replicas.step(wait=0)


def test_cpu_replicas_get_equal_shares_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert replica_environments(2, 1, "cpu") == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    ]
    with pytest.raises(ConfigError, match="needs at least 6 CPU cores, one per replica; this process may use 5"):
        replica_environments(6, 1, "cpu")


def test_gpu_replicas_get_tensor_parallel_size_devices_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_environments(2, 2, "cuda") == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    with pytest.raises(ConfigError, match="needs 6 GPUs; 4 visible"):
        replica_environments(3, 2, "cuda")


def test_a_run_through_replicas_writes_every_row_once_and_reports_each_replica(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": "word " * (1 + i % 7)} for i in range(40)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    engines: list[Any] = []

    def factory(model: str, settings: Any) -> Replicas:
        engines.extend([FakeEngine(), FakeEngine()])
        return Replicas(engines)

    result = run(RunPaths.build(src, tmp_path / "out.jsonl"), load_settings(), RunContext(engine_factory=factory))
    ids = [orjson.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert sorted(ids) == sorted(r["id"] for r in rows)
    replicas = result.report["engine"]["replicas"]
    assert len(replicas) == 2 and all(r["rows"] > 0 for r in replicas)
    assert sum(r["rows"] for r in replicas) == 40
    assert result.report["engine"]["replica_balance"] >= 1.0


def run_through(replicas: Callable[[], Replicas], tmp_path: Path, rows: int) -> tuple[Any, str, str]:
    """A run of ``rows`` prompt rows through ``replicas()``: its result, the
    terminal summary and the HTML report."""
    import io

    from rich.console import Console

    from bulkinfer.report.html import write_run_html
    from bulkinfer.report.terminal import print_summary

    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": "hi " * (i + 1)}) + b"\n" for i in range(rows)))
    result = run(
        RunPaths.build(src, tmp_path / "out.jsonl"), load_settings(), RunContext(engine_factory=lambda m, s: replicas())
    )
    out = io.StringIO()
    print_summary(result.report, Console(file=out, width=200))
    write_run_html(result.report, tmp_path / "r.html")
    return result, out.getvalue(), (tmp_path / "r.html").read_text()


def test_the_report_shows_each_replica(tmp_path: Path) -> None:
    _, terminal, page = run_through(lambda: Replicas([FakeEngine(), FakeEngine()]), tmp_path, 8)
    assert "replicas (2)" in terminal and "rows 4/4" in terminal
    assert "<h2>Replicas</h2>" in page and "Balance (slowest / fastest busy time)" in page


class MortalEngine(FakeEngine):
    """A fake replica whose runner survives its death (a Ray actor): its step
    number ``die_at`` raises ReplicaLost and drops what it held; it is
    unavailable for ``down_for`` availability checks, then up again, or
    ``dead`` for good when ``restarts`` are used up."""

    def __init__(self, die_at: int | None = None, down_for: int = 0, restarts: int = 1):
        super().__init__()
        self.die_at, self.down_for, self.restarts = die_at, down_for, restarts
        self.down = 0
        self.dead = False

    @property
    def available(self) -> bool:
        if self.down > 0:
            self.down -= 1
            return False
        return not self.dead

    def step(self, wait: float | None = None) -> list[Completion]:
        if self.steps + 1 == self.die_at:
            self.steps += 1
            self.queue.clear()
            self.dead = self.restarts == 0
            self.down = self.down_for
            raise ReplicaLost("replica 0 on 10.0.0.1 died: SIGKILL")
        return super().step(wait)


def drain(replicas: Replicas, expected: int) -> list[Completion]:
    finished: list[Completion] = []
    for _ in range(10_000):
        if len(finished) >= expected and not replicas.has_unfinished():
            break
        finished += replicas.step(wait=0.05)
    return finished


def test_a_lost_replicas_requests_go_to_the_others_and_each_ends_once(capsys: pytest.CaptureFixture[str]) -> None:
    mortal, other = MortalEngine(die_at=2, down_for=1000), FakeEngine()
    replicas = Replicas([mortal, other])
    for i in range(10):
        replicas.add(f"r{i}", request(f"r{i}", 10))
    finished = drain(replicas, 10)
    ids = sorted(c.request_id for c in finished)
    assert ids == sorted(f"r{i}" for i in range(10))  # exactly once: no duplicate, none lost
    stats = replicas.settings["replicas"]
    # the mortal replica finished 2 in its first step, then died holding 3 (5 were its share)
    assert (stats[0]["rows"], stats[0]["deaths"], stats[0]["requeued"]) == (2, 1, 3)
    assert stats[1]["rows"] == 8
    warning = "replica 0 on 10.0.0.1 died: SIGKILL; its 3 unfinished request(s) go to the others"
    assert warning in capsys.readouterr().err


def test_requests_wait_while_every_replica_restarts_then_go_to_the_first_back() -> None:
    only = MortalEngine(die_at=1, down_for=5)
    replicas = Replicas([only])
    for i in range(3):
        replicas.add(f"r{i}", request(f"r{i}", 10))
    finished = drain(replicas, 3)
    assert sorted(c.request_id for c in finished) == ["r0", "r1", "r2"]
    assert replicas.settings["replicas"][0]["deaths"] == 1


def test_every_replica_dead_for_good_stops_the_run() -> None:
    replicas = Replicas([MortalEngine(die_at=1, restarts=0), MortalEngine(die_at=1, restarts=0)])
    for i in range(4):
        replicas.add(f"r{i}", request(f"r{i}", 10))
    with pytest.raises(EngineError, match="every replica died and none will restart; 4 request"):
        drain(replicas, 4)


def test_a_run_with_a_replica_lost_writes_every_row_once_and_reports_the_death(tmp_path: Path) -> None:
    result, terminal, page = run_through(
        lambda: Replicas([MortalEngine(die_at=2, down_for=10**6), FakeEngine()]), tmp_path, 20
    )
    assert result.exit_code == 0
    ids = [orjson.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))
    replicas = result.report["engine"]["replicas"]
    assert replicas[0]["deaths"] == 1 and replicas[0]["requeued"] > 0
    assert replicas[0]["rows"] + replicas[1]["rows"] == 20
    assert f"1 died, {replicas[0]['requeued']} requests moved" in terminal
    assert "<th>deaths</th><th>requeued</th>" in page
    assert f'<td class="n">{replicas[0]["requeued"]}</td>' in page


def test_replica_starts_overlap_each_spawning_with_its_own_environment(tmp_path: Path) -> None:
    """The first start holds the environment only until its process is
    spawned: the second starts (and ends) while the first still waits, as an
    engine loads; each child sees its own value; the environment is restored."""
    import multiprocessing

    from bulkinfer.engine.processes import environment_until_spawned

    spawn = multiprocessing.get_context("spawn")
    name = "BULKINFER_TEST_REPLICA"
    first_spawned, second_done = threading.Event(), threading.Event()
    overlapped: list[bool] = []

    def start(value: str) -> None:
        with environment_until_spawned({name: value}):
            child = spawn.Process(target=os.system, args=(f"echo ${name} > {tmp_path / value}; sleep 1",))
            child.start()
            if value == "a":
                first_spawned.set()
                overlapped.append(second_done.wait(30))  # the first engine "loads" while the second starts
            child.join()
        if value == "b":
            second_done.set()

    first = threading.Thread(target=start, args=("a",))
    first.start()
    assert first_spawned.wait(30)
    second = threading.Thread(target=start, args=("b",))
    second.start()
    first.join(60)
    second.join(60)
    assert overlapped == [True]
    assert [(tmp_path / v).read_text().strip() for v in ("a", "b")] == ["a", "b"]
    assert name not in os.environ


SPAWN_FROM_STDIN = """
import multiprocessing, os, sys
from bulkinfer.engine.processes import environment_until_spawned

if __name__ == "__main__":
    hide = sys.argv[1] == "hide"
    child = multiprocessing.get_context("spawn").Process(target=os.getpid)
    if hide:
        with environment_until_spawned({}):
            child.start()
            child.join()
    else:
        child.start()
        child.join()
    import __main__
    print(child.exitcode, __main__.__file__)
"""


@pytest.mark.parametrize("hide", [True, False])
def test_a_script_from_standard_input_can_spawn_the_engines_processes(hide: bool) -> None:
    """``python -`` (``__main__.__file__ == "<stdin>"``): a spawned child
    fails to run the parent's main file again (as vLLM's engine core did)
    unless the engine's start hides it; it is back afterwards."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-", "hide" if hide else "plain"],
        input=SPAWN_FROM_STDIN,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exitcode, main_file = proc.stdout.split()
    assert (exitcode, main_file) == ("0" if hide else "1", "<stdin>")
    assert ("No such file or directory" in proc.stderr) == (not hide)


def test_the_replicas_close_at_once_and_the_first_error_comes_after_all_closed() -> None:
    """Each replica's close runs in a thread of its own: two local replicas'
    vLLM shutdowns (5 s each) took 11 s from the first to the exit one after
    the other, 6 s at once (AMD EPYC Zen 4, 4 rows, ``-dp 2``). Both closes
    here wait for each other at a barrier, which one after the other never passes."""
    both = threading.Barrier(2, timeout=10)

    class Closing(FakeEngine):
        def __init__(self, fails: bool = False):
            super().__init__()
            self.fails, self.closed = fails, False

        def close(self) -> None:
            both.wait()
            self.closed = True
            if self.fails:
                raise EngineError("replica 0 failed to close")

    failing, other = Closing(fails=True), Closing()
    with pytest.raises(EngineError, match="replica 0 failed to close"):
        Replicas([failing, other]).close()
    assert failing.closed and other.closed
