"""A row naming a request parameter bulkinfer does not apply is an error
record, never a pass-through field (:mod:`bulkinfer.prep.unapplied`): every
parameter of OpenAI's and vLLM's own request types is read, harmless or
refused, checked against those types (the ``openai`` SDK's
``CompletionCreateParams``, ``EmbeddingCreateParams``; vLLM's OpenAI server
protocol models and ``SamplingParams``), so a name a new release adds shows
up here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.pooling.embed.protocol import EmbeddingChatRequest, EmbeddingCompletionRequest
from vllm.entrypoints.pooling.scoring.protocol import (
    RerankRequest,
    ScoreDataRequest,
    ScoreQueriesDocumentsRequest,
    ScoreQueriesItemsRequest,
    ScoreTextRequest,
)

import bulkinfer.jobs.run
from bulkinfer.config import SamplingDefaults, load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.prep.embeddings import EMBED_FIELDS_READ, parse_embed_row
from bulkinfer.prep.rows import ROW_FIELDS_READ, parse_row
from bulkinfer.prep.scores import SCORE_FIELDS_READ, parse_score_row
from bulkinfer.prep.unapplied import HARMLESS
from bulkinfer.schema import RowInvalid


def typed_dict_keys(cls: type) -> set[str]:
    """Every key of an ``openai`` SDK TypedDict, its bases' included."""
    return {key for base in cls.__mro__ for key in getattr(base, "__annotations__", {})}


GENERATION_NAMES = (
    typed_dict_keys(chat_create_params.CompletionCreateParamsBase)
    | typed_dict_keys(completion_create_params.CompletionCreateParamsBase)
    | set(ChatCompletionRequest.model_fields)
    | set(CompletionRequest.model_fields)
    | {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
)
EMBEDDING_NAMES = (
    typed_dict_keys(embedding_create_params.EmbeddingCreateParams)
    | set(EmbeddingCompletionRequest.model_fields)
    | set(EmbeddingChatRequest.model_fields)
)
SCORING_NAMES = {
    name
    for request in (
        RerankRequest,
        ScoreDataRequest,
        ScoreQueriesDocumentsRequest,
        ScoreQueriesItemsRequest,
        ScoreTextRequest,
    )
    for name in request.model_fields
}


@pytest.mark.parametrize(
    ("names", "read"),
    [(GENERATION_NAMES, ROW_FIELDS_READ), (EMBEDDING_NAMES, EMBED_FIELDS_READ), (SCORING_NAMES, SCORE_FIELDS_READ)],
    ids=["run", "embed", "score"],
)
def test_every_request_parameter_of_openai_and_vllm_is_read_harmless_or_refused(
    names: set[str], read: frozenset[str]
) -> None:
    assert len(names) > 20  # the reference types were read
    assert names - read - HARMLESS == set()


def test_a_run_row_naming_a_parameter_bulkinfer_does_not_apply_is_refused_with_the_field_to_use() -> None:
    def refused(row: dict[str, Any]) -> str:
        with pytest.raises(RowInvalid) as info:
            parse_row({"id": "r", "prompt": "hi", **row}, 0, 1, SamplingDefaults())
        assert info.value.type == "unsupported_field" and info.value.row_id == "r" and not info.value.openai
        return info.value.message

    assert "'max_new_tokens'" in (said := refused({"max_new_tokens": 64})) and "use max_tokens" in said
    assert "rename it" in said and "the row was not run" in said
    assert "use n" in refused({"num_return_sequences": 2})
    assert "response_format or structured_outputs" in refused({"guided_json": {"type": "object"}})
    assert "'tools'" in refused({"tools": [{"type": "function", "function": {"name": "f"}}]})
    assert "'echo'" in refused({"echo": True})
    assert "'stream'" in refused({"stream": True})
    # what does not change the output passes through: stream false, a predicted output, data
    kept = parse_row({"prompt": "hi", "stream": False, "prediction": "x", "category": 3}, 0, 1, SamplingDefaults())
    assert kept.passthrough == {"stream": False, "prediction": "x", "category": 3}


def test_an_openai_body_reads_null_as_not_given_and_names_the_endpoint_a_field_belongs_to() -> None:
    """A body dumped with its unset fields (``model_dump()``: ``tools: null``)
    asks for nothing; nor does ``echo: false`` or ``tool_choice: "none"``; a
    field of the other endpoint is named as such, not as unimplemented."""
    chat = {"custom_id": "c", "url": "/v1/chat/completions"}
    messages = [{"role": "user", "content": "hi"}]
    nulls = dict.fromkeys(("tools", "tool_choice", "functions", "suffix", "stream_options", "reasoning_effort"))
    kept = parse_row({**chat, "body": {"messages": messages, **nulls, "stream": None}}, 0, 1, SamplingDefaults())
    assert kept.messages == messages
    text = {"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "hi", "echo": False}}
    assert parse_row(text, 0, 1, SamplingDefaults()).prompt == "hi"
    assert parse_row({**chat, "body": {"messages": messages, "tool_choice": "none"}}, 0, 1, SamplingDefaults())

    def refused(line: dict[str, Any]) -> str:
        with pytest.raises(RowInvalid) as info:
            parse_row(line, 0, 1, SamplingDefaults())
        assert info.value.type == "unsupported_field" and info.value.openai
        return info.value.message

    assert "'body.tools' is not supported" in refused({**chat, "body": {"messages": messages, "tools": []}})
    assert "'body.echo'" in refused({**text, "body": {"prompt": "hi", "echo": True}})
    said = refused({**chat, "body": {"prompt": "hi"}})
    assert "'body.prompt' is not supported: it is read in /v1/completions lines" in said
    said = refused({**text, "body": {"prompt": "hi", "max_completion_tokens": 4}})
    assert "read in /v1/chat/completions lines, and this line's url is /v1/completions" in said


def test_embed_and_score_rows_refuse_the_parameters_of_their_jobs() -> None:
    with pytest.raises(RowInvalid) as info:
        parse_embed_row({"id": "e", "text": "hello", "dimensions": 8}, 0, 1)
    assert info.value.type == "unsupported_field" and "'dimensions'" in info.value.message and info.value.row_id == "e"
    assert parse_embed_row({"text": "hello", "source": "web"}, 0, 1).passthrough == {"source": "web"}
    assert parse_embed_row({"text": "hello", "encoding_format": "float"}, 0, 1).inputs == ["hello"]  # as embed does
    with pytest.raises(RowInvalid, match="'encoding_format'"):
        parse_embed_row({"text": "hello", "encoding_format": "base64"}, 0, 1)
    with pytest.raises(RowInvalid) as info:
        parse_score_row({"id": "s", "text_1": "a", "text_2": "b", "queries": ["q"]}, 0, 1)
    assert info.value.type == "unsupported_field" and "text_1 and text_2" in info.value.message
    # a rerank row's documents are read: not vLLM's chat-template documents
    assert parse_score_row({"query": "q", "documents": ["d"]}, 0, 1).inputs == ["q", "d"]


@pytest.mark.parametrize("passthrough", [True, False])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_every_row_ends_once_and_a_refused_parameter_is_read_from_parquet_without_passthrough(
    tmp_path: Path, suffix: str, passthrough: bool
) -> None:
    rows = [
        {"id": "a", "prompt": "one", "tools": None, "reference": "r"},
        {"id": "b", "prompt": "two", "tools": "[]", "reference": "r"},
        {"id": "c", "prompt": "three", "tools": None, "reference": "r"},
    ]
    src = tmp_path / f"in{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), src)
    else:
        src.write_bytes(b"".join(orjson.dumps({k: v for k, v in row.items() if v is not None}) + b"\n" for row in rows))
    out = tmp_path / "out.jsonl"
    settings = load_settings(None, {"passthrough": passthrough})
    bulkinfer.jobs.run.run(RunPaths.build(src, out), settings, RunContext(engine_factory=lambda model, s: FakeEngine()))
    outputs = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    errors = [orjson.loads(line) for line in out.with_name("out.errors.jsonl").read_bytes().splitlines()]
    assert sorted(record["id"] for record in outputs) == ["a", "c"]
    assert [(error["id"], error["error"]["type"]) for error in errors] == [("b", "unsupported_field")]
    assert "'tools'" in errors[0]["error"]["message"]
    assert all(("reference" in record) == passthrough for record in outputs)
