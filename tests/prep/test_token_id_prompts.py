"""A prompt given as token ids (OpenAI's /v1/completions and vLLM's other
form of a prompt) reaches the engine as it is: no chat template, no special
tokens, the context checked; from JSONL rows, OpenAI lines and a Parquet
list column. The engine is a fake; tests/e2e/test_e2e.py runs the real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run


def _run(src: Path, tmp_path: Path) -> tuple[FakeEngine, dict[str, Any], dict[str, Any]]:
    engines: list[FakeEngine] = []

    def factory(model: str, settings: Any) -> FakeEngine:
        engines.append(FakeEngine())
        return engines[0]

    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    run(paths, load_settings(), RunContext(engine_factory=factory))
    outputs = {
        r["custom_id"] if "custom_id" in r else r["id"]: r
        for r in map(orjson.loads, paths.output.read_bytes().splitlines())
    }
    errors = {r["id"]: r["error"] for r in map(orjson.loads, paths.errors.read_bytes().splitlines())}
    return engines[0], outputs, errors


def test_token_ids_reach_the_engine_as_they_are(tmp_path: Path) -> None:
    long = list(range(5, 5 + FakeEngine.max_model_len))  # with max_tokens, past the context
    rows = [
        {"id": "ids", "prompt": [11, 12, 13], "note": "kept"},
        {"id": "text", "prompt": "hello there"},  # the chat template applies to text (the default: auto)
        {"id": "one-list", "prompt": [[21, 22]]},
        {"custom_id": "line", "url": "/v1/completions", "body": {"model": "m", "prompt": [31, 32], "max_tokens": 3}},
        {"id": "long", "prompt": long},
        {"id": "templated", "prompt": [1, 2], "chat_template_kwargs": {"enable_thinking": False}},
        {"id": "two", "prompt": [[1], [2]]},
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    engine, outputs, errors = _run(src, tmp_path)
    assert (
        engine.reached["ids"] == [11, 12, 13]
        and engine.reached["one-list"] == [21, 22]
        and engine.reached["line"] == [31, 32]
    )
    assert len(engine.reached["text"]) > 2  # rendered through the tiny model's template, then tokenized
    assert outputs["ids"]["prompt_tokens"] == 3 and outputs["ids"]["note"] == "kept"
    assert outputs["line"]["response"]["body"]["usage"]["prompt_tokens"] == 2
    assert (
        errors["long"]["type"] == "context_length_exceeded"
        and f"prompt is {len(long)} tokens" in errors["long"]["message"]
    )
    assert errors["templated"]["type"] == "invalid_field" and "chat_template_kwargs" in errors["templated"]["message"]
    assert "a list of 2 prompts" in errors["two"]["message"]
    assert set(outputs) | set(errors) == {r.get("id", r.get("custom_id")) for r in rows}


def test_a_parquet_prompt_column_of_token_ids(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    table = pa.table({"id": ["a", "b"], "prompt": pa.array([[3, 4, 5], [6]], type=pa.list_(pa.int32()))})
    pq.write_table(table, src)
    engine, outputs, errors = _run(src, tmp_path)
    assert engine.reached == {"a": [3, 4, 5], "b": [6]} and not errors
    assert [outputs[k]["prompt_tokens"] for k in ("a", "b")] == [3, 1]
