"""Watching a running batch from threads of their own, so that the run's
thread never waits on the database: :class:`LiveCounts` observes the batch's
run (a :class:`~bulkinfer.jobs.context.RunObserver`: rows finished and their
tokens, engine ready) and writes its live ``request_counts`` and
``throughput`` to the store every ``interval`` seconds; :class:`ExpiryWatch`
stops the run once the batch is past its ``expires_at``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from bulkinfer.jobs.context import RunObserver
from bulkinfer.report.model import RunReport
from bulkinfer.serve.store import Store, now
from bulkinfer.stop import StopToken

EXPIRED = "expired"  # the stop reason of a run past its batch's expires_at
EXPIRY_POLL_S = 1.0  # a running batch's expires_at is read this often (seconds): a changed one counts


class LiveCounts(RunObserver):
    """Writes ``request_counts`` (``{"total", "completed", "failed"}``) and
    ``throughput`` of batch ``batch_id`` to ``store`` every ``interval``
    seconds until :meth:`finish`. ``total`` is the validated number of
    requests; the counts include the rows an interrupted attempt finished
    (:meth:`started`); ``throughput`` is :func:`live_throughput` of the
    completion tokens of the rows finished since :meth:`engine_ready` (or
    since this object was made) over the seconds since then (``clock``: seconds)."""

    def __init__(
        self,
        store: Store,
        batch_id: str,
        total: int,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._thread = threading.Thread(
            target=self._write_until_finished, name=f"bulkinfer-counts-{batch_id}", daemon=True
        )
        self.store, self.batch_id, self.total, self.interval, self.clock = store, batch_id, total, interval, clock
        self.completed = self.failed = self.completion_tokens = 0
        self._lock = threading.Lock()
        self._since = (clock(), 0)  # (when the rate counts from, completion tokens then)
        self._done = threading.Event()

    # RunObserver: called from the run's thread

    def started(self, resumed_completed: int, resumed_failed: int) -> None:
        with self._lock:
            self.completed, self.failed = resumed_completed, resumed_failed

    def engine_ready(self) -> None:
        """The run's engine is up (the server's first batch waits for the
        model to load): the rate counts from now."""
        with self._lock:
            self._since = (self.clock(), self.completion_tokens)

    def rows_finished(self, completed: int, failed: int, completion_tokens: int) -> None:
        with self._lock:
            self.completed += completed
            self.failed += failed
            self.completion_tokens += completion_tokens

    # the thread

    def start(self) -> None:
        """Start writing the counts every ``interval`` seconds."""
        self._thread.start()

    def _write_until_finished(self) -> None:
        while not self._done.wait(self.interval):
            with contextlib.suppress(sqlite3.Error, OSError):  # a full disk: the next tick writes them
                self.tick()

    def tick(self) -> None:
        """Write the counts so far to the store."""
        with self._lock:
            counts = {"total": self.total, "completed": self.completed, "failed": self.failed}
            started, tokens = self._since
            rate = (self.completion_tokens - tokens) / max(self.clock() - started, 1e-9)
        self.store.update(self.batch_id, request_counts=counts, throughput=live_throughput(rate))

    def finish(self) -> None:
        """Stop counting; returns once no further write can come."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def live_throughput(completion_tokens_per_s: float) -> dict[str, Any]:
    """A batch's ``throughput`` column measured while it runs (see :class:`LiveCounts`)."""
    return {"completion_tokens_per_s": completion_tokens_per_s, "measured": "live"}


def report_throughput(report: RunReport) -> dict[str, Any]:
    """A batch's ``throughput`` column from its run's report: completion
    tokens/s over the generation seconds of the rows the last attempt ran."""
    return {"completion_tokens_per_s": report.throughput.completion_tokens_per_s, "measured": "report"}


class ExpiryWatch(threading.Thread):
    """Stops a running batch's run (reason :data:`EXPIRED`) once the time
    passes its ``expires_at``, read from the store every :data:`EXPIRY_POLL_S`."""

    def __init__(self, store: Store, batch_id: str, token: StopToken):
        super().__init__(name="bulkinfer-batch-expiry", daemon=True)
        self.store, self.batch_id, self.token = store, batch_id, token
        self._closed = threading.Event()

    def run(self) -> None:
        while not self._closed.wait(EXPIRY_POLL_S):
            batch = self.store.batch(None, self.batch_id)
            if batch is not None and batch["expires_at"] is not None and now() > batch["expires_at"]:
                self.token.stop(EXPIRED)
                return

    def close(self) -> None:
        self._closed.set()
