"""Tests of bulkinfer.io.files: paths, record shapes, the spool and its publication."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion
from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
from vllm.entrypoints.openai.completion.protocol import CompletionResponse

from bulkinfer.config import SamplingDefaults
from bulkinfer.errors import ConfigError, InputFileError
from bulkinfer.io import files as writers
from bulkinfer.io.files import JsonlAppender, publish
from bulkinfer.io.formats import JSONL, PARQUET, default_output, input_format, output_format, sibling, spool_path
from bulkinfer.io.records import error_record, output_record
from bulkinfer.prep.rows import parse_row
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, Completion, Request, RowError

# --- paths ----------------------------------------------------------------------------------------


def test_sibling_paths() -> None:
    assert sibling(Path("res/out.jsonl"), ".errors.jsonl") == Path("res/out.errors.jsonl")
    assert sibling(Path("res/out.jsonl"), ".report.json") == Path("res/out.report.json")
    assert sibling(Path("x.parquet"), ".errors.jsonl") == Path("x.errors.jsonl")
    assert sibling(Path("/a/b/run.v2.jsonl"), ".report.json") == Path("/a/b/run.v2.report.json")


def test_default_output() -> None:
    assert default_output(Path("data/prompts.jsonl")) == Path("data/prompts.out.jsonl")
    assert default_output(Path("x.parquet")) == Path("x.out.jsonl")
    assert default_output(Path("d/x.JSONL.gz")) == Path("d/x.out.jsonl")
    assert default_output(Path("x.ndjson.zst")) == Path("x.out.jsonl")


def test_one_suffix_table_for_input_and_output() -> None:
    for name, kind in [("a.jsonl", JSONL), ("a.ndjson", JSONL), ("a.parquet", PARQUET), ("a.pq", PARQUET)]:
        assert output_format(Path(name)) == kind
        assert output_format(Path(name.upper())) == kind
        assert input_format(Path(name)) == kind
    assert input_format(Path("a.ndjson.gz")) == JSONL
    for bad in ("out.csv", "out", "out.jsonl.gz"):
        with pytest.raises(ConfigError, match="unknown format"):
            output_format(Path(bad))
    with pytest.raises(InputFileError, match="unknown input format"):
        input_format(Path("in.csv"))


def test_spool_path_is_hidden_beside_the_output() -> None:
    assert spool_path(Path("res/out.parquet")) == Path("res/.out.parquet.partial.jsonl")


# --- records --------------------------------------------------------------------------------------

DEFAULTS = SamplingDefaults()


def request(data: dict[str, Any]) -> Request:
    return parse_row(data, 0, 1, DEFAULTS)


def test_output_record_bulkinfer_row() -> None:
    req = request({"id": "q1", "prompt": "Hi", "lang": "fr", "meta": {"k": [1]}, "max_tokens": 9})
    done = Completion("0", "Bonjour", "stop", prompt_tokens=3, completion_tokens=2)
    record = output_record(req, done, "my-model")
    assert record == {
        "lang": "fr",
        "meta": {"k": [1]},
        "id": "q1",
        "completion": "Bonjour",
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": 2,
    }


def test_output_record_fields_win_over_passthrough_of_the_same_name() -> None:
    req = request({"id": "q1", "prompt": "Hi", "completion": "reference answer"})
    record = output_record(req, Completion("0", "model answer", "length", 3, 16), "m")
    assert record["completion"] == "model answer"
    assert record["finish_reason"] == "length"


def test_output_record_openai_chat() -> None:
    req = request(
        {
            "custom_id": "req-7",
            "method": "POST",
            "url": CHAT_URL,
            "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "Hi"}]},
        }
    )
    record = output_record(req, Completion("0", "Hello!", "stop", 11, 4), "local-model")
    assert record["custom_id"] == "req-7"
    assert record["id"].startswith("batch_req_")
    assert record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200
    assert isinstance(response["request_id"], str) and response["request_id"]
    body = response["body"]
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "gpt-x"
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}


def test_output_record_openai_completions() -> None:
    req = request({"custom_id": "req-8", "url": COMPLETIONS_URL, "body": {"prompt": "Once"}})
    record = output_record(req, Completion("0", " upon a time", "length", 2, 3), "local-model")
    body = record["response"]["body"]
    assert record["custom_id"] == "req-8"
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "local-model"  # no model in the body: the one that ran
    assert body["choices"] == [{"index": 0, "text": " upon a time", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 5


def test_output_record_openai_ids_are_unique() -> None:
    req = request({"custom_id": "req-8", "url": COMPLETIONS_URL, "body": {"prompt": "Once"}})
    a = output_record(req, Completion("0", "x", "stop", 1, 1), "m")
    b = output_record(req, Completion("0", "x", "stop", 1, 1), "m")
    assert a["id"] != b["id"]
    assert a["response"]["body"]["id"] != b["response"]["body"]["id"]


def test_error_record_bulkinfer_row() -> None:
    record = error_record(RowError(12, "q12", "invalid_field", "field 'top_p': expected ..."))
    assert record == {
        "id": "q12",
        "line": 12,
        "error": {"type": "invalid_field", "message": "field 'top_p': expected ..."},
    }


def test_error_record_openai_line() -> None:
    record = error_record(RowError(3, "req-3", "context_length_exceeded", "too long", openai=True))
    assert record["custom_id"] == "req-3"
    assert record["id"].startswith("batch_req_")
    assert record["line"] == 3
    assert record["response"] is None
    assert record["error"] == {"code": "context_length_exceeded", "message": "too long"}


# --- spool and publish ----------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_appender_and_publish_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "res" / "out.jsonl"
    out.parent.mkdir()
    spool = spool_path(out)
    appender = JsonlAppender(spool)
    records = [{"id": "1", "completion": "é\u2028x"}, {"id": "2", "completion": "", "extra": None}]
    for r in records:
        appender.write(r)
    appender.flush()
    assert appender.count == 2
    assert read_jsonl(spool) == records  # flushed: readable before close
    appender.close()
    appender.close()  # closing twice is harmless
    assert not out.exists()
    publish(spool, out)
    assert read_jsonl(out) == records
    assert not spool.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]


def test_publish_parquet_unifies_schemas_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "PARQUET_CHUNK_ROWS", 3)
    out = tmp_path / "out.parquet"
    spool = spool_path(out)
    records = [
        {"lang": "en", "id": "0", "completion": "a", "prompt_tokens": 1},
        {"id": "1", "completion": "b", "prompt_tokens": 2, "score": 0.5},  # a key only a later row of the chunk has
        {"lang": "fr", "id": "2", "completion": "c", "prompt_tokens": 3},
        {"id": "3", "completion": "d", "prompt_tokens": 4, "tags": ["x", "y"]},  # new column in chunk 2
        {"id": "4", "completion": "e", "prompt_tokens": 5, "score": 2},  # int where chunk 1 had a float
        {"id": "5", "completion": "f", "prompt_tokens": 6, "lang": None},
        {"id": "6", "completion": "g", "prompt_tokens": 7, "meta": {"k": 1}},  # chunk 3, one row
    ]
    appender = JsonlAppender(spool)
    for r in records:
        appender.write(r)
    appender.close()
    publish(spool, out)
    assert not spool.exists()
    assert not (tmp_path / ".out.parquet.tmp").exists()
    table = pq.read_table(out)
    assert table.num_rows == 7
    assert set(table.column_names) == {"lang", "id", "completion", "prompt_tokens", "score", "tags", "meta"}
    assert table.schema.field("score").type == pa.float64()
    assert table.schema.field("prompt_tokens").type == pa.int64()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [str(i) for i in range(7)]
    assert [r["lang"] for r in rows] == ["en", None, "fr", None, None, None, None]
    assert [r["score"] for r in rows] == [None, 0.5, None, None, 2.0, None, None]
    assert rows[3]["tags"] == ["x", "y"]
    assert rows[6]["meta"] == {"k": 1}
    assert [r["completion"] for r in rows] == list("abcdefg")


def test_jsonl_chunks_follow_the_chunk_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "spool.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"i": i}) + b"\n" for i in range(7)) + b"\n")
    monkeypatch.setattr(writers, "PARQUET_CHUNK_ROWS", 3)
    assert [[r["i"] for r in c] for c in writers.iter_jsonl_chunks(path)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(c) for c in writers.iter_jsonl_chunks(path, rows=5)] == [5, 2]


def test_publish_parquet_of_no_rows(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    spool = spool_path(out)
    JsonlAppender(spool).close()
    publish(spool, out)
    assert not spool.exists()
    assert pq.read_table(out).num_rows == 0


def test_publish_replaces_an_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    spool = spool_path(out)
    appender = JsonlAppender(spool)
    appender.write({"id": "new"})
    appender.close()
    publish(spool, out)
    assert read_jsonl(out) == [{"id": "new"}]


def test_parquet_column_with_mixed_types_becomes_json_text(tmp_path: Path) -> None:
    spool = tmp_path / "spool.jsonl"
    spool.write_bytes(b'{"id": "a", "label": 1}\n{"id": "b", "label": "x"}\n{"id": "c", "label": null}\n')
    out = tmp_path / "out.parquet"
    writers.publish(spool, out)
    rows = pq.read_table(out).to_pylist()
    assert [r["label"] for r in rows] == ["1", '"x"', None]


@pytest.mark.parametrize("url", [CHAT_URL, COMPLETIONS_URL])
def test_openai_output_lines_are_valid_vllm_batch_outputs_and_openai_bodies(url: str) -> None:
    """Checked against the reference types: vLLM's ``BatchRequestOutput`` for
    the line, vLLM's response model and the ``openai`` SDK's ``ChatCompletion``
    / ``Completion`` for its body. (vLLM 0.32's batch runner has no
    ``/v1/completions``: its ``BatchRequestOutput`` body union lacks
    ``CompletionResponse``, so that line's envelope is checked with the body
    apart.)"""
    chat = url == CHAT_URL
    body = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Once"}
    req = request({"custom_id": "req-1", "method": "POST", "url": url, "body": body})
    record = output_record(req, Completion("0", "Hello!", "length", 11, 4), "local-model")
    out_body = record["response"]["body"]
    envelope = record if chat else {**record, "response": {**record["response"], "body": None}}
    parsed = BatchRequestOutput.model_validate(envelope)
    assert (parsed.custom_id, parsed.error, parsed.response.status_code) == ("req-1", None, 200)
    (ChatCompletionResponse if chat else CompletionResponse).model_validate(out_body)
    typed = (ChatCompletion if chat else OpenAICompletion).model_validate(out_body)
    choice = typed.choices[0]
    text = choice.message.content if chat else choice.text  # type: ignore[union-attr]
    assert (text, choice.finish_reason, typed.usage.total_tokens) == ("Hello!", "length", 15)  # type: ignore[union-attr]


def test_parquet_pass_through_values_json_lacks_are_written_as_stated(tmp_path: Path) -> None:
    """A Parquet input's pass-through columns of types JSON has not reach
    the output as the README says: timestamps and dates as RFC 3339 text,
    decimals as their digits, binary as base64 (not Python's ``b'...'``),
    NaN and infinities as null; the types JSON has are kept."""
    import base64
    import datetime
    import decimal

    from fakes import FakeEngine

    from bulkinfer.config import load_settings
    from bulkinfer.io.output_files import RunPaths
    from bulkinfer.jobs.context import RunContext
    from bulkinfer.jobs.run import run

    table = pa.table(
        {
            "prompt": ["a", "b"],
            "ts": pa.array([datetime.datetime(2026, 12, 7, 9, 30), None], pa.timestamp("ms")),
            "day": pa.array([datetime.date(2026, 12, 7), None], pa.date32()),
            "dec": pa.array([decimal.Decimal("1.25"), None], pa.decimal128(5, 2)),
            "bin": pa.array([b"\x00\xff", None], pa.binary()),
            "f": pa.array([float("nan"), float("inf")], pa.float64()),
            "tags": [["x", "y"], []],
        }
    )
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    for out in (tmp_path / "out.jsonl", tmp_path / "p" / "out.parquet"):
        run(RunPaths.build(src, out), load_settings(), RunContext(engine_factory=lambda m, s: FakeEngine()))
    rows = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda r: r["id"])
    kept = [{k: r[k] for k in ("ts", "day", "dec", "bin", "f", "tags")} for r in rows]
    assert kept == [
        {"ts": "2026-12-07T09:30:00", "day": "2026-12-07", "dec": "1.25", "bin": "AP8=", "f": None, "tags": ["x", "y"]},
        {"ts": None, "day": None, "dec": None, "bin": None, "f": None, "tags": []},
    ]
    assert base64.b64decode(kept[0]["bin"]) == b"\x00\xff"
    parquet = sorted(pq.read_table(tmp_path / "p" / "out.parquet").to_pylist(), key=lambda r: r["id"])
    assert [{k: r[k] for k in kept[0]} for r in parquet] == kept
