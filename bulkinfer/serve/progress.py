"""Live ``request_counts`` of a running batch: a thread that counts the
finished lines of the run's spools (see :mod:`bulkinfer.jobs.output_files`)
every ``interval`` seconds and writes them, and the completion tokens/s
since the engine was ready, to the store; and :class:`RowTally`, which counts
them (and their tokens).

Spools only grow while a run holds them (one complete line per finished
row), so each file is read from where the last count stopped: the cost is
the bytes written since, not the spool's size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.io.records import parse_output
from bulkinfer.io.spool import spool_line
from bulkinfer.jobs.output_files import OutputFiles
from bulkinfer.serve.store import Store


class RowTally:
    """The finished rows of a JSONL file that only grows (a spool, or a
    published output or errors file): its complete lines (ending in a
    newline), and the prompt and completion tokens of the completed rows
    among them (an error record has none). Each :meth:`read` starts where
    the last one stopped; all 0 while the file is missing."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self.rows = self.prompt_tokens = self.completion_tokens = 0

    def read(self) -> RowTally:
        """Count what was added since the last read; returns ``self``."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self
        end = data.rfind(b"\n") + 1  # a torn last line counts once it is whole
        for raw in data[:end].splitlines():
            if text := raw.strip():
                self.rows += 1
                self._add_tokens(text)
        self.offset += end
        return self

    def _add_tokens(self, text: bytes) -> None:
        try:
            row = parse_output(orjson.loads(spool_line(text)[1]))
        except (ValueError, TypeError, AttributeError):  # not JSON, or not an object: a row whose tokens are unknown
            return
        if row is not None:
            self.prompt_tokens += row.prompt_tokens
            self.completion_tokens += row.completion_tokens


class LiveCounts(threading.Thread):
    """Writes ``request_counts`` (``{"total", "completed", "failed"}``) and
    ``throughput`` of batch ``batch_id`` (run into ``out``) to ``store`` every
    ``interval`` seconds until :meth:`finish`. ``total`` is the validated
    number of requests; ``throughput`` is :func:`live_throughput` of the
    completion tokens of the rows finished since this thread was made, or
    since :meth:`engine_ready` (a resumed run's earlier rows are not counted),
    over the seconds since then (``clock``: seconds)."""

    def __init__(
        self,
        store: Store,
        batch_id: str,
        out: Path,
        total: int,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(name=f"bulkinfer-counts-{batch_id}", daemon=True)
        files = OutputFiles(out)
        self.store, self.batch_id, self.total, self.interval, self.clock = store, batch_id, total, interval, clock
        self.completed, self.failed = RowTally(files.spool).read(), RowTally(files.errors_spool)
        self._since = (clock(), self.completed.completion_tokens)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.tick()

    def tick(self) -> None:
        """Count what finished since the last tick and write it to the store."""
        counts = {"total": self.total, "completed": self.completed.read().rows, "failed": self.failed.read().rows}
        started, tokens = self._since
        rate = (self.completed.completion_tokens - tokens) / max(self.clock() - started, 1e-9)
        self.store.update(self.batch_id, request_counts=counts, throughput=live_throughput(rate))

    def engine_ready(self) -> None:
        """The run's engine is up (the server's first batch waits for the
        model to load): the rate counts from now."""
        self._since = (self.clock(), self.completed.completion_tokens)

    def finish(self) -> None:
        """Stop counting; returns once no further write can come."""
        self._done.set()
        if self.is_alive():
            self.join()


def live_throughput(completion_tokens_per_s: float) -> dict[str, Any]:
    """A batch's ``throughput`` column measured while it runs (see :class:`LiveCounts`)."""
    return {"completion_tokens_per_s": completion_tokens_per_s, "measured": "live"}


def report_throughput(report: dict[str, Any]) -> dict[str, Any]:
    """A batch's ``throughput`` column from its run's report: completion
    tokens/s over the generation seconds of the rows the last attempt ran."""
    rate = float(report.get("throughput", {}).get("completion_tokens_per_s", 0.0))
    return {"completion_tokens_per_s": rate, "measured": "report"}
