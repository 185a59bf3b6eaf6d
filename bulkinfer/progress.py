"""Progress: a rich bar on a terminal, plain timestamped lines elsewhere.

Under cron or a pipe there is no terminal: one line every
:data:`PLAIN_INTERVAL_S` seconds on stderr, no ANSI codes, e.g.
``2026-11-22T20:41:07 bulkinfer: 120/300 rows (2 failed), 231.4 completion tok/s, eta 0:01:10``.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from typing import IO, Any

PLAIN_INTERVAL_S = 10.0


class Progress:
    """Tracks rows done and completion tokens; shows them as fits the stream.

    Args:
        total: expected rows (an estimate; None when unknown).
        stream: where to show progress (stderr by default).
        force_plain: plain lines even on a terminal.
        task: what is counted, shown before the rows (``generating``; the
            eval's perplexity pass shows ``perplexity``).
        tokens: which tokens the tokens/s counts (``completion``, or
            ``reference`` for the perplexity pass).
    """

    def __init__(
        self,
        total: int | None,
        stream: IO[str] | None = None,
        force_plain: bool = False,
        task: str = "generating",
        tokens: str = "completion",
    ):
        self.total = total
        self.task, self.tokens = task, tokens
        self.stream = stream or sys.stderr
        self.done = 0
        self.failed = 0
        self.completion_tokens = 0
        self._start = time.monotonic()
        self._last_line = self._start
        self._bar: Any = None
        self._task: Any = None
        if not force_plain and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn(f"[bold]{task}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                TextColumn("{task.fields[tps]:.1f} tok/s"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._bar.add_task("generate", total=total, tps=0.0)
            self._bar.start()

    def tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self._start
        return self.completion_tokens / elapsed if elapsed > 0 else 0.0

    def update(self, done: int = 0, failed: int = 0, completion_tokens: int = 0) -> None:
        self.done += done + failed
        self.failed += failed
        self.completion_tokens += completion_tokens
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, tps=self.tokens_per_s())
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_INTERVAL_S:
            self._last_line = now
            self._plain_line()

    def _plain_line(self) -> None:
        stamp = dt.datetime.now().isoformat(timespec="seconds")
        of = f"/{self.total}" if self.total else ""
        task = "" if self.task == "generating" else f"{self.task}: "
        line = f"{stamp} bulkinfer: {task}{self.done}{of} rows ({self.failed} failed)"
        line += f", {self.tokens_per_s():.1f} {self.tokens} tok/s"
        elapsed = time.monotonic() - self._start
        # rows finish in bursts under continuous batching: no ETA from the first few
        if self.total and self.done >= max(1, self.total // 20):
            remaining = max(self.total - self.done, 0) * elapsed / self.done
            line += f", eta {dt.timedelta(seconds=round(remaining))}"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the bar (or print the last plain line); a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self._bar is not None:
            self._bar.stop()
        else:
            self._plain_line()
