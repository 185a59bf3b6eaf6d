"""Output lines checked against the reference implementations: vLLM's
``BatchRequestOutput`` for the line, the ``openai`` SDK's ``ChatCompletion``
/ ``Completion`` for its body. (vLLM 0.32's batch runner has no
``/v1/completions``: its ``BatchRequestOutput`` body union lacks
``CompletionResponse``, so such a line's envelope is checked with the body
apart.)"""

from __future__ import annotations

from typing import Any

from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse, ChatCompletionStreamResponse
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse
from vllm.entrypoints.pooling.embed.protocol import EmbeddingResponse
from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse


def check_openai_line(record: dict[str, Any]) -> Any:
    """Validate one output or error line of an OpenAI batch; the parsed
    ``BatchRequestOutput``. Raises pydantic's ValidationError on a bad line."""
    response = record.get("response")
    if response is not None and response["body"]["object"] == "text_completion":
        Completion.model_validate(response["body"])
        record = {**record, "response": {**response, "body": None}}  # not in vLLM 0.32's union
    elif response is not None:
        ChatCompletion.model_validate(response["body"])
    return BatchRequestOutput.model_validate(record)


def check_embeddings_line(record: dict[str, Any]) -> Any:
    """Validate one output or error line of an OpenAI ``/v1/embeddings``
    batch: the line against vLLM's ``BatchRequestOutput`` (whose body union
    holds vLLM's ``EmbeddingResponse``), its body against the ``openai``
    SDK's ``CreateEmbeddingResponse`` (a base64 embedding decoded first, as
    the SDK's client does). Returns the parsed line; raises
    pydantic's ValidationError on a bad one."""
    parsed = BatchRequestOutput.model_validate(record)
    response = record.get("response")
    if response is not None:
        # The SDK's model holds floats: its client decodes a base64 embedding
        # (little-endian float32) before building it, and so does this check.
        body = response["body"]
        data = [
            {**d, "embedding": decode_base64(d["embedding"])} if isinstance(d["embedding"], str) else d
            for d in body["data"]
        ]
        CreateEmbeddingResponse.model_validate({**body, "data": data})
        assert isinstance(parsed.response.body, EmbeddingResponse), type(parsed.response.body)
    return parsed


def check_scoring_line(record: dict[str, Any]) -> Any:
    """Validate one output or error line of an OpenAI-style ``/v1/score`` or
    ``/v1/rerank`` batch against vLLM's ``BatchRequestOutput`` and its body
    against vLLM's ``ScoreResponse`` / ``RerankResponse`` (by the body's
    ``object``: ScoreResponse's is ``list``), with no field those types do
    not declare (vLLM's models accept and drop extra fields, so a misnamed
    one would pass validation alone). Returns the parsed body (None for an
    error line); raises pydantic's ValidationError or AssertionError."""
    BatchRequestOutput.model_validate(record)
    response = record.get("response")
    if response is None:
        return None
    body = response["body"]
    parsed = (ScoreResponse if body.get("object") == "list" else RerankResponse).model_validate(body)
    _no_extra(parsed)
    return parsed


def _no_extra(model: Any) -> None:
    """No pydantic model in ``model`` (recursively) holds an undeclared field."""
    assert not (getattr(model, "model_extra", None) or {}), (type(model).__name__, model.model_extra)
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if hasattr(type(item), "model_fields"):
                _no_extra(item)


def decode_base64(text: str) -> list[float]:
    """An OpenAI ``encoding_format: base64`` embedding: little-endian float32 values."""
    import base64

    import numpy as np

    return [float(x) for x in np.frombuffer(base64.b64decode(text), dtype="<f4")]


def check_online_response(body: dict[str, Any]) -> Any:
    """Validate an online answer (``chat.completion`` or ``text_completion``)
    against the SDK's type and vLLM's server's response type; the SDK object."""
    if body["object"] == "chat.completion":
        ChatCompletionResponse.model_validate(body)
        return ChatCompletion.model_validate(body)
    CompletionResponse.model_validate(body)
    return Completion.model_validate(body)


def check_online_chunk(chunk: dict[str, Any]) -> Any:
    """Validate one streamed chunk against vLLM's server's stream response
    type, and a chat chunk against the SDK's ``ChatCompletionChunk``; the
    parsed object. (The SDK streams completions as its ``Completion`` built
    without validation: that type's ``finish_reason`` cannot be the null of
    every chunk but the last, which OpenAI and vLLM send.)"""
    if chunk["object"] == "chat.completion.chunk":
        ChatCompletionStreamResponse.model_validate(chunk)
        return ChatCompletionChunk.model_validate(chunk)
    return CompletionStreamResponse.model_validate(chunk)
