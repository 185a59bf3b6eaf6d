"""The order of a run's output and errors files, with a fake engine.

The fake engine finishes requests in the order they are fed, and bulkinfer
feeds each window longest prompt first: so the spool's (completion) order is
not the input's, and these tests see publishing restore input order.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine
from vllm.entrypoints.launchers.run_batch import BatchRequestOutput

from bulkinfer.config import Settings, load_settings
from bulkinfer.errors import EXIT_PARTIAL, Interrupted
from bulkinfer.io import spool as spool_module
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.stop import StopToken

N_ROWS = 1000


def mixed_lengths(tmp_path: Path, n: int = N_ROWS, seed: int = 17) -> tuple[Path, list[str]]:
    """An input of ``n`` rows whose prompts are 1-120 words long in random order; and its ids."""
    rng = random.Random(seed)
    rows = [{"id": f"r{i}", "prompt": "word " * rng.randint(1, 120)} for i in range(n)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return src, [row["id"] for row in rows]


def settings(**plan: Any) -> Settings:
    return load_settings(None, {f"plan.{k}": v for k, v in plan.items()})


def ids(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        return [str(x) for x in pq.read_table(path).column("id").to_pylist()]
    return [orjson.loads(line)["id"] for line in path.read_bytes().splitlines()]


def test_the_default_output_is_in_input_order(tmp_path: Path) -> None:
    src, expected = mixed_lengths(tmp_path)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert ids(paths.output) == expected
    assert result.report["plan"]["output_order"] == "input"
    assert sorted(p.name for p in tmp_path.glob(".out*")) == [".out.lock"]  # no spool, run or temporary left


def test_completion_order_keeps_the_order_rows_finished_in(tmp_path: Path) -> None:
    src, expected = mixed_lengths(tmp_path)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, settings(output_order="completion"), RunContext(engine_factory=lambda m, s: FakeEngine()))
    got = ids(paths.output)
    assert sorted(got) == sorted(expected) and got != expected
    lengths = [orjson.loads(line)["prompt_tokens"] for line in paths.output.read_bytes().splitlines()]
    assert lengths == sorted(lengths, reverse=True)  # one window, fed and finished longest first
    assert result.report["plan"]["output_order"] == "completion"


def test_a_resumed_run_is_in_input_order_with_every_row_once(tmp_path: Path) -> None:
    src, expected = mixed_lengths(tmp_path)
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    stop = StopToken()
    with pytest.raises(Interrupted):
        run(
            paths,
            settings(window_rows=300),
            RunContext(engine_factory=lambda m, s: FakeEngine(stop_at=(150, stop)), stop=stop),
        )
    assert not paths.output.exists()
    result = run(paths, settings(window_rows=300), RunContext(resume=True, engine_factory=lambda m, s: FakeEngine()))
    assert result.report["resumed"]["completed"] >= 300  # the first attempt finished rows of two windows
    assert ids(paths.output) == expected


def test_the_errors_file_is_in_input_order_too(tmp_path: Path) -> None:
    src, expected = mixed_lengths(tmp_path, 300)
    lines = src.read_bytes().splitlines(keepends=True)
    for index in (5, 150, 299):
        lines[index] = b"not json\n"  # a row error found when the row is read
    src.write_bytes(b"".join(lines))
    rejected = {"r2", "r77", "r201"}  # row errors from the engine, in completion order
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    result = run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine(reject=rejected)))
    assert result.exit_code == EXIT_PARTIAL
    errors = [orjson.loads(line) for line in paths.errors.read_bytes().splitlines()]
    assert [e["line"] for e in errors] == [3, 6, 78, 151, 202, 300]
    assert ids(paths.output) == [i for n, i in enumerate(expected) if n not in (5, 150, 299) and i not in rejected]


def test_parquet_output_is_in_input_order_through_several_spilled_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool_module, "MERGE_RUN_ROWS", 64)
    spill = spool_module._spill
    spilled: list[Path] = []

    def counted(records: Any, spool: Path, index: int) -> Path:
        spilled.append(spill(records, spool, index))
        return spilled[-1]

    monkeypatch.setattr(spool_module, "_spill", counted)
    src, expected = mixed_lengths(tmp_path, 500)
    paths = RunPaths.build(src, tmp_path / "out.parquet")
    run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    assert ids(paths.output) == expected
    assert [p.name for p in spilled] == [f".out.parquet.partial.jsonl.run-{k}.tmp" for k in range(8)]  # 500 / 64
    assert sorted(p.name for p in tmp_path.glob(".out*")) == [".out.lock"]  # runs and temporaries removed


def test_openai_batch_output_lines_are_in_input_order_and_unchanged_in_shape(tmp_path: Path) -> None:
    rng = random.Random(3)
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "word " * rng.randint(1, 80)}]},
        }
        for i in range(120)
    ]
    src = tmp_path / "batch.jsonl"
    src.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    paths = RunPaths.build(src, tmp_path / "batch.out.jsonl")
    run(paths, settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    records = [orjson.loads(line) for line in paths.output.read_bytes().splitlines()]
    assert [r["custom_id"] for r in records] == [f"req-{i}" for i in range(120)]
    assert all(set(r) == {"id", "custom_id", "response", "error"} for r in records)
    for record in records:
        BatchRequestOutput.model_validate(record)
