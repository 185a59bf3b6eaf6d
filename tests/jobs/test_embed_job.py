"""The orchestration of ``bulkinfer embed`` with a fake encoder engine (the
real tokenizer of the embedded all-MiniLM-L6-v2): records per row, the
Parquet vector column, resume refusing another --truncate. It never stands
in as proof that embedding works: tests/e2e/test_embed_e2e.py runs vLLM."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import FakeEncoder

from bulkinfer.config import Settings
from bulkinfer.errors import ConfigError, Interrupted
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.embed import embed
from bulkinfer.stop import StopToken

ROWS = [
    {"id": "a", "text": "The cat sat on the mat.", "lang": "en"},
    {"id": "b", "text": ""},
    {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["x y", "z"]}},
    {"id": "d", "text": "word " * 300},
    {"id": "e", "input": "hello"},
]


def write(path: Path) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))
    return path


def test_every_row_is_one_record_and_the_vectors_are_a_fixed_size_list(tmp_path: Path) -> None:
    paths = RunPaths(write(tmp_path / "in.jsonl"), tmp_path / "out.parquet")
    result = embed(paths, Settings(), RunContext(engine_factory=lambda model, settings: FakeEncoder()))
    assert (result.exit_code, result.completed, result.failed) == (3, 3, 2)
    table = pq.read_table(paths.output)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    rows = table.to_pylist()
    assert [r["custom_id"] or r["id"] for r in rows] == ["a", "c", "e"]  # input order
    assert rows[0]["embedding"] == [9.0, 0.0, 1.0] and rows[0]["prompt_tokens"] == 9 and rows[0]["lang"] == "en"
    data = rows[1]["response"]["body"]["data"]
    assert [d["embedding"] for d in data] == [[4.0, 0.0, 1.0], [3.0, 1.0, 1.0]]
    errors = {r["id"]: r["error"]["type"] for r in map(orjson.loads, paths.errors.read_bytes().splitlines())}
    assert errors == {"b": "invalid_field", "d": "context_length_exceeded"}
    report = result.report
    assert report["job"] == "embed" and report["model"] == "all-minilm-l6-v2"
    assert report["embedding"] == {"max_seq_length": 256, "normalize": True, "truncate": False, "truncated_inputs": 0}
    generation_only = ("sampling", "chat_template_applied", "finish_reasons", "structured_outputs")
    assert not set(report) & {*generation_only, "completion_length_histogram"}  # an encoder generates no text


def test_resume_refuses_another_truncate_and_completes_with_the_same(tmp_path: Path) -> None:
    paths = RunPaths(write(tmp_path / "in.jsonl"), tmp_path / "out.jsonl")
    stop = StopToken()
    with pytest.raises(Interrupted):
        embed(paths, Settings(), RunContext(engine_factory=lambda m, s: FakeEncoder(stop_at=(1, stop)), stop=stop))
    with pytest.raises(ConfigError, match=r"embed\.truncate: false -> true"):
        embed(paths, Settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEncoder()), True)
    result = embed(paths, Settings(), RunContext(resume=True, engine_factory=lambda m, s: FakeEncoder()))
    assert (result.completed, result.failed) == (3, 2)
    ids = [r.get("custom_id") or r.get("id") for r in map(orjson.loads, paths.output.read_bytes().splitlines())]
    assert ids == ["a", "c", "e"]


def test_an_empty_input_gets_each_jobs_own_columns(tmp_path: Path) -> None:
    """A day's empty input (a Parquet file of no rows) to Parquet: the output
    has the columns its job's rows have (no engine starts), so a reader of
    the daily files finds the same columns in every one."""
    from bulkinfer.jobs.run import run
    from bulkinfer.jobs.score import score

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "texts.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "prompts.parquet")
    pq.write_table(
        pa.table({"text_1": pa.array([], pa.string()), "text_2": pa.array([], pa.string())}), tmp_path / "pairs.parquet"
    )
    never = RunContext(engine_factory=lambda model, settings: pytest.fail("no engine for no rows"))
    for job, src, columns in [
        (embed, "texts", {"id": pa.string(), "embedding": pa.list_(pa.float32()), "prompt_tokens": pa.int64()}),
        (score, "pairs", {"id": pa.string(), "prompt_tokens": pa.int64()}),
        (run, "prompts", {"id": pa.string(), "completion": pa.string(), "finish_reason": pa.string(),
                          "prompt_tokens": pa.int64(), "completion_tokens": pa.int64()}),
    ]:  # fmt: skip
        out = tmp_path / job.__name__ / "out.parquet"
        result = job(RunPaths.build(tmp_path / f"{src}.parquet", out), Settings(), never)
        assert result.exit_code == 0
        table = pq.read_table(out)
        assert table.num_rows == 0 and dict(zip(table.schema.names, table.schema.types, strict=True)) == columns
