"""End to end (issue 13): ``--data-parallel-size 2`` on this CPU, one core
per replica, with the real engine and model: every id exactly once, both
replicas did work, and at temperature 0 the completions match a
one-replica run's (batch composition may change a few)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e import SAMPLE, bulkinfer, kill_9_then_resume, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e

ROWS = 40


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("replicas")
    src = tmp / "in.jsonl"
    write_jsonl(src, read_jsonl(SAMPLE / "sharegpt.jsonl")[:ROWS])
    out: dict[str, Any] = {}
    for dp in (1, 2):
        path = tmp / f"dp{dp}.jsonl"
        args = ["run", str(src), "-o", str(path), "--temperature", "0", "--max-tokens", "24", "-dp", str(dp)]
        proc = bulkinfer(*args, "--plain-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(path.with_name(f"dp{dp}.report.json").read_text())
        out[dp] = {"rows": read_jsonl(path), "report": report}
    return out


def test_every_id_exactly_once_and_both_replicas_worked(runs: dict[str, Any]) -> None:
    ids = [row["id"] for row in runs[2]["rows"]]
    assert len(ids) == len(set(ids)) == ROWS
    engine = runs[2]["report"]["engine"]
    assert engine["data_parallel_size"] == 2
    assert [r["rows"] > 0 for r in engine["replicas"]] == [True, True]
    assert sum(r["rows"] for r in engine["replicas"]) == ROWS


def test_completions_match_one_replica_at_temperature_0(runs: dict[str, Any]) -> None:
    one = {row["id"]: row["completion"] for row in runs[1]["rows"]}
    two = {row["id"]: row["completion"] for row in runs[2]["rows"]}
    same = sum(one[i] == two[i] for i in one)
    assert same >= 0.9 * ROWS, f"{same}/{ROWS} identical"


def test_kill_9_of_the_driver_during_a_two_replica_run_then_resume(tmp_path: Path) -> None:
    report = kill_9_then_resume(tmp_path, "--data-parallel-size", "2")
    assert report["engine"]["data_parallel_size"] == 2
