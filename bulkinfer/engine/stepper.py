"""The engine's own thread (:class:`Stepper`): vLLM's ``step()`` runs there so
the caller can wait for it with a timeout."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

# While waiting for an engine step, the engine's processes are checked this often (seconds).
LIVENESS_INTERVAL_S = 0.2


class Stepper:
    """The engine's own thread: runs the engine's ``step()`` (and, for an
    engine in this process, its start, see :meth:`call`), so the caller can
    wait for it with a timeout (vLLM's synchronous client blocks forever when
    its engine core process dies: its output thread exits without a word)."""

    def __init__(self, notify: threading.Event | None = None):
        self.step: Callable[[], Any] = lambda: []
        self._notify = notify
        self._go: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.running_since: float | None = None
        threading.Thread(target=self._loop, name="bulkinfer-engine-step", daemon=True).start()

    def _loop(self) -> None:
        while (work := self._go.get()) is not None:
            try:
                self._done.put((work(), None))
            except BaseException as exc:  # handed to the caller's thread
                self._done.put((None, exc))
            if self._notify is not None:
                self._notify.set()

    def call(self, work: Callable[[], Any]) -> Any:
        """``work()`` run in this thread, its result or its exception here.
        vLLM binds the OpenMP threads of the thread that starts a CPU worker
        to the cores: an engine in this process must start in the thread
        that runs its steps (started elsewhere, its steps ran 8% slower)."""
        self._go.put(work)
        while (outcome := self.result(LIVENESS_INTERVAL_S)) is None:
            pass
        value, error = outcome
        if error is not None:
            raise error
        return value

    def start(self) -> None:
        if self.running_since is None:
            self.running_since = time.monotonic()
            self._go.put(self.step)

    def result(self, timeout: float) -> tuple[Any, BaseException | None] | None:
        """The running step's (outputs, error), or None if it is still running after ``timeout`` s."""
        try:
            outcome = self._done.get(timeout=timeout)
        except queue.Empty:
            return None
        self.running_since = None
        return outcome

    def stop(self) -> None:
        self._go.put(None)
