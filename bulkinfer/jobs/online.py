"""Online requests on a server's engine: one OpenAI ``/v1/chat/completions``
or ``/v1/completions`` body in, its response (or its stream of chunks) out;
on an embedding model's engine, one ``/v1/embeddings`` body in, its
embeddings out (:class:`OnlineEmbeddings`).

A body is read exactly as a batch line's ``body`` is
(:func:`~bulkinfer.prep.rows.to_request`: the same fields, the same checks,
nothing silently ignored; ``model`` as in batch lines), tokenized by the
same :class:`~bulkinfer.prep.planner.Planner` (chat template, context
check), and answered with the body a batch output line carries
(:func:`~bulkinfer.io.records.output_record`). Streamed answers are OpenAI's
chunks: ``chat.completion.chunk`` objects (the first ``delta`` carries the
role) or ``text_completion`` objects, then, with
``stream_options.include_usage``, a chunk with ``usage`` and no choices
(https://platform.openai.com/docs/api-reference/chat-streaming, checked
against the ``openai`` SDK's ``ChatCompletionChunk`` and ``Completion`` types
in the tests).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.engine.feed import Join
from bulkinfer.engine.mux import EngineMux, Listener
from bulkinfer.errors import EngineError
from bulkinfer.io.records import embedding_record, output_record
from bulkinfer.prep.embeddings import parse_embed_row
from bulkinfer.prep.grammar import Grammars
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.rows import to_request
from bulkinfer.prep.vocabulary import Vocabulary
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, Completion, Request, RowInvalid

GENERATION_URLS = (CHAT_URL, COMPLETIONS_URL)
ONLINE_URLS = (*GENERATION_URLS, EMBEDDINGS_URL)
STREAM_FIELDS = ("stream", "stream_options")  # read here; a batch line has no use for them


class _Online:
    """Online requests on ``mux``'s engine, tokenized and checked by
    ``planner``; ``model`` the id answers name; ``urls`` the URLs served.

    :meth:`prepare` and :meth:`start` run in any thread; the listener hears
    the engine's thread (see :class:`~bulkinfer.engine.mux.Listener`).
    """

    urls: tuple[str, ...] = ()

    def __init__(self, mux: EngineMux, planner: Planner, model: str):
        self.mux, self.model = mux, model
        self._planner = planner
        self._planning = threading.Lock()  # the planner's statistics are not thread-safe
        self._seq = itertools.count()

    def _planned(self, parse: Callable[[int], Request]) -> Request:
        """``parse(seq)``'s request planned alone (tokenized, checked), errors said of a request body.

        Raises:
            RowInvalid: as ``parse`` raises it, or the planner's row error.
        """
        try:
            request = parse(next(self._seq))
        except RowInvalid as exc:
            raise RowInvalid(exc.type, _online_message(exc.message)) from None
        with self._planning:
            planned, errors = self._planner.plan_window([request])
        if errors:
            raise RowInvalid(errors[0].type, _online_message(errors[0].message))
        return planned[0]

    def start(self, request: Request, listener: Listener) -> None:
        """Send ``request`` to the engine ahead of batch rows (several
        prompts: each part, heard as one request by ``listener``, see :class:`_Parts`).

        Raises:
            EngineError: the engine is dead, closing or cannot serve online requests.
        """
        if request.parts is None:
            self.mux.submit(request.id, request, listener)
            return
        parts = _Parts(request, listener, lambda: self.cancel(request))
        for index, part in enumerate(request.parts):
            self.mux.submit(f"{request.id}.{index}", part, parts.part(index))

    def cancel(self, request: Request) -> None:
        """Abort ``request`` (its caller went away), every part of it."""
        for request_id in _engine_ids(request):
            self.mux.cancel(request_id)


def _engine_ids(request: Request) -> list[str]:
    """The mux's ids of ``request``: its own, or one a part (``ID.j``)."""
    return [request.id] if request.parts is None else [f"{request.id}.{j}" for j in range(len(request.parts))]


class _Parts:
    """The parts of an online request of several prompts heard as one
    request by ``listener``, joined as the feed loop joins a batch line's
    (:class:`~bulkinfer.engine.feed.Join`): prompt j's pieces as choices
    j*n on, one ``done`` once every part is done; the first part the engine
    rejects or fails ends it (its error naming ``prompt[j]``) and ``cancel``
    aborts the rest. Every call comes from the mux's thread."""

    def __init__(self, request: Request, listener: Listener, cancel: Callable[[], None]):
        self.listener, self.cancel = listener, cancel
        self.n, self.join = int(request.options.get("n", 1)), Join(len(request.parts or ()))

    def part(self, index: int) -> Listener:
        """The listener of part ``index``."""
        return _Part(self, index)

    def piece(self, index: int, choice: int, text: str, tokens: int, finish_reason: str | None) -> None:
        if not self.join.ended:
            self.listener.piece(index * self.n + choice, text, tokens, finish_reason)

    def failed(self, error: EngineError) -> None:
        if not self.join.ended:
            self.join.ended = True
            self.listener.failed(error)

    def done(self, index: int, completion: Completion) -> None:
        ended = self.join.add(index, completion)
        if ended is None:
            return
        self.listener.done(ended)
        if ended.error is not None:
            self.cancel()


class OnlineRequests(_Online):
    """Online chat and text completions: ``settings`` with the chat template
    resolved, ``tokenizer`` the model's, ``vocab`` the token ids it takes (a
    request naming another is refused; None: left to the engine; see
    :class:`_Online`); a structured output the engine's grammar backend
    (``settings.engine``) would refuse is refused too."""

    urls = GENERATION_URLS

    def __init__(self, mux: EngineMux, tokenizer: Any, settings: Settings, model: str, vocab: Vocabulary | None = None):
        grammars = Grammars(tokenizer, settings.engine)
        planner = Planner(tokenizer, settings.plan, mux.max_model_len, vocabulary=vocab, grammars=grammars)
        super().__init__(mux, planner, model)
        self.settings = settings

    def prepare(self, url: str, body: Any) -> Request:
        """``body`` of an online request to ``url`` as a tokenized Request
        (``id`` a fresh ``chatcmpl-``/``cmpl-`` id).

        Raises:
            RowInvalid: the body is not an object, a field is missing, of the
                wrong type or range, not supported (the message names it), or
                the prompt and ``max_tokens`` exceed the context.
        """
        _check_body(url, body, self.urls)
        stream = body.get("stream", False)
        if stream not in (None, True, False):
            raise RowInvalid("invalid_field", "field 'stream': expected true or false")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise RowInvalid("unsupported_field", "field 'stream_options': only include_usage is supported")
        if options and not stream:  # as vLLM's and OpenAI's servers
            raise RowInvalid("invalid_field", "field 'stream_options': only with stream true")
        if stream and body.get("logprobs") not in (None, False):
            raise RowInvalid("unsupported_field", "field 'logprobs' is not streamed here: ask with stream false")
        prefix = "chatcmpl" if url == CHAT_URL else "cmpl"
        line = {
            "custom_id": f"{prefix}-{uuid.uuid4().hex}",
            "url": url,
            "body": {k: v for k, v in body.items() if k not in STREAM_FIELDS},
        }
        return self._planned(lambda seq: to_request(line, seq, 1, self.settings))

    def response(self, request: Request, completion: Completion) -> dict[str, Any]:
        """The response body: a ``chat.completion`` or ``text_completion``, as in a batch output line."""
        body: dict[str, Any] = output_record(request, completion, self.model)["response"]["body"]
        body["id"] = request.id
        return body


class OnlineEmbeddings(_Online):
    """Online ``/v1/embeddings`` requests on ``mux``'s embedding engine:
    a body is read as a batch line's (:func:`~bulkinfer.prep.embeddings.parse_embed_row`:
    ``input`` in any of OpenAI's four forms, ``encoding_format``, ``dimensions``),
    tokenized and checked by ``planner`` (the encoder's ``max_seq_length``:
    a longer input is a 400, as OpenAI's), and answered with the body a batch
    output line carries (:func:`~bulkinfer.io.records.embedding_record`:
    vLLM's ``EmbeddingResponse``).
    """

    urls = (EMBEDDINGS_URL,)

    def prepare(self, url: str, body: Any) -> Request:
        """``body`` as a tokenized embedding Request (``id`` a fresh ``embd-`` id).

        Raises:
            RowInvalid: not an object, a bad or unsupported field (named), an input over ``max_seq_length``.
        """
        _check_body(url, body, self.urls)
        line = {"custom_id": f"embd-{uuid.uuid4().hex}", "url": url, "body": body}
        return self._planned(lambda seq: parse_embed_row(line, seq, 1))

    def response(self, request: Request, completion: Completion) -> dict[str, Any]:
        """The ``list`` of embeddings, as in a batch output line."""
        body: dict[str, Any] = embedding_record(request, completion, self.model)["response"]["body"]
        return body


# What a server's engine answers online: a generative model's or an embedding model's requests.
Online = OnlineRequests | OnlineEmbeddings


def _check_body(url: str, body: Any, urls: tuple[str, ...]) -> None:
    """Raises RowInvalid when ``body`` is no object or the model does not serve ``url``."""
    if url not in urls:
        kind = "an embedding model" if url == EMBEDDINGS_URL else "a generative model"
        raise RowInvalid(
            "model_not_supported",
            f"{url} needs {kind}: this server's model serves {', '.join(urls)} (bulkinfer serve --model)",
        )
    if not isinstance(body, dict):
        raise RowInvalid("invalid_request", "the request body must be a JSON object")


class Chunks:
    """The streamed chunks of one online request (OpenAI's shapes, see the module)."""

    def __init__(self, request: Request, model: str, include_usage: bool):
        self.request, self.include_usage = request, include_usage
        self.chat = request.openai_url == CHAT_URL
        self._base = {
            "id": request.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": request.passthrough.get("model", model),
        }
        self._started: set[int] = set()

    def piece(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The chunk of new ``text`` of choice ``index`` (its ``finish_reason`` on the last)."""
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if index not in self._started:
                self._started.add(index)
                delta = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return {**self._base, "choices": [choice]}

    def usage(self, completion: Completion) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the request's ``usage``."""
        total = completion.prompt_tokens + completion.completion_tokens
        return {
            **self._base,
            "choices": [],
            "usage": {
                "prompt_tokens": completion.prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "total_tokens": total,
            },
        }


def _online_message(message: str) -> str:
    """A batch line's error message, said of a request body."""
    return message.replace("field 'body.", "field '").replace("; the row was not run", "")


def wants_stream(body: Any) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``) of a request body."""
    if not isinstance(body, dict):
        return False, False
    options = body.get("stream_options") or {}
    return bool(body.get("stream")), bool(isinstance(options, dict) and options.get("include_usage"))


class _Part:
    """Part ``index`` of a :class:`_Parts`, a :class:`~bulkinfer.engine.mux.Listener` of the mux."""

    def __init__(self, parts: _Parts, index: int):
        self.parts, self.index = parts, index

    def piece(self, choice: int, text: str, tokens: int, finish_reason: str | None) -> None:
        self.parts.piece(self.index, choice, text, tokens, finish_reason)

    def done(self, completion: Completion) -> None:
        self.parts.done(self.index, completion)

    def failed(self, error: EngineError) -> None:
        self.parts.failed(error)
