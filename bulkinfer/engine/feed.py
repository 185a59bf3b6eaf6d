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

import dataclasses
import time
from collections.abc import Callable, Iterator

from bulkinfer.engine.base import Engine
from bulkinfer.errors import EngineError
from bulkinfer.schema import Choice, Completion, Request
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


class Join:
    """The parts of one request of several prompts (``count`` of them) as
    they end, for whoever sends each part as its own engine request (the
    feed loop, an online request): :meth:`add` returns the request's one
    completion once it is known, the parts' joined (:func:`joined`) or the
    first failing part's; nothing before, nothing after."""

    def __init__(self, count: int):
        self.count = count
        self.done: dict[int, Completion] = {}
        self.ended = False

    def fail(self, index: int, error: str) -> str:
        """Ends the request at part ``index`` (rejected before it ran); the error naming ``prompt[index]``."""
        self.ended = True
        return f"prompt[{index}]: {error}"

    def add(self, index: int, completion: Completion) -> Completion | None:
        """Part ``index``'s ``completion``; returns the request's completion
        when this part ends it: the first with an ``error`` (then the
        request's error names ``prompt[index]``), or the last to finish (all
        parts' choices joined). None while parts are still running, and for
        any part after the request ended (its result is dropped)."""
        if self.ended:
            return None
        if completion.error is not None:
            return dataclasses.replace(completion, error=self.fail(index, completion.error))
        self.done[index] = completion
        if len(self.done) < self.count:
            return None
        self.ended = True
        return joined([self.done[j] for j in range(self.count)])


def joined(parts: list[Completion]) -> Completion:
    """One completion of a request of several prompts from its parts' (in
    prompt order), as OpenAI's and vLLM's ``/v1/completions`` answer a list
    of prompts: every part's choices, prompt j's ``n`` at indices ``j * n``
    on; token counts summed (OpenAI's ``usage`` sums them); ``text`` and
    ``finish_reason`` the first choice's."""
    choices: list[Choice] = []
    for part in parts:
        own = part.choices or (Choice(0, part.text, part.finish_reason, part.completion_tokens),)
        offset = len(choices)
        choices += [dataclasses.replace(choice, index=offset + choice.index) for choice in own]
    return Completion(
        parts[0].request_id.rpartition(".")[0],
        choices[0].text,
        choices[0].finish_reason,
        prompt_tokens=sum(part.prompt_tokens for part in parts),
        completion_tokens=sum(part.completion_tokens for part in parts),
        choices=tuple(choices),
        cached_tokens=sum(part.cached_tokens for part in parts),
    )


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
    progress). Engine request ids are ``id_prefix + str(request.seq)``; a
    request of several prompts (``parts``) is one engine request a part,
    ``ID.j``, and ends once, with their choices joined (:func:`joined`).
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
    joins: dict[str, tuple[Join, int, Request]] = {}  # a part's engine request id -> its join, index, row
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
            if request.parts is not None:  # several prompts: each part its own engine request
                join = Join(len(request.parts))
                for index, part in enumerate(request.parts):
                    part_id = f"{request_id}.{index}"
                    rejected = engine.add(part_id, part)
                    if rejected is not None:
                        on_failed(request, join.fail(index, rejected.error or "rejected by the engine"))
                        break
                    in_flight[part_id], joins[part_id] = part, (join, index, request)
                continue
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
            if completion.request_id in joins:
                join, index, request = joins.pop(completion.request_id)
                ended = join.add(index, completion)
                if ended is None:
                    continue
                completion = ended
            if completion.error is not None:
                on_failed(request, completion.error)
            else:
                on_finished(request, completion)
        if on_step is not None:
            on_step(finished)
