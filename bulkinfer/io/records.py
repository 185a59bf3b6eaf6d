"""Each record format, written and read back in one place.

- bulkinfer rows: ``id``, ``completion``, ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens`` and the row's pass-through fields;
- OpenAI batch lines (https://platform.openai.com/docs/api-reference/batch/request-output,
  checked against vLLM's ``BatchRequestOutput`` in the tests): ``id``,
  ``custom_id``, ``response`` {``status_code``, ``request_id``, ``body`` (a
  ``chat.completion``, ``text_completion`` or an embedding ``list``)}, ``error``;
- embedding rows (``bulkinfer embed``): ``id``, ``embedding`` (a list of
  float32 values; in Parquet a ``fixed_size_list<float32>[dim]`` column),
  ``prompt_tokens`` and the pass-through fields;
- score rows (``bulkinfer score``): ``id``, ``score`` (a pair row) or
  ``results`` (a rerank row: ``[{index, relevance_score}]``, best first;
  in Parquet ``double`` and ``list<struct<index: int64, relevance_score:
  double>>``), ``prompt_tokens`` and the pass-through fields;
- errors (``OUT.errors.jsonl``): ``id``, ``line``, ``error`` {``type``,
  ``message``}; OpenAI lines: ``custom_id``, ``response: null``, ``error``
  {``code``, ``message``} and ``line``.

:func:`parse_output` reads back what :func:`output_record` writes (resume and
eval go through it), :func:`error_line` what :func:`error_record` writes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from bulkinfer.errors import InputFileError, read_whole
from bulkinfer.io.files import iter_jsonl_chunks
from bulkinfer.io.formats import PARQUET, output_format
from bulkinfer.schema import CHAT_URL, Choice, Completion, Request, RowError


def output_record(request: Request, completion: Completion, model: str) -> dict[str, Any]:
    """The output row for a completed request, in the row's own format.

    bulkinfer rows: ``completion`` and ``finish_reason`` are the first
    choice's, ``completion_tokens`` counts all choices; with ``n`` > 1,
    ``completions`` lists every choice (``index``, ``completion``,
    ``finish_reason``, ``completion_tokens``, and ``logprobs`` when asked
    for); with log-probabilities, ``logprobs`` holds the first choice's
    (OpenAI chat's ``logprobs.content`` entries, see
    :class:`~bulkinfer.schema.Choice`).

    OpenAI lines: ``choices[i]`` with ``index``; ``logprobs`` in the
    endpoint's shape (chat: ``{"content": [...]}``; completions: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (token -> logprob), ``text_offset``
    (characters into the completion)) or null; ``usage.completion_tokens``
    sums all choices.
    """
    if completion.embeddings is not None:
        if request.similarity is not None:
            return score_record(request, completion, model)
        return embedding_record(request, completion, model)
    choices = completion.choices or (
        Choice(0, completion.text, completion.finish_reason, completion.completion_tokens),
    )
    if request.openai_url is None:
        row = {
            **request.passthrough,
            "id": request.id,
            "completion": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
        }
        if choices[0].logprobs is not None:
            row["logprobs"] = choices[0].logprobs
        if len(choices) > 1:
            row["completions"] = [_row_choice(c) for c in choices]
        return row
    usage = {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }
    chat = request.openai_url == CHAT_URL
    if chat:
        body_id, obj = f"chatcmpl-{uuid.uuid4().hex}", "chat.completion"
    else:
        body_id, obj = f"cmpl-{uuid.uuid4().hex}", "text_completion"
    body = {
        "id": body_id,
        "object": obj,
        "created": int(time.time()),
        "model": request.passthrough.get("model", model),
        "choices": [_openai_choice(c, chat) for c in choices],
        "usage": usage,
    }
    return _batch_output(request.id, body)


def _batch_output(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``BatchRequestOutput`` line around a response ``body``."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def embedding_record(request: Request, completion: Completion, model: str) -> dict[str, Any]:
    """The output row of an embedding request, in the row's own format.

    bulkinfer rows: the pass-through fields, ``id``, ``embedding`` (the
    vector: float32 values, as JSON numbers) and ``prompt_tokens`` (the
    text's tokens, special tokens included). OpenAI lines: vLLM's
    ``BatchRequestOutput`` around OpenAI's embedding response (``object:
    list``, ``data[{object: embedding, index, embedding}]`` one per input,
    ``model``, ``usage``); with ``encoding_format: base64`` each
    ``embedding`` is the base64 of its little-endian float32 bytes.
    """
    vectors = completion.embeddings or ()
    if request.openai_url is None:
        return {
            **request.passthrough,
            "id": request.id,
            "embedding": vectors[0],
            "prompt_tokens": completion.prompt_tokens,
        }
    base64 = request.pooling.get("encoding_format") == "base64"
    body = {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": request.passthrough.get("model", model),
        "data": [
            {"object": "embedding", "index": index, "embedding": float32_base64(vector) if base64 else vector}
            for index, vector in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": completion.prompt_tokens, "total_tokens": completion.prompt_tokens},
    }
    return _batch_output(request.id, body)


def score_record(request: Request, completion: Completion, model: str) -> dict[str, Any]:
    """The output row of a scoring request (``request.similarity`` set; see
    :mod:`bulkinfer.prep.scores`), from its engine outputs in input order:
    a bi-encoder's embeddings (one per text), or a cross-encoder's one-value
    output per pair (``similarity["method"]`` ``"cross-encoder"``: the score
    itself). :func:`pair_scores` gives each pair's score.

    bulkinfer pair rows: the pass-through fields, ``id``, ``score`` and
    ``prompt_tokens`` (the tokens of every input sent, special tokens
    included). bulkinfer rerank rows: ``results`` in place of ``score``:
    one ``{"index", "relevance_score"}`` per document (``index`` its 0-based
    position in ``documents``) sorted by ``relevance_score`` descending,
    ties kept in document order (a stable sort), cut to ``top_n`` when
    given, each with ``document: {"text"}`` for ``return_documents`` (vLLM's
    and Cohere's ``/rerank`` ``results``).

    OpenAI-style lines: vLLM's ``BatchRequestOutput`` around vLLM's
    ``ScoreResponse`` (``/v1/score``: ``data[{index, object: score,
    score}]`` one per pair, ``usage``) or ``RerankResponse`` (``/v1/rerank``:
    ``results[{index, document: {text, multi_modal: null}, relevance_score}]``
    ranked and cut to ``top_n``, ``usage``), as
    ``vllm.entrypoints.pooling.scoring.serving`` builds them; ``model`` the
    line's or the job's.
    """
    similarity = request.similarity or {}
    scores = pair_scores(similarity, completion.embeddings or ())
    tokens = completion.prompt_tokens
    if request.openai_url is None:
        # an input's score or results is replaced, in either shape (prep.scores's OUTPUT_FIELDS say so)
        row: dict[str, Any] = {k: v for k, v in request.passthrough.items() if k not in ("score", "results")}
        row["id"] = request.id
        if similarity["shape"] == "pair":
            row["score"] = scores[0]
        else:
            documents = similarity.get("documents")
            row["results"] = [
                {
                    "index": k,
                    "relevance_score": scores[k],
                    **({"document": {"text": documents[k]}} if documents else {}),
                }
                for k in ranked(scores, similarity.get("top_n"))
            ]
        row["prompt_tokens"] = tokens
        return row
    name = request.passthrough.get("model", model)
    if similarity["shape"] == "score":
        body = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": name,
            "data": [{"index": k, "object": "score", "score": value} for k, value in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
        return _batch_output(request.id, body)
    documents = similarity["documents"]
    body = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [
            {"index": k, "document": {"text": documents[k], "multi_modal": None}, "relevance_score": scores[k]}
            for k in ranked(scores, similarity.get("top_n"))
        ],
    }
    return _batch_output(request.id, body)


def pair_scores(similarity: dict[str, Any], outputs: Sequence[list[float]]) -> list[float]:
    """Each pair's score, in ``similarity["pairs"]`` order: a cross-encoder's
    outputs (one ``[score]`` per pair) as they are, or the cosine
    (:func:`cosines`) of the two embeddings a pair's ``(i, j)`` points to."""
    if similarity.get("method") == "cross-encoder":
        return [float(output[0]) for output in outputs]
    pairs = similarity["pairs"]
    first = {i for i, _ in pairs}
    if len(first) == 1:  # one query (a pair, a rerank, a 1:N score): one matrix product
        return cosines(outputs[pairs[0][0]], [outputs[j] for _, j in pairs])
    return [cosines(outputs[i], [outputs[j]])[0] for i, j in pairs]


def ranked(scores: Sequence[float], top_n: int | None) -> list[int]:
    """The positions of ``scores`` best first, ties in position order (a
    stable sort), the first ``top_n`` of them (all for None)."""
    order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
    return order[: top_n or len(order)]


def cosines(query: list[float], others: Sequence[list[float]]) -> list[float]:
    """The cosine similarity of ``query`` with each of ``others`` (vectors of
    one length, float32 values as an encoder returns them), computed in
    float64: dot(a, b) / (|a| |b|), whether or not the vectors are
    normalized; clipped to [-1, 1] against rounding; 0.0 against an all-zero
    vector. As sentence-transformers' ``util.cos_sim`` (each vector divided
    by its L2 norm, then the dot product) and vLLM's score for embedding
    models (``torch.nn.functional.cosine_similarity``)."""
    import numpy as np

    a = np.asarray(query, dtype=np.float64)
    b = np.asarray(others, dtype=np.float64).reshape(len(others), a.shape[0])
    norms = np.linalg.norm(b, axis=1) * np.linalg.norm(a)
    dots = b @ a
    scores = np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
    return [float(x) for x in np.clip(scores, -1.0, 1.0)]


def float32_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: the vector's little-endian float32 bytes, base64-encoded."""
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _row_choice(choice: Choice) -> dict[str, Any]:
    row: dict[str, Any] = {
        "index": choice.index,
        "completion": choice.text,
        "finish_reason": choice.finish_reason,
        "completion_tokens": choice.completion_tokens,
    }
    if choice.logprobs is not None:
        row["logprobs"] = choice.logprobs
    return row


def _openai_choice(choice: Choice, chat: bool) -> dict[str, Any]:
    """One of an OpenAI body's ``choices``: chat ``message`` or completions ``text``.

    A completions choice's ``top_logprobs`` hold the sampled token first, then
    the top alternatives (at most ``logprobs`` + 1 entries: OpenAI's legacy
    completions "always return the logprob of the sampled token"; vLLM's
    ``_create_completion_logprobs`` alike); a chat choice's are the top
    alternatives alone, as OpenAI's."""
    logprobs: dict[str, Any] | None = None
    if chat:
        out: dict[str, Any] = {"index": choice.index, "message": {"role": "assistant", "content": choice.text}}
        if choice.logprobs is not None:
            logprobs = {"content": choice.logprobs}
    else:
        out = {"index": choice.index, "text": choice.text}
        if choice.logprobs is not None:
            offsets, at = [], 0
            for entry in choice.logprobs:
                offsets.append(at)
                at += len(entry["token"])
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": [e["logprob"] for e in choice.logprobs],
                "tokens": [e["token"] for e in choice.logprobs],
                "top_logprobs": [
                    {e["token"]: e["logprob"], **{t["token"]: t["logprob"] for t in e["top_logprobs"]}}
                    for e in choice.logprobs
                ],
            }
    out.update(logprobs=logprobs, finish_reason=choice.finish_reason)
    return out


def error_record(error: RowError) -> dict[str, Any]:
    """The errors-file record for a failed row, in the row's own format.
    ``"id_recovered": true`` says the id (``custom_id``) was read from the
    bytes of a line that is not valid JSON."""
    record: dict[str, Any]
    if error.openai:
        record = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": error.id,
            "line": error.line,
            "response": None,
            "error": {"code": error.type, "message": error.message},
        }
    else:
        record = {"id": error.id, "line": error.line, "error": {"type": error.type, "message": error.message}}
    if error.id_recovered:
        record["id_recovered"] = True
    return record


@dataclass(frozen=True, slots=True)
class OutputRow:
    """What an output record says about its row: the id (``custom_id`` for
    OpenAI lines), the completion text, and its token counts (0 where the
    record has none)."""

    id: str
    completion: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


def is_batch_record(record: dict[str, Any]) -> bool:
    """Whether an output or error record is an OpenAI batch line's (``custom_id``
    and ``response``, no ``completion`` or encoder result): a bulkinfer row's
    record keeps its ``id``, even with ``custom_id`` or ``response`` columns passed through."""
    return "custom_id" in record and "response" in record and "completion" not in record and _ENCODED.isdisjoint(record)


def parse_output(record: dict[str, Any]) -> OutputRow | None:
    """The :class:`OutputRow` of an output record in either shape (what
    :func:`output_record` writes; an embedding or score record has the text ``""``);
    None when the record has no string id or no completion text."""
    if is_batch_record(record):
        response = record.get("response") or {}
        body = (response.get("body") if isinstance(response, dict) else _not(response, "response", "an object")) or {}
        if body.get("object") == "list":  # an embedding response
            return _embedded(record["custom_id"], body.get("usage") or {})
        choice = (body.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content", choice.get("text"))
        usage = body.get("usage") or {}
        row_id = record["custom_id"]
    elif "completion" not in record and not _ENCODED.isdisjoint(record):  # an embedding or score record
        return _embedded(record.get("id"), record)
    else:
        text, usage, row_id = record.get("completion"), record, record.get("id")
    if not isinstance(row_id, str) or not isinstance(text, str):
        return None
    return OutputRow(row_id, text, _count(usage, "prompt_tokens"), _count(usage, "completion_tokens"))


def _not(value: Any, name: str, expected: str) -> NoReturn:
    """Raises ValueError: the field ``name`` is ``value``, not ``expected``."""
    raise ValueError(f"'{name}' is {value!r}, not {expected}"[:200])


def _count(usage: dict[str, Any], name: str) -> int:
    """``usage[name]`` as a token count (0 when absent).

    Raises:
        ValueError: it is no integer, naming it."""
    value = usage.get(name) or 0
    try:
        return int(value)
    except (TypeError, ValueError):
        _not(value, name, "a token count")


# The result fields of an encoder's records: embed's and score's (pair, rerank).
_ENCODED = frozenset({"embedding", "score", "results"})


def _embedded(row_id: Any, usage: dict[str, Any]) -> OutputRow | None:
    """The :class:`OutputRow` of an embedding or score record: no text, its prompt tokens."""
    if not isinstance(row_id, str):
        return None
    return OutputRow(row_id, "", _count(usage, "prompt_tokens"), 0)


def error_line(record: dict[str, Any]) -> int:
    """The input line (or Parquet row) number of an error record."""
    return int(record["line"])


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of an output file (JSONL or Parquet, by its name),
    streamed: JSONL line by line, Parquet one record batch at a time.

    Raises:
        ConfigError: the name has no known suffix.
        OSError: the file cannot be read.
    """
    if output_format(path) == PARQUET:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches():
            yield from batch.to_pylist()
        return
    for chunk in iter_jsonl_chunks(path):
        yield from chunk


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """A JSON object saved in ``path`` (a report, an eval); ``what`` names it
    in errors (``"report file"``).

    Raises:
        InputFileError: ``WHAT not found: PATH``; unreadable, or no regular
            file (:func:`bulkinfer.errors.read_whole`); not valid JSON (with the
            line and column); not a JSON object.
    """
    import orjson

    try:
        data = orjson.loads(read_whole(path, what))
    except orjson.JSONDecodeError as exc:
        raise InputFileError(
            f"{path}: line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}; give a saved {what}"
        ) from None
    if not isinstance(data, dict):
        raise InputFileError(f"{path}: a JSON {type(data).__name__}, not the object a {what} holds")
    return data
