"""THE bounded feed loop: add requests, step the engine, collect results.

Every job that sends requests to an engine goes through :func:`feed`: run's
generation, eval's generation (a run) and the perplexity pass. At most
``max_in_flight`` requests are unfinished in the engine at once, so a
million-row input never sits in the engine's queue, and the next request is
pulled from ``requests`` (a lazy iterator: planning happens as it is
pulled) only when a slot is free, so continuous batching never drains.

The loop talks only to the :class:`~bulkinfer.engine.base.Engine` protocol:
several replicas or a remote actor plug in behind it without touching this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from bulkinfer.engine.base import Engine
from bulkinfer.errors import EngineError
from bulkinfer.schema import Completion, Request
from bulkinfer.stop import StopToken

# The loop waits at most this long (seconds) for an engine step before it
# looks at the stop token again.
STEP_WAIT_S = 0.5


# With nothing in the engine and no request ready yet (a stream's rows still
# to come), the loop looks for one again after this long (seconds).
IDLE_WAIT_S = 0.02


class _Pending:
    """The type of :data:`PENDING`."""

    def __repr__(self) -> str:
        return "PENDING"


# What a stream's request iterator yields when no request is ready yet but
# more may come: the loop steps the engine (or waits) and asks again.
PENDING = _Pending()


class FeedStopped(Exception):
    """The stop token was set: no request was added after it; the requests
    still in flight were left unfinished (their rows run again on resume)."""


def feed(
    engine: Engine,
    requests: Iterator[Request | _Pending],
    *,
    max_in_flight: int,
    on_finished: Callable[[Request, Completion], None],
    on_failed: Callable[[Request, str], None],
    on_step: Callable[[list[Completion]], None] | None = None,
    stop: StopToken | None = None,
    id_prefix: str = "",
) -> None:
    """Send every request of ``requests`` through ``engine``; each ends in
    exactly one ``on_finished(request, completion)`` or ``on_failed(request,
    message)`` (the engine rejected it, or it failed in the engine). After
    each engine step ``on_step(completions of that step)`` runs (flush,
    progress). Engine request ids are ``id_prefix + str(request.seq)``.
    ``requests`` may yield :data:`PENDING` (a stream: nothing ready yet, more
    may come): the loop goes on stepping the engine, or waits
    :data:`IDLE_WAIT_S` when it holds nothing, and asks again.

    Raises:
        FeedStopped: ``stop`` was set (checked before adding and after each
            step, at most :data:`STEP_WAIT_S` s apart).
        EngineError: the engine died (unless ``stop`` was set: a signal
            reaches the engine's processes too, then FeedStopped).
    """
    in_flight: dict[str, Request] = {}
    exhausted = False
    while True:
        if stop is not None and stop.is_set():
            raise FeedStopped
        pending = False
        while not exhausted and len(in_flight) < max_in_flight:
            request = next(requests, None)
            if request is None:
                exhausted = True
                break
            if isinstance(request, _Pending):
                pending = True
                break
            request_id = id_prefix + str(request.seq)
            rejected = engine.add(request_id, request)
            if rejected is not None:
                on_failed(request, rejected.error or "rejected by the engine")
            else:
                in_flight[request_id] = request
        if not in_flight:
            if not pending:
                return
            time.sleep(IDLE_WAIT_S)
            continue
        try:
            finished = engine.step(wait=STEP_WAIT_S)
        except EngineError:
            if stop is not None and stop.is_set():
                raise FeedStopped from None
            raise
        for completion in finished:
            request = in_flight.pop(completion.request_id)
            if completion.error is not None:
                on_failed(request, completion.error)
            else:
                on_finished(request, completion)
        if on_step is not None:
            on_step(finished)
