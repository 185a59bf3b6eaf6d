"""An embedding model's server (issue 35), on a fake encoder engine: online
``/v1/embeddings`` read with the ``openai`` SDK, embedding batches, and the
endpoints each kind of model refuses. Real vectors: tests/e2e/test_serve_embed_e2e.py."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest
from fakes import FakeEncoder
from reference_types import check_embeddings_line
from serving import Server, create, records, upload, wait_done

from bulkinfer.default_model import DEFAULT_ENCODER

EMBED = "/v1/embeddings"


def encoder_server(serve: Callable[..., Server]) -> Server:
    return serve(engine=FakeEncoder, model=DEFAULT_ENCODER)


def test_online_embeddings_read_with_the_sdk(serve: Callable[..., Server]) -> None:
    """The SDK asks for base64 by default and decodes it; the fake encoder's
    vector of an input is [its tokens, its index, 1.0]."""
    client = encoder_server(serve).client()
    answer = client.embeddings.create(model="minilm", input=["hello world", "the cat sat"])
    assert isinstance(answer, openai.types.CreateEmbeddingResponse)
    assert answer.model == "minilm" and answer.object == "list"
    vectors = [d.embedding for d in answer.data]
    assert [d.index for d in answer.data] == [0, 1]
    assert [v[1:] for v in vectors] == [[0.0, 1.0], [1.0, 1.0]]
    assert vectors[0][0] == 4.0 and vectors[1][0] == 5.0  # [CLS] hello world [SEP]; [CLS] the cat sat [SEP]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == 9
    floats = client.embeddings.create(model="minilm", input="hello world", encoding_format="float")
    assert floats.data[0].embedding == [4.0, 0.0, 1.0]


def test_bad_bodies_and_long_inputs_are_400s_naming_the_field(serve: Callable[..., Server]) -> None:
    client = encoder_server(serve).client()
    with pytest.raises(openai.BadRequestError, match="'input'"):
        client.embeddings.create(model="m", input=[])
    with pytest.raises(openai.BadRequestError, match="'user_tag' is not supported"):
        client.embeddings.create(model="m", input="hi", extra_body={"user_tag": "x"})
    with pytest.raises(openai.BadRequestError, match="256") as long:
        client.embeddings.create(model="m", input="word " * 300, encoding_format="float")
    assert long.value.code == "context_length_exceeded" and "the server does not cut inputs" in long.value.message


def test_an_embedding_model_refuses_chat(serve: Callable[..., Server]) -> None:
    encoder = encoder_server(serve).client()
    with pytest.raises(openai.BadRequestError, match="needs a generative model") as chat:
        encoder.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of /v1/embeddings"):
        create(encoder, upload(encoder, b'{"custom_id": "a"}\n').id)


def test_a_generative_model_refuses_embeddings(serve: Callable[..., Server]) -> None:
    generative = serve().client()
    with pytest.raises(openai.BadRequestError, match="needs an embedding model"):
        generative.embeddings.create(model="m", input="hi")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of /v1/chat/completions"):
        create(generative, upload(generative, b'{"custom_id": "a"}\n').id, EMBED)


def test_an_embeddings_batch_completes_with_vllms_records(serve: Callable[..., Server]) -> None:
    client = encoder_server(serve).client()
    lines = [
        b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello world"}}',
        b'{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["the", "cat"]}}',
        b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}}',
    ]
    batch = wait_done(client, create(client, upload(client, b"\n".join(lines) + b"\n").id, EMBED).id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None and (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    out = records(client, batch.output_file_id)
    for line in out:
        check_embeddings_line(line)
    bodies = {line["custom_id"]: line["response"]["body"] for line in out}
    assert [d["embedding"] for d in bodies["b"]["data"]] == [[3.0, 0.0, 1.0], [3.0, 1.0, 1.0]]
    assert bodies["a"]["usage"]["prompt_tokens"] == 4
    errors = records(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["c"] and "'body.input'" in errors[0]["error"]["message"]
    check_embeddings_line(errors[0])
    assert batch.usage is not None and batch.usage.input_tokens == 10 and batch.usage.output_tokens == 0
