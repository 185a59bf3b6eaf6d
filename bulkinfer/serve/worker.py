"""The worker: one thread that runs queued batches one after another (FIFO
by creation) through :func:`bulkinfer.jobs.run.run`, the same core as
``bulkinfer run``, on one warm engine (:class:`~bulkinfer.engine.base.KeptEngine`:
the model loads once per server).

A batch's run writes ``DATA/batches/BATCH_ID/output.jsonl`` and its
siblings (errors, report, spools, journal; see
:mod:`bulkinfer.io.output_files`). Lifecycle: ``validating`` (the input
is checked, :mod:`bulkinfer.serve.validate`) -> ``in_progress`` (the run)
(``request_counts`` updated each second from the run's observer,
:mod:`bulkinfer.serve.progress`)
-> ``finalizing`` (output and errors registered as files; ``usage``: the
report's tokens) -> ``completed``;
or ``failed`` (bad input, engine failure), ``expired`` (past ``expires_at``,
its ``completion_window`` from creation: picked up late, or stopped while it
runs; the rows finished so far are published, and every request not
finished is in the errors file with code ``batch_expired``, as OpenAI's),
``cancelling`` -> ``cancelled`` (the rows finished so far are published as
the output and errors files, ``usage`` counted from them).

At start, batches left ``in_progress`` or ``finalizing`` by a killed server
run again first with ``resume=True`` (the journal and spools keep what
finished: every ``custom_id`` ends exactly once); ``cancelling`` ones are
cancelled with what they finished.

The engine starts with the server (vLLM's priority scheduling on) and is
shared by the running batch and online requests
(:class:`~bulkinfer.engine.mux.EngineMux`; :attr:`BatchWorker.online`, None
while no engine is ready). An embedding model's server runs embedding
batches and requests (:mod:`bulkinfer.serve.served`); a batch for an
endpoint its model does not serve (left by a server of another model) fails.

The engine comes back: when it dies (:class:`EngineError`, during a batch or
between batches), the worker closes it, waits :data:`ENGINE_RESTART_DELAYS_S`,
starts a new one and resumes the batch from its journal; after that many
deaths in a row the batch fails (``engine_failed``) and the next batch tries
a new engine again. :attr:`BatchWorker.health` is ``starting`` while an
engine starts (or waits to), ``ready`` otherwise, ``failed`` after the last
restart failed.

A full disk (the run's files or the state database) stalls, never ends, the
worker: the batch keeps its status, the worker waits :data:`STALL_DELAYS_S`
and resumes it from its journal (:meth:`BatchWorker._stalled`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import orjson

from bulkinfer.config import Settings, with_engine
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.base import Engine, EngineFactory, KeptEngine
from bulkinfer.engine.mux import EngineMux, online_first_args
from bulkinfer.errors import BulkinferError, EngineError, Interrupted, disk_full, write_reason
from bulkinfer.io.inputs import InputScan
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.engine_choice import choose_engine_settings
from bulkinfer.jobs.online import Online
from bulkinfer.jobs.run import run
from bulkinfer.models import TokenizerFactory, load_tokenizer, resolve_model
from bulkinfer.serve.access import ACCESS_LOGGER, iso_now
from bulkinfer.serve.objects import finished_columns
from bulkinfer.serve.progress import EXPIRED, ExpiryWatch, LiveCounts
from bulkinfer.serve.publish import Publisher
from bulkinfer.serve.served import Served, served
from bulkinfer.serve.store import Store, now
from bulkinfer.serve.validate import MAX_LINES, batch_error, validate_input
from bulkinfer.stop import StopToken

log = logging.getLogger(ACCESS_LOGGER)

RESUMABLE = ("in_progress", "finalizing")
# Seconds before each new engine after an engine death; one more death in a row fails the batch.
ENGINE_RESTART_DELAYS_S = (2.0, 10.0, 30.0)
# Seconds the worker waits before it tries a batch again when the disk (or the state database) could
# not be written: the batch stays where it was and resumes from its journal; the last delay repeats.
STALL_DELAYS_S = (10.0, 30.0, 60.0, 300.0)


class Runner(Protocol):
    """What the API asks of whoever runs batches."""

    def submit(self, batch_id: str) -> None:
        """A new ``validating`` batch is queued."""

    def cancel(self, batch_id: str) -> None:
        """The batch was moved to ``cancelling``: stop it, or cancel it if it is not running."""

    @property
    def health(self) -> str:
        """``starting``, ``ready`` or ``failed`` (see :class:`BatchWorker`)."""

    @property
    def online(self) -> Online | None:
        """Where online requests go, or None while no engine is ready."""


class BatchWorker(threading.Thread):
    """Runs the store's queued batches, one at a time, in a daemon thread.

    ``engine_factory`` and ``tokenizer_factory`` as for :func:`run` (tests
    give fakes); the engine is made once and kept until :meth:`close`.
    ``online_seats`` and ``beside_online`` (``batch_beside_online``,
    ``prefill_beside_online``): how the engine is shared with online
    requests (see :class:`~bulkinfer.engine.mux.EngineMux`). ``model``:
    what ``settings.model`` serves (default: :func:`~bulkinfer.serve.served.served` finds it).
    """

    def __init__(
        self,
        store: Store,
        settings: Settings,
        engine_factory: EngineFactory,
        tokenizer_factory: TokenizerFactory = load_tokenizer,
        max_lines: int = MAX_LINES,
        online_seats: int = 0,
        beside_online: tuple[int | None, int | None] = (None, None),
        model: Served | None = None,
    ):
        super().__init__(name="bulkinfer-batch-worker", daemon=True)
        self.served = model or served(settings.model)
        self.store, self.settings, self.max_lines = store, self.served.settings(settings), max_lines
        self._online_seats, self._beside_online = online_seats, beside_online
        self._health = "starting"
        self._deaths = 0  # engine deaths in a row
        self._stalls = 0  # batches in a row that could not be written (see _stalled)
        self._online: Online | None = None
        self.engine = KeptEngine(self._watched(self._muxed(engine_factory)))
        self.tokenizer_factory = tokenizer_factory
        self._tokenizer: tuple[str, Any] | None = None  # (model, its tokenizer), loaded once
        self._wake = threading.Condition()
        self._closing = False
        self._running: tuple[str, StopToken] | None = None
        self.publisher = Publisher(store, self.settings.plan.file_output_order)

    # Runner

    def submit(self, batch_id: str) -> None:
        with self._wake:
            self._wake.notify()

    def cancel(self, batch_id: str) -> None:
        with self._wake:
            if self._running is not None and self._running[0] == batch_id:
                self._running[1].stop("cancelled")
                return
        self._publish_cancelled(batch_id)  # not running: nothing can move it but us

    @property
    def health(self) -> str:
        if self._health == "ready" and self._dead() is not None:  # dead, and the worker has not yet noticed
            return "starting"
        return self._health

    @property
    def online(self) -> Online | None:
        online = self._online
        if online is None or online.mux.dead is not None or self._health != "ready":
            return None
        return online

    def _muxed(self, factory: EngineFactory) -> EngineFactory:
        """``factory``, its engine behind an :class:`EngineMux` that online requests share
        (:attr:`online`); a death wakes the worker, which restarts it."""

        def start(model_path: str, settings: Settings) -> Engine:
            engine = factory(model_path, settings)
            mux = EngineMux(engine, self._poke, self._online_seats, *self._beside_online)
            try:
                if self._tokenizer is None or self._tokenizer[0] != model_path:
                    trust = settings.engine.trust_remote_code
                    self._tokenizer = (model_path, self.tokenizer_factory(model_path, trust))
                name = self.settings.model or DEFAULT_MODEL
                self._online = self.served.online(mux, self._tokenizer[1], settings, model_path, name)
            except BaseException:
                mux.close()
                raise
            return mux

        return start

    def _poke(self) -> None:
        """Wake the worker (the engine died: it restarts it)."""
        with self._wake:
            self._wake.notify()

    def _start_engine(self) -> None:
        """Start the engine now (server start, after a death), with what a
        batch would choose for this machine and vLLM's priority scheduling
        (online requests go first).

        Raises:
            BulkinferError: the model is missing or the engine fails to start.
        """
        model = resolve_model(self.settings.model)
        scan = InputScan(None, mentions_priority=True)
        chosen, _ = choose_engine_settings(model, self.settings, scan, self.served.job.calibrate, False)
        self.engine.get(model, self._online_first(chosen))

    def _online_first(self, settings: Settings) -> Settings:
        """``settings`` with the scheduler that pauses running batch rows past
        ``batch_beside_online`` while an online request is in flight (see
        :func:`~bulkinfer.engine.mux.online_first_args`); unchanged when no
        bound is set, the model embeds (no decode steps to share), or the
        user chose a ``scheduler_cls``."""
        beside = self._beside_online[0]
        extra = settings.engine.extra_args
        if beside is None or self.served.embeds or "scheduler_cls" in extra:
            return settings
        args = online_first_args(beside)
        args["additional_config"] = {**extra.get("additional_config", {}), **args["additional_config"]}
        return with_engine(settings, extra_args={**extra, **args})

    def _watched(self, factory: EngineFactory) -> EngineFactory:
        """``factory``, with :attr:`health` ``starting`` while it makes an engine, then ``ready``."""

        def start(model_path: str, settings: Any) -> Any:
            self._health = "starting"
            engine = factory(model_path, settings)
            self._health = "ready"
            return engine

        return start

    # the thread

    def close(self, timeout: float | None = None) -> None:
        """Stop the running batch (it stays ``in_progress``: resumed at the
        next start), end the thread, close the engine."""
        with self._wake:
            self._closing = True
            if self._running is not None:
                self._running[1].stop("server shutting down")
            self._wake.notify()
        if self.is_alive():
            self.join(timeout)
        self.engine.close()

    def run(self) -> None:
        try:
            for left in self.store.by_status("cancelling"):
                self._publish_cancelled(left["id"])
        except Exception as exc:  # noqa: BLE001 (the disk is full: they are published once it is not)
            self._stalled(None, exc)
        try:
            self._start_engine()
        except BulkinferError as exc:
            self._engine_died(None, exc)
        while True:
            with self._wake:
                batch = self._next()
                while batch is None and not self._closing and self._dead() is None:
                    self._wake.wait()
                    batch = self._next()
                if self._closing:
                    return
                dead = self._dead()
                if batch is None and dead is not None:  # it died serving online requests
                    self._running = None
                else:
                    assert batch is not None
                    token = StopToken()
                    self._running = (batch["id"], token)
            if batch is None:
                assert dead is not None
                self._engine_died(None, dead)
                continue
            try:
                try:
                    self._run_batch(batch, token)
                except Exception as exc:  # a bug or an OSError must not end the worker: the batch fails
                    if disk_full(exc):
                        raise
                    error = batch_error("server_error", f"{type(exc).__name__}: {exc}")
                    self.store.move(batch["id"], ("validating", *RESUMABLE), "failed", errors=[error])
                finally:
                    with self._wake:
                        self._running = None
                self._publish_cancelled(batch["id"])  # cancelled while it ran (or before it started)
                self._stalls = 0
            except Exception as exc:  # noqa: BLE001 (nothing can be written: wait, then try it again)
                self._stalled(batch["id"], exc)

    def _stalled(self, batch_id: str | None, exc: BaseException) -> None:
        """The disk or the state database could not be written (a full disk):
        log it (a JSON line on the access log) and wait the next of
        :data:`STALL_DELAYS_S`; the batch keeps its status, so the loop tries
        it again (resuming from its journal) once the disk has room."""
        self._stalls += 1
        delay = STALL_DELAYS_S[min(self._stalls, len(STALL_DELAYS_S)) - 1]
        line = {"time": iso_now(), "batch": batch_id, "stalled": write_reason(exc), "retry_in_s": delay}
        log.warning(orjson.dumps(line).decode())
        with self._wake:
            if not self._closing:
                self._wake.wait(delay)

    def _dead(self) -> EngineError | None:
        """What the running engine died of, or None (alive, or none running)."""
        online = self._online
        return online.mux.dead if online is not None and self.engine.engine is not None else None

    def _next(self) -> dict[str, Any] | None:
        """The oldest resumable batch, else the oldest ``validating`` one."""
        for statuses in (RESUMABLE, ("validating",)):
            found = self.store.by_status(*statuses)
            if found:
                return found[0]
        return None

    def _run_batch(self, batch: dict[str, Any], token: StopToken) -> None:
        batch_id = batch["id"]
        resume = batch["status"] in RESUMABLE
        if resume and now() > batch["expires_at"]:  # expired while no server ran it
            self.publisher.partial(batch_id, "expired", RESUMABLE)
            return
        if batch["endpoint"] not in self.served.endpoints:
            why = f"this server's model serves {', '.join(self.served.endpoints)}, not {batch['endpoint']}"
            self.store.move(
                batch_id, ("validating", *RESUMABLE), "failed", errors=[batch_error("model_not_supported", why)]
            )
            return
        if not resume and not self._validated(batch):
            return
        paths = RunPaths.build(self.publisher.input_path(batch), self.store.batch_dir(batch_id) / "output.jsonl")
        validated = self.store.batch(None, batch_id)
        live = LiveCounts(self.store, batch_id, validated["request_counts"]["total"] if validated else 0)
        live.start()
        # the kept engine outlives the run: its output stays the server's (no file descriptor is captured)
        context = RunContext(
            resume=resume,
            stop=token,
            progress_plain=True,
            engine_factory=self.engine.for_runs(),
            tokenizer_factory=self.tokenizer_factory,
            observer=live,
        )
        watch = ExpiryWatch(self.store, batch_id, token)
        watch.start()
        try:
            result = run(paths, self.settings, context, job=self.served.job)
        except Interrupted:
            if token.reason == EXPIRED:
                self.publisher.partial(batch_id, "expired", RESUMABLE)
            # else cancelled (the caller publishes it), or shutting down (stays in_progress: resumed at start)
            return
        except EngineError as exc:
            self._engine_died(batch_id, exc)
            return
        except BulkinferError as exc:
            if disk_full(exc):
                raise  # the batch stays in progress: the worker waits, then resumes it (_stalled)
            self.store.move(
                batch_id, RESUMABLE + ("cancelling",), "failed", errors=[batch_error("run_failed", str(exc))]
            )
            return
        finally:
            watch.close()
            live.finish()  # before the final counts: no live write comes after them
        self._deaths = 0
        if self.store.move(batch_id, RESUMABLE, "finalizing", **finished_columns(result.report)):
            self.publisher.register_outputs(batch, paths, "completed", ("finalizing",))

    def _engine_died(self, batch_id: str | None, exc: BulkinferError) -> None:
        """The engine died (or failed to start), during ``batch_id``'s run or
        with none running: close it; wait the next of
        :data:`ENGINE_RESTART_DELAYS_S` and start a new one, leaving the batch
        ``in_progress`` (the loop resumes it on the new engine); after the
        last, fail the batch. Each death a JSON line on the access log."""
        while True:
            self.engine.close()
            self._deaths += 1
            delays = ENGINE_RESTART_DELAYS_S
            delay = delays[self._deaths - 1] if self._deaths <= len(delays) else None
            line = {"time": iso_now(), "engine": "died", "batch": batch_id, "deaths_in_a_row": self._deaths}
            log.warning(orjson.dumps({**line, "error": str(exc), "restart_in_s": delay}).decode())
            if delay is None:
                self._health, self._deaths = "failed", 0
                if batch_id is not None:
                    error = batch_error("engine_failed", f"the engine died {len(delays) + 1} times: {exc}")
                    self.store.move(batch_id, RESUMABLE + ("cancelling",), "failed", errors=[error])
                return
            self._health = "starting"
            with self._wake:
                if not self._closing:
                    self._wake.wait(delay)
                if self._closing:
                    return
            try:
                self._start_engine()
                return
            except BulkinferError as failed:
                exc = failed

    def _validated(self, batch: dict[str, Any]) -> bool:
        """Check the input of a ``validating`` batch; move it to ``in_progress``,
        or ``failed`` (with ``errors``), ``expired`` or (its file gone) ``failed``."""
        batch_id = batch["id"]
        if now() > batch["expires_at"]:
            self.publisher.partial(batch_id, "expired", ("validating",))
            return False
        path = self.publisher.input_path(batch)
        if not path.exists():
            error = batch_error("file_not_found", f"the input file {batch['input_file_id']} was deleted")
            self.store.move(batch_id, ("validating",), "failed", errors=[error])
            return False
        total, errors = validate_input(path, batch["endpoint"], self.max_lines)
        if errors:
            self.store.move(batch_id, ("validating",), "failed", errors=errors)
            return False
        counts = {"total": total, "completed": 0, "failed": 0}
        return self.store.move(batch_id, ("validating",), "in_progress", request_counts=counts)

    def _publish_cancelled(self, batch_id: str) -> None:
        """A ``cancelling`` batch that is not running -> ``cancelled``, with
        the rows its runs finished (if any) published as its output and errors."""
        self.publisher.partial(batch_id, "cancelled", ("cancelling",))
