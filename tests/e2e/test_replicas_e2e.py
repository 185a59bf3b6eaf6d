"""End to end (issue 13): ``--data-parallel-size 2``, one device per replica
(a CPU core each here), with the real engine and model: ``kill -9`` of the
driver mid-run takes both replicas' engines along; ``--resume`` at
``-dp 2`` finishes with every id exactly once, both replicas did work, and
at temperature 0 the completions match one engine's (one engine's run of
the same rows; batch composition may change a few). Both run in float32:
in bfloat16 (the dtype probe's choice on a CPU with AVX-512-BF16) a replica
on one core and an engine on two sum in other orders, and greedy decoding
parted on 7 of these 32 rows within 24 tokens (2026-11-25, AMD EPYC with
AVX-512-BF16: 25/32 identical, the engine in or out of bulkinfer's process
alike); in float32, 32/32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import kill_9_mid_run, resume_to_the_end

import bulkinfer as api

pytestmark = [pytest.mark.e2e, pytest.mark.devices(2, reason="two replicas, one device (CPU core or GPU) each")]

ROWS = 32


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flags = ["--data-parallel-size", "2", "--dtype", "float32"]
    return kill_9_mid_run(tmp_path_factory.mktemp("replicas"), *flags, rows=ROWS)


@pytest.fixture(scope="module")
def resumed(killed: dict[str, Any]) -> dict[str, Any]:
    # nothing stops the resumed run: its rows run at once, not four at a time (as the killed run's did)
    return resume_to_the_end(killed, flight_limit=False)


def test_kill_9_of_the_driver_takes_both_replicas_engines_along(killed: dict[str, Any]) -> None:
    """Checked by the chain: both replicas' engine processes ended with the
    driver, the lock refused a second run meanwhile."""
    assert 5 <= killed["kept"] < ROWS


def test_resume_at_two_replicas_ends_every_id_once(resumed: dict[str, Any]) -> None:
    engine = resumed["engine"]
    assert engine["data_parallel_size"] == 2
    ids = [row["id"] for row in resumed["outputs"]]
    assert len(ids) == len(set(ids)) == ROWS


def test_each_replica_keeps_its_batch_in_kv_block_order(resumed: dict[str, Any]) -> None:
    """The batch order is installed by name (vLLM's worker_extension_cls) in
    each replica's engine core process; these rows share no full KV block
    (their common chat-template start is shorter than one), so none moved."""
    engine = resumed["engine"]
    assert engine["in_process"] is False
    assert (engine["batch_order"], engine["batch_order_swaps"]) == ("kv-blocks", 0)
    assert "worker_extension_cls" not in engine  # bulkinfer's own, not reported as a vLLM argument of the user's


def test_both_replicas_worked_in_the_resumed_run(resumed: dict[str, Any]) -> None:
    replicas = resumed["engine"]["replicas"]
    left = ROWS - resumed["resumed"]["completed"]
    assert left > 2
    assert [r["rows"] > 0 for r in replicas] == [True, True]
    assert sum(r["rows"] for r in replicas) == left


def test_completions_match_one_engine_at_temperature_0(
    resumed: dict[str, Any], tmp_path: Path, shared_engine: Any
) -> None:
    """The one engine starts while the shared engine runs in this process:
    it runs in child processes (vLLM's distributed state is process-wide,
    and an in-process engine's shutdown destroys it), and the shared engine
    still runs rows after it closed (once it failed with "pipeline model
    parallel group is not initialized")."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(Path(resumed["src"]).read_bytes())
    before = api.run(src, tmp_path / "before.jsonl", engine=shared_engine, max_tokens=2, progress_plain=True)
    assert before.report["engine"]["in_process"] is True
    out = tmp_path / "one.jsonl"
    one_engine = api.run(src, out, dtype="float32", max_tokens=24, temperature=0, progress_plain=True)
    assert one_engine.report["engine"]["in_process"] is False
    after = api.run(src, tmp_path / "after.jsonl", engine=shared_engine, max_tokens=2, progress_plain=True)
    assert after.exit_code == 0 and after.report["request_counts"]["completed"] == ROWS
    assert resumed["engine"]["dtype"] == one_engine.report["engine"]["dtype"] == "float32"
    from e2e_helpers import read_jsonl

    one = {row["id"]: row["completion"] for row in read_jsonl(out)}
    two = {row["id"]: row["completion"] for row in resumed["outputs"]}
    assert len(one) == len(two) == ROWS
    same = sum(one[i] == two[i] for i in one)
    assert same >= 0.9 * ROWS, f"{same}/{ROWS} identical"
