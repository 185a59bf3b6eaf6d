"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (a generative
model's server), ``POST /v1/embeddings`` (an embedding model's): online
requests on the server's engine, ahead of the running batch's rows
(:mod:`bulkinfer.jobs.online`, :class:`~bulkinfer.engine.mux.EngineMux`);
a URL the model does not serve is a 400 (``model_not_supported``).

- ``stream: true`` answers with server-sent events (``data: {chunk}`` lines,
  then ``data: [DONE]``), OpenAI's chunks;
- at most ``max_online`` requests are in flight; one more gets 429 with
  ``Retry-After`` (seconds);
- while no engine is ready (starting, restarting after a death, failed)
  a request gets 503 with ``Retry-After``; so does one whose engine dies
  under it (a streamed one ends with an ``error`` event);
- a body the batch lines would refuse gets 400 naming the field (in the
  message and as ``param``).

Each request's time to first token and latency feed ``/metrics``
(:class:`~bulkinfer.serve.prometheus.OnlineMetrics`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bulkinfer.errors import EngineError
from bulkinfer.jobs.online import ONLINE_URLS, Chunks, Online, wants_stream
from bulkinfer.schema import Choice, Completion, RowInvalid
from bulkinfer.schema import Request as EngineRequest
from bulkinfer.serve.http import ApiError, Tenant, not_json
from bulkinfer.serve.objects import error_body
from bulkinfer.serve.prometheus import OnlineMetrics
from bulkinfer.serve.worker import Runner

# The field a row error names: "field 'max_tokens': ...", "field 'messages[0].role' ..."
_NAMED_FIELD = re.compile(r"\bfield '([^']+)'")
BUSY_RETRY_AFTER_S = 1  # Retry-After of a 429: online requests finish in seconds
STARTING_RETRY_AFTER_S = 5  # Retry-After of a 503: an engine starts in tens of seconds on CPU


class Events:
    """An online request's :class:`~bulkinfer.engine.mux.Listener`: hands what
    the engine's thread hears to the request's event loop, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def _put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def piece(self, index: int, text: str, tokens: int, finish_reason: str | None) -> None:
        self._put("piece", (index, text, finish_reason))

    def done(self, completion: Completion) -> None:
        self._put("done", completion)

    def failed(self, error: EngineError) -> None:
        self._put("failed", error)


def named_field(message: str) -> str | None:
    """The field a request body's error ``message`` names (OpenAI's ``param``:
    ``max_tokens``, ``messages[0].role``), or None when it names none."""
    found = _NAMED_FIELD.search(message)
    return found.group(1) if found else None


def unavailable(message: str) -> ApiError:
    return ApiError(
        503, message, "service_unavailable", "engine_unavailable", headers={"Retry-After": str(STARTING_RETRY_AFTER_S)}
    )


def online_router(runner: Runner, max_online: int, metrics: OnlineMetrics) -> APIRouter:
    """The online routes over ``runner``'s engine (see the module)."""
    router = APIRouter()
    in_flight = [0]  # requests admitted and not finished (the event loop's thread only)

    async def answer(request: Request, url: str) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, not_json(exc)) from None
        online = runner.online
        if online is None:
            metrics.ended(url, 503)
            raise unavailable(f"the engine is {runner.health}: retry later")
        if in_flight[0] >= max_online:
            metrics.ended(url, 429)
            raise ApiError(
                429,
                f"{max_online} online requests are in flight (--max-online): retry later",
                "rate_limit_error",
                "too_many_requests",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
            )
        in_flight[0] += 1
        metrics.in_flight.set(in_flight[0])
        try:
            prepared = await run_in_threadpool(online.prepare, url, body)
        except RowInvalid as exc:
            _left(in_flight, metrics, url, 400)
            raise ApiError(400, exc.message, code=exc.type, param=named_field(exc.message)) from None
        events = Events(asyncio.get_running_loop())
        try:
            online.start(prepared, events)
        except EngineError as exc:
            _left(in_flight, metrics, url, 503)
            raise unavailable(str(exc)) from None
        stream, include_usage = wants_stream(body)
        timing = Timing(url, metrics)
        if stream:
            chunks = Chunks(prepared, online.model, include_usage)
            done = lambda status: _left(in_flight, metrics, url, status)  # noqa: E731
            sse = streamed(online, prepared, events, chunks, timing, done)
            return StreamingResponse(sse, media_type="text/event-stream")
        status = 500
        try:
            completion = await whole(online, prepared, events, timing)
            status = 200
            return JSONResponse(online.response(prepared, completion))
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            _left(in_flight, metrics, url, status)

    def route_for(url: str) -> Any:
        """The route of ``url`` (its URL bound here: a parameter would be a query parameter a client could set)."""

        async def route(request: Request, who: Tenant) -> Response:
            return await answer(request, url)

        return route

    for url in ONLINE_URLS:
        router.add_api_route(url, route_for(url), methods=["POST"], name=url.rsplit("/", 1)[-1])
    return router


class Timing:
    """One request's time to first token and latency, into ``metrics`` (seconds)."""

    def __init__(self, url: str, metrics: OnlineMetrics):
        self.url, self.metrics = url, metrics
        self.started = time.monotonic()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()
            self.metrics.ttft.labels(self.metrics.model).observe(self.first - self.started)

    def end(self) -> None:
        self.token()
        self.metrics.latency.labels(self.metrics.model).observe(time.monotonic() - self.started)


async def whole(online: Online, request: EngineRequest, events: Events, timing: Timing) -> Completion:
    """The finished completion of ``request``.

    Raises:
        ApiError: 400 when the engine rejected it; 503 when the engine died.
    """
    try:
        while True:
            kind, value = await events.queue.get()
            if kind == "piece":
                timing.token()
            elif kind == "failed":
                raise unavailable(f"the engine died: {value}")
            else:
                if value.error is not None:
                    raise ApiError(400, value.error, code="rejected_by_engine")
                timing.end()
                return value  # type: ignore[no-any-return]
    except asyncio.CancelledError:  # the client went away
        online.cancel(request)
        raise


async def streamed(
    online: Online, request: EngineRequest, events: Events, chunks: Chunks, timing: Timing, left: Any
) -> AsyncIterator[bytes]:
    """The server-sent events of ``request``: a chunk per piece, the usage
    chunk if asked, ``[DONE]``; an ``error`` event if the engine rejected it
    or died. The request is aborted if the client goes away first."""
    status, pieces = 499, False
    try:
        while True:
            kind, value = await events.queue.get()
            if kind == "piece":
                timing.token()
                pieces = True
                index, text, finish_reason = value
                yield _event(chunks.piece(index, text, finish_reason))
                continue
            if kind == "failed":
                status = 503
                yield _event(error_body(f"the engine died: {value}", "service_unavailable", "engine_unavailable", None))
                return
            completion: Completion = value
            if completion.error is not None:
                status = 400
                yield _event(error_body(completion.error, "invalid_request_error", "rejected_by_engine", None))
                return
            if not pieces:  # an engine that does not stream: the whole text at once
                whole_choices = completion.choices or (
                    Choice(0, completion.text, completion.finish_reason, completion.completion_tokens),
                )
                for choice in whole_choices:
                    yield _event(chunks.piece(choice.index, choice.text, choice.finish_reason))
            timing.end()
            if chunks.include_usage:
                yield _event(chunks.usage(completion))
            yield b"data: [DONE]\n\n"
            status = 200
            return
    finally:
        if status == 499:
            online.cancel(request)
        left(status)


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _left(in_flight: list[int], metrics: OnlineMetrics, url: str, status: int) -> None:
    """An admitted request ended with HTTP ``status``."""
    in_flight[0] -= 1
    metrics.in_flight.set(in_flight[0])
    metrics.ended(url, status)
