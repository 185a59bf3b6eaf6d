"""A stop token: how a caller asks a running job to stop, from any thread.

The core never installs signal handlers (it may run in a server's worker
thread or a Ray actor): the CLI turns SIGINT, SIGTERM and SIGHUP into
:meth:`StopToken.stop` calls (see :mod:`bulkinfer.cli`), a server or a test
calls it directly. The job checks the token between engine steps; once
set, it adds no new request, flushes what finished and raises
:class:`~bulkinfer.errors.Interrupted`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bulkinfer.errors import Interrupted


class StopToken:
    """Set once (the first reason wins); read by the job's feed loop.

    ``starting`` is True while the job has nothing to flush (model load,
    engine start); the job sets it to False when it starts feeding rows. A
    signal handler may then stop at once instead of asking. So it may while
    ``writing`` (:meth:`blocking_write`): a write to a reader that does not
    read would block the stop forever.

    ``load_deadline`` (:func:`time.monotonic` seconds, or None) is when the
    job's model load and engine start, under :meth:`loading`, count as
    stuck; whoever owns the process enforces it (the CLI:
    :class:`bulkinfer.cli.signals.StopSignals`), the job only states it.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.signum: int | None = None
        self.starting = True
        self.writing = False
        self.load_deadline: float | None = None
        self.load_timeout_s: float | None = None

    @contextmanager
    def loading(self, timeout_s: float | None) -> Iterator[None]:
        """The ``with`` body is the job's model load and engine start, which
        may take ``timeout_s`` seconds (None: no limit)."""
        self.load_timeout_s = timeout_s
        self.load_deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            yield
        finally:
            self.load_deadline = None

    @contextmanager
    def blocking_write(self) -> Iterator[None]:
        """The ``with`` body writes to a pipe whose reader may not read (a
        stream's standard output): :attr:`writing` while it runs."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False

    def stop(self, reason: str = "stopped", signum: int | None = None) -> None:
        """Ask the job to stop; ``signum``: the signal that asked (sets the exit code 128 + N)."""
        if not self._event.is_set():
            self.reason, self.signum = reason, signum
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def interrupted(self, detail: str) -> Interrupted:
        """The :class:`Interrupted` error that ends a stopped job, with ``detail`` (what was kept)."""
        return Interrupted(self.signum, f"{self.reason}: {detail}")
