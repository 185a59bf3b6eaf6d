"""One engine, two kinds of traffic: online requests ahead of batch rows.

:class:`EngineMux` owns an engine and the one thread that calls it (add,
step, abort): a server's batch run feeds it through the
:class:`~bulkinfer.engine.base.Engine` protocol (the mux *is* the batch's
engine), and online requests enter beside it with :meth:`EngineMux.submit`.
Online requests carry vLLM priority :data:`ONLINE_PRIORITY`; a batch row's
own ``priority`` is kept but never below :data:`BATCH_PRIORITY_FLOOR`, so
under vLLM's priority scheduling (``scheduling_policy = "priority"``: lower
runs first, and a waiting request of lower value preempts a running one
of higher value when the batch is full) an online request waits for no batch
row, and batch rows fill whatever capacity online traffic leaves.

vLLM's priority scheduling alone is not enough for that: a waiting request
gets no seat while ``max_num_seqs`` requests run (it waits for one of them
to finish), and every step an online request shares with batch prefills
takes as long as those prefills. So the mux admits batch rows itself (the
rest wait in the mux, in the order the batch sent them): at most
``max_num_seqs - online_seats`` at any time, so an online request always
finds a seat, and while any online request is in flight at most
``batch_beside_online`` rows and ``prefill_beside_online`` prompt tokens
waiting for their prefill, so that its steps carry little batch work.
Admission cannot take the rows already in the engine out of its steps: an
engine started with :func:`online_first_args` runs
:class:`bulkinfer.engine.online_first.OnlineFirstScheduler`, which does.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from bulkinfer.engine.base import Engine
from bulkinfer.errors import EngineError
from bulkinfer.schema import Completion, Request

# vLLM's request priority is an int64; lower runs first (scheduling_policy = "priority").
ONLINE_PRIORITY = -(1 << 40)
BATCH_PRIORITY_FLOOR = ONLINE_PRIORITY + 1
STEP_WAIT_S = 0.05  # the engine thread looks at new requests at least this often while a step runs (seconds)
CHECK_S = 0.2  # a batch waiting for a step checks for a dead engine this often (seconds)
CLOSE_WAIT_S = 10.0  # close() waits this long for the mux's thread before it closes the engine (seconds)
ONLINE_FIRST_SCHEDULER = "bulkinfer.engine.online_first.OnlineFirstScheduler"
BESIDE_KEY = "bulkinfer_batch_beside_online"


def online_first_args(beside: int) -> dict[str, Any]:
    """vLLM ``EngineArgs`` keyword arguments for an engine whose batch rows
    but the first ``beside`` decoding ones sit out every step while an online
    request is in flight (:class:`bulkinfer.engine.online_first.OnlineFirstScheduler`)."""
    return {"scheduler_cls": ONLINE_FIRST_SCHEDULER, "additional_config": {BESIDE_KEY: beside}}


class Listener(Protocol):
    """What an online request's caller hears, in the engine's thread (hand it on, never block)."""

    def piece(self, index: int, text: str, tokens: int, finish_reason: str | None) -> None:
        """New text of choice ``index`` (``tokens`` tokens; ``finish_reason`` on its last piece).
        Engines that cannot stream give none: the whole text comes with :meth:`done`."""

    def done(self, completion: Completion) -> None:
        """The request finished; ``completion.error`` is set when the engine rejected or failed it."""

    def failed(self, error: EngineError) -> None:
        """The engine died: no answer will come."""


class EngineMux:
    """``engine`` shared by one batch run at a time (this object, as an
    :class:`Engine`) and any number of online requests (:meth:`submit`).

    Every call into ``engine`` happens in the mux's thread, which steps the
    engine while anything is unfinished and otherwise sleeps until a request
    arrives. When the engine dies (:class:`EngineError` from a step or an
    add), each online request in flight hears :meth:`Listener.failed`, the
    batch's next :meth:`step` raises the error, and so does every later
    :meth:`submit`; ``on_death`` is called (a server restarts the engine).

    Batch rows enter the engine while fewer than ``max_num_seqs -
    online_seats`` of them are in it (``online_seats`` at most half the
    seats, one at least left to the batch), and, while an online
    request is in flight, fewer than ``batch_beside_online`` (None: no
    further bound) and only while the prompts of those in the engine not
    yet prefilled hold fewer than ``prefill_beside_online`` tokens (None: no
    bound; 0: no batch row enters); the others wait in the mux, in order.

    :attr:`generated_tokens`, :attr:`prefilled_tokens` and
    :attr:`cached_tokens` are the batch's: the engine's counts minus the
    online requests' (their cached tokens once they finish, as the request's
    usage gives them: one choice's of a request of ``n``, so the batch's
    count may hold its siblings' while such a request runs). ``running_lengths()``,
    :attr:`running_prompt_tokens` and :attr:`ended_sequences` are the engine's (online requests included).
    """

    def __init__(
        self,
        engine: Engine,
        on_death: Callable[[], None] | None = None,
        online_seats: int = 0,
        batch_beside_online: int | None = None,
        prefill_beside_online: int | None = None,
    ):
        self._engine = engine
        self._on_death = on_death
        self.max_model_len, self.max_num_seqs = engine.max_model_len, engine.max_num_seqs
        self.batch_seats = max(1, engine.max_num_seqs - min(online_seats, engine.max_num_seqs // 2))
        self.batch_beside_online = batch_beside_online
        self.prefill_beside_online = prefill_beside_online
        self.online = callable(getattr(engine, "abort", None))  # replicas abort only everything: no online requests
        watch = getattr(engine, "watch", None)
        self._watch: Callable[[str, Any], None] | None = watch if callable(watch) else None
        self._commands: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._owners: dict[str, Listener | None] = {}  # unfinished request id -> its online listener (None: batch)
        self._batch_ids: set[str] = set()  # batch requests added and not yet returned by step()
        self._held: deque[tuple[str, Request]] = deque()  # batch requests not yet in the engine, in order
        self._batch_in_engine = 0
        self._batch_admitted_tokens = 0  # prompt tokens of the batch rows let into the engine (see _batch_pending)
        self._online_in_flight = 0
        # online requests whose prompt the engine has processed: the choices (sequences) that have output
        self._online_started: dict[str, set[int]] = {}
        self._batch_done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._online_generated = self._online_prefilled = self._online_cached = 0
        self._error: EngineError | None = None
        self._closing = False
        self._lock = threading.Lock()  # submit() against the thread's end
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="bulkinfer-engine-mux", daemon=True)
        self._thread.start()

    # the batch's Engine

    @property
    def settings(self) -> dict[str, Any]:
        return self._engine.settings

    @property
    def generated_tokens(self) -> int:
        return self._engine.generated_tokens - self._online_generated

    @property
    def prefilled_tokens(self) -> int:
        return self._engine.prefilled_tokens - self._online_prefilled

    @property
    def cached_tokens(self) -> int:
        return max(self._engine.cached_tokens - self._online_cached, 0)

    @property
    def running_prompt_tokens(self) -> int:
        return self._engine.running_prompt_tokens

    @property
    def ended_sequences(self) -> int:
        return self._engine.ended_sequences

    def running_lengths(self) -> list[int]:
        return self._engine.running_lengths()

    def add(self, request_id: str, request: Request) -> Completion | None:
        """Queue a batch request (a rejection comes back from :meth:`step` as a failed Completion).

        Raises:
            EngineError: the engine died.
        """
        self._raise_if_dead()
        if request.priority < BATCH_PRIORITY_FLOOR:
            request = dataclasses.replace(request, priority=BATCH_PRIORITY_FLOOR)
        self._batch_ids.add(request_id)
        self._send("add", request_id, (request, None))
        return None

    def step(self, wait: float | None = None) -> list[Completion]:
        """The batch requests finished since the last call, waiting up to
        ``wait`` seconds (None: until one finishes) for the first.

        Raises:
            EngineError: the engine died.
        """
        finished: list[Completion] = []
        left = wait
        while not finished:
            self._raise_if_dead()
            slice_s = CHECK_S if left is None else min(CHECK_S, left)
            try:
                finished.append(self._batch_done.get(timeout=max(slice_s, 0.0)))
            except queue.Empty:
                if left is not None:
                    left -= slice_s
                    if left <= 0:
                        return []
        while True:
            try:
                finished.append(self._batch_done.get_nowait())
            except queue.Empty:
                break
        finished = [c for c in finished if c.request_id in self._batch_ids]
        self._batch_ids.difference_update(c.request_id for c in finished)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._batch_ids)

    def abort_unfinished(self) -> None:
        """Abort the batch's unfinished requests (online ones run on); their
        finished results not yet returned are dropped.

        Raises:
            EngineError: the engine died.
        """
        self._raise_if_dead()
        aborted, self._batch_ids = sorted(self._batch_ids), set()
        done = threading.Event()
        self._send("abort", aborted, done)
        while not done.wait(CHECK_S):
            self._raise_if_dead()
        while True:  # finished before the abort, not yet returned: dropped (a later run reuses request ids)
            try:
                self._batch_done.get_nowait()
            except queue.Empty:
                break

    def close(self) -> None:
        """Stop the mux's thread (online requests in flight hear ``failed``), then close the engine.
        A thread stuck in the engine (a hung step) is waited for :data:`CLOSE_WAIT_S` at most:
        closing the engine ends its processes, and with them the wait."""
        self._closing = True
        self._wake.set()
        self._thread.join(CLOSE_WAIT_S)
        self._engine.close()

    # online requests

    def submit(self, request_id: str, request: Request, listener: Listener) -> None:
        """Queue an online request at :data:`ONLINE_PRIORITY`; ``listener``
        hears its pieces and its end (see :class:`Listener`).

        Raises:
            EngineError: the engine died or is closing, or it cannot serve
                online requests (replicas: :attr:`online` is False).
        """
        if not self.online:
            raise EngineError("online requests need one engine (not replicas): it must abort requests by id")
        with self._lock:  # never queued after the thread stopped: it would never be answered
            self._raise_if_dead()
            self._send("add", request_id, (dataclasses.replace(request, priority=ONLINE_PRIORITY), listener))

    def cancel(self, request_id: str) -> None:
        """Abort an online request (its caller went away): nothing more comes of it."""
        self._send("abort", [request_id], None)

    @property
    def dead(self) -> EngineError | None:
        """The error the engine died of, or None while it lives."""
        return self._error

    # the mux's thread

    def _send(self, kind: str, what: Any, extra: Any) -> None:
        self._commands.put((kind, what, extra))
        self._wake.set()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error
        if self._closing or self._stopped:
            raise EngineError("the engine is closing")

    def _loop(self) -> None:
        try:
            while not self._closing:
                self._apply_commands()
                self._admit()
                if self._engine.has_unfinished():
                    self._route(self._engine.step(wait=STEP_WAIT_S))
                else:
                    self._wake.wait()
                    self._wake.clear()
        except EngineError as exc:
            self._error = exc
            if self._on_death is not None:
                self._on_death()
        finally:
            error = self._error or EngineError("the engine was closed")
            with self._lock:
                self._stopped = True
            listeners = [listener for listener in self._owners.values() if listener is not None]
            self._owners.clear()
            while True:  # sent while the last step ran (the engine already dead): never applied
                try:
                    kind, _, extra = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add" and extra[1] is not None:
                    listeners.append(extra[1])
                elif kind == "abort" and extra is not None:
                    extra.set()
            for listener in listeners:
                listener.failed(error)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, what, extra = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request, listener = extra
                if listener is None:
                    self._held.append((what, request))
                else:
                    self._add(what, request, listener)
                continue
            self._abort(what)
            if extra is not None:
                extra.set()

    def _admit(self) -> None:
        """Held batch requests into the engine, in order, while their seats allow (see the class)."""
        seats = self.batch_seats
        if self._online_in_flight and self.batch_beside_online is not None:
            seats = min(seats, self.batch_beside_online)
        budget = self.prefill_beside_online if self._online_in_flight else None
        while self._held and self._batch_in_engine < seats:
            if budget is not None and self._batch_pending() >= budget:
                break
            request_id, request = self._held.popleft()
            self._batch_in_engine += 1
            self._batch_admitted_tokens += request.prompt_length * request.n  # prefilled once a choice
            self._add(request_id, request, None)

    def _batch_pending(self) -> int:
        """Prompt tokens of the batch rows in the engine not yet prefilled
        (the engine counts a prompt as prefilled at its request's first
        output); 0, and counted afresh, when no batch row is in the engine."""
        prefilled = self._engine.prefilled_tokens - self._online_prefilled
        if self._batch_in_engine == 0:
            self._batch_admitted_tokens = prefilled
        return max(0, self._batch_admitted_tokens - prefilled)

    def _add(self, request_id: str, request: Request, listener: Listener | None) -> None:
        self._owners[request_id] = listener
        if listener is not None:
            self._online_in_flight += 1
        # watched before it is added: the engine streams a watched request every token (VllmEngine.stream_interval)
        if listener is not None and self._watch is not None and request.inputs is None:  # pooling: no pieces
            self._watch(request_id, self._counted(request_id, request.prompt_length, listener))
        rejected = self._engine.add(request_id, request)
        if rejected is not None:
            self._route([rejected])

    def _counted(
        self, request_id: str, prompt_tokens: int, listener: Listener
    ) -> Callable[[int, str, int, str | None], None]:
        """``listener.piece``, counting its tokens (and at the first, its
        prompt's) as the online requests'."""

        def piece(index: int, text: str, tokens: int, finish_reason: str | None) -> None:
            started = self._online_started.setdefault(request_id, set())
            if index not in started:  # each choice's sequence prefills the prompt (Engine.prefilled_tokens)
                started.add(index)
                self._online_prefilled += prompt_tokens
            self._online_generated += tokens
            listener.piece(index, text, tokens, finish_reason)

        return piece

    def _abort(self, request_ids: list[str]) -> None:
        wanted = set(request_ids)
        self._held = deque(held for held in self._held if held[0] not in wanted)  # never reached the engine
        ids = [rid for rid in request_ids if rid in self._owners]
        for rid in ids:
            self._left(self._owners.pop(rid))
            self._online_started.pop(rid, None)
        if not ids:
            return
        abort = getattr(self._engine, "abort", None)
        if callable(abort):
            abort(ids)
        else:  # replicas: only batch requests are in it
            self._engine.abort_unfinished()

    def _left(self, listener: Listener | None) -> None:
        """A request left the engine (finished or aborted): its seat is free."""
        if listener is None:
            self._batch_in_engine -= 1
        else:
            self._online_in_flight -= 1

    def _route(self, finished: list[Completion]) -> None:
        for completion in finished:
            if completion.request_id not in self._owners:
                continue  # aborted
            listener = self._owners.pop(completion.request_id)
            self._left(listener)
            if listener is None:
                self._batch_done.put(completion)
                continue
            started = len(self._online_started.pop(completion.request_id, ()))
            # the choices no piece came from before the end
            self._online_prefilled += completion.prompt_tokens * max(len(completion.lengths) - started, 0)
            if self._watch is None:
                self._online_generated += completion.completion_tokens
            self._online_cached += completion.cached_tokens
            listener.done(completion)
