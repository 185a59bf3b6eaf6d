"""Tests of bulkinfer.io.spool: the spool's line format and the external merge that restores input order."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from bulkinfer.io import spool as spool_module
from bulkinfer.io.spool import Spool, publish_spool, read_spool, run_paths, sorted_records, spool_records


def shuffled_spool(tmp_path: Path, n: int, seed: int = 7) -> tuple[Path, list[int]]:
    """A spool of ``n`` rows (input lines 1..n) appended in a shuffled (completion) order."""
    lines = list(range(1, n + 1))
    random.Random(seed).shuffle(lines)
    path = tmp_path / ".out.jsonl.partial.jsonl"
    spool = Spool(path)
    for line in lines:
        spool.add(line, {"id": f"r{line}", "completion": "x" * (line % 7), "n": line})
    spool.close()
    return path, lines


def test_a_spool_line_keeps_the_record_exactly_and_its_input_line(tmp_path: Path) -> None:
    record: dict[str, Any] = {"id": "batch_req_1", "custom_id": "a,b]", "response": None, "error": {"code": "x"}}
    path = tmp_path / "s.jsonl"
    spool = Spool(path)
    spool.add(12, record)
    spool.close()
    assert path.read_bytes() == b"[12," + orjson.dumps(record) + b"]\n"
    assert list(read_spool(path)) == [(12, orjson.dumps(record))]
    assert list(spool_records(path)) == [(12, record)]


def test_a_bare_record_line_is_keyed_by_its_line_field_else_0(tmp_path: Path) -> None:
    path = tmp_path / "errors.jsonl"
    path.write_bytes(b'{"id": "a", "line": 5, "error": {}}\n\n{"id": "b", "completion": "c"}\n')
    assert [line for line, _ in read_spool(path)] == [5, 0]


@pytest.mark.parametrize("run_rows", [1000, 7, 1])
def test_sorted_records_are_in_input_order_whatever_the_run_size(tmp_path: Path, run_rows: int) -> None:
    path, _ = shuffled_spool(tmp_path, 200)
    assert [line for line, _ in sorted_records(path, run_rows)] == list(range(1, 201))
    assert run_paths(path) == []  # the runs are removed when the merge ends


def test_the_merge_spills_runs_of_at_most_run_rows_and_removes_them(tmp_path: Path) -> None:
    path, _ = shuffled_spool(tmp_path, 100)
    merged = sorted_records(path, run_rows=8)
    first = next(merged)
    runs = run_paths(path)
    assert len(runs) == math.ceil(100 / 8)  # 13 sorted runs on disk, none longer than 8 records
    assert all(len(list(read_spool(run))) <= 8 for run in runs)
    assert all([line for line, _ in read_spool(run)] == sorted(line for line, _ in read_spool(run)) for run in runs)
    assert first[0] == 1
    merged.close()  # a merge abandoned part-way leaves no run behind
    assert run_paths(path) == []


def test_more_runs_than_the_fan_in_are_merged_in_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_module, "MERGE_FAN_IN", 3)
    path, _ = shuffled_spool(tmp_path, 250)
    merged = sorted_records(path, run_rows=4)  # 63 runs -> 21 -> 7 -> 3 merged at once
    assert next(merged)[0] == 1
    assert len(run_paths(path)) == 3
    assert [line for line, _ in merged] == list(range(2, 251))
    assert run_paths(path) == []


def test_publish_in_input_order_strips_the_line_and_removes_the_spool(tmp_path: Path) -> None:
    path, _ = shuffled_spool(tmp_path, 50)
    out = tmp_path / "out.jsonl"
    publish_spool(path, out, "input", run_rows=6)
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert records == [{"id": f"r{i}", "completion": "x" * (i % 7), "n": i} for i in range(1, 51)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no spool, runs or temporaries


def test_publish_in_completion_order_keeps_the_spools_order(tmp_path: Path) -> None:
    path, lines = shuffled_spool(tmp_path, 50)
    out = tmp_path / "out.jsonl"
    publish_spool(path, out, "completion", run_rows=6)
    assert [orjson.loads(line)["n"] for line in out.read_bytes().splitlines()] == lines


def test_publish_parquet_in_input_order(tmp_path: Path) -> None:
    path, _ = shuffled_spool(tmp_path, 50)
    out = tmp_path / "out.parquet"
    publish_spool(path, out, "input", run_rows=6)
    assert pq.read_table(out).column("n").to_pylist() == list(range(1, 51))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


def test_a_failed_publish_keeps_the_spool_and_leaves_no_temporary(tmp_path: Path) -> None:
    path, _ = shuffled_spool(tmp_path, 30)
    out = tmp_path / "missing-dir" / "out.jsonl"  # the ordered temporary cannot be created
    with pytest.raises(FileNotFoundError):
        publish_spool(path, out, "input", run_rows=4)
    assert path.exists() and len(list(read_spool(path))) == 30
    assert run_paths(path) == [] and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_write_failing_during_the_merge_leaves_no_run_or_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = shuffled_spool(tmp_path, 40)
    written: list[bytes] = []

    def full_disk(target: Path, chunks: Any) -> None:
        for chunk in chunks:
            written.append(chunk)
            if len(written) == 5:
                assert run_paths(path)  # the merge is under way
                raise OSError(28, "No space left on device", str(target))

    monkeypatch.setattr(spool_module, "write_synced", full_disk)
    with pytest.raises(OSError, match="No space"):
        publish_spool(path, tmp_path / "out.jsonl", "input", run_rows=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # the spool stays for --resume
