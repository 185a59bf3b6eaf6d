"""Live ``request_counts`` of a running batch: a thread that counts the
finished lines of the run's spools (see :mod:`bulkinfer.jobs.output_files`)
every ``interval`` seconds and writes them to the store.

Spools only grow while a run holds them (one complete line per finished
row), so each file is read from where the last count stopped: the cost is
the bytes written since, not the spool's size.
"""

from __future__ import annotations

import threading
from pathlib import Path

from bulkinfer.jobs.output_files import OutputFiles
from bulkinfer.serve.store import Store


class LineCounter:
    """Complete lines (ending in a newline) in a file that only grows; 0 while it is missing."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.lines
        end = data.rfind(b"\n") + 1  # a torn last line counts once it is whole
        self.lines += data.count(b"\n", 0, end)
        self.offset += end
        return self.lines


class LiveCounts(threading.Thread):
    """Writes ``{"total", "completed", "failed"}`` of batch ``batch_id`` (run
    into ``out``) to ``store`` every ``interval`` seconds until :meth:`finish`.
    ``total`` is the validated number of requests."""

    def __init__(self, store: Store, batch_id: str, out: Path, total: int, interval: float = 1.0):
        super().__init__(name=f"bulkinfer-counts-{batch_id}", daemon=True)
        files = OutputFiles(out)
        self.store, self.batch_id, self.total, self.interval = store, batch_id, total, interval
        self.completed, self.failed = LineCounter(files.spool), LineCounter(files.errors_spool)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            counts = {"total": self.total, "completed": self.completed.count(), "failed": self.failed.count()}
            self.store.update(self.batch_id, request_counts=counts)

    def finish(self) -> None:
        """Stop counting; returns once no further write can come."""
        self._done.set()
        if self.is_alive():
            self.join()
