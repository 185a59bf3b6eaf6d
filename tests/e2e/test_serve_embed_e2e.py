"""End to end (issue 35): ``bulkinfer serve --model all-minilm-l6-v2``, a
real server on the embedded encoder (vLLM's pooling runner): online
``/v1/embeddings`` through the ``openai`` client and a ``/v1/embeddings``
batch give sentence-transformers' vectors; chat is refused. One engine start."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest
from e2e_helpers import SAMPLE, read_jsonl
from reference_types import check_embeddings_line, decode_base64
from test_serve_e2e import CONFIG, IN_PROCESS, ServeProcess, finished, free_port, lines_of, submit

from bulkinfer.default_model import DEFAULT_ENCODER, prepare_default_encoder

pytestmark = pytest.mark.e2e

# ShareGPT prompts short enough for the encoder's 256 tokens (a longer one is a 400, as OpenAI's).
TEXTS = [r["prompt"] for r in read_jsonl(SAMPLE / "sharegpt.jsonl") if len(r["prompt"]) <= 600][:24]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("serve-embed")
    config = tmp / "serve.toml"
    config.write_text(CONFIG)
    process = ServeProcess(
        tmp / "data", free_port(), "--model", DEFAULT_ENCODER, "--config", str(config), env=IN_PROCESS
    )
    yield process
    process.stop()


def sentence_transformers(texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(prepare_default_encoder()), device="cpu")
    return np.asarray(model.encode(texts, convert_to_numpy=True), dtype=np.float32)


def test_online_and_batch_embeddings_are_sentence_transformers_vectors(server: ServeProcess) -> None:
    client = server.client()
    online = client.embeddings.create(model="minilm", input=TEXTS[:8])  # the SDK asks for base64 and decodes it
    lines = [
        {"custom_id": f"t{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text, "model": "minilm"}}
        for i, text in enumerate(TEXTS)
    ]
    lines.append({"custom_id": "long", "method": "POST", "url": "/v1/embeddings", "body": {"input": "word " * 300}})
    batch = finished(client, submit(client, lines, "/v1/embeddings").id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and (batch.request_counts.completed, batch.request_counts.failed) == (
        len(TEXTS),
        1,
    )
    out = lines_of(client, batch.output_file_id)
    for line in out:
        check_embeddings_line(line)
    by_id = {line["custom_id"]: line["response"]["body"]["data"][0]["embedding"] for line in out}
    batch_vectors = np.array([by_id[f"t{i}"] for i in range(len(TEXTS))], dtype=np.float32)
    online_vectors = np.array([d.embedding for d in online.data], dtype=np.float32)
    reference = sentence_transformers(TEXTS)
    for ours, theirs in ((batch_vectors, reference), (online_vectors, reference[:8])):
        cosine = (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
        assert cosine.min() >= 0.9999, cosine
    assert np.abs(online_vectors - batch_vectors[:8]).max() < 1e-5  # one engine, the same vectors either way
    errors = lines_of(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["long"] and errors[0]["error"]["code"] == "context_length_exceeded"
    base64 = client.embeddings.with_raw_response.create(model="m", input=TEXTS[0], encoding_format="base64")
    raw = base64.http_response.json()["data"][0]["embedding"]
    assert np.allclose(decode_base64(raw), batch_vectors[0], atol=1e-6)
    # OpenAI's token-array form: the encoder's own ids of two texts give those texts' vectors
    from bulkinfer.models import load_tokenizer

    ids = load_tokenizer(str(prepare_default_encoder()))(TEXTS[:2])["input_ids"]
    tokens = client.embeddings.create(model="minilm", input=[list(one) for one in ids])
    assert tokens.usage.prompt_tokens == sum(len(one) for one in ids)
    assert np.abs(np.array([d.embedding for d in tokens.data]) - online_vectors[:2]).max() < 1e-5


def test_chat_on_an_embedding_server_is_a_400(server: ServeProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="needs a generative model"):
        server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
