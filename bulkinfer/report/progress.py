"""Progress: a rich bar on a terminal, plain timestamped lines elsewhere.

Under cron or a pipe there is no terminal: one line every
:data:`PLAIN_INTERVAL_S` seconds (``BULKINFER_PROGRESS_INTERVAL_S`` overrides
it) on stderr, no ANSI codes, e.g. ``2026-11-22T20:41:07 bulkinfer: 120/300
rows (2 failed), 402.5 tok/s, 231.4 completion tok/s, eta 0:01:10 (run ~240.2
completion tok/s)`` (one line).

The first tokens/s counts the prompt and completion tokens the engine
processed, the second the completion tokens generated, of finished and
unfinished rows alike (the engine streams them), over the time since
generation started: the figures the report ends with. The ETA is the time the
tokens left take at the rate measured (:class:`WorkEstimate`), not rows left
over rows done: under continuous batching hundreds of rows run at once and
few finish early on.

After the ETA, ``run ~N completion tok/s`` is the run's expected final
figure: the completion tokens generated and left over the time so far and
the ETA. The figure so far cannot be that: a run's first steps prefill
(vLLM's 4,096-token steps took ~10 s each on a 2-core CPU, and 300 ShareGPT
rows made almost no completion tokens in their first 100 s, then decoded at
1.45x the run's mean). Replayed on two recorded runs (``python -m
bench.eta_trace rates``; first runs, every 10 s from 20 s on), the figure
so far was 100% (ShareGPT) and 97% (1,000 short questions) short at 20 s;
the expected one was within 23% and 35% all along.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from typing import IO, Any

from bulkinfer.engine.log import terminal
from bulkinfer.report.calibration import LengthPrior
from bulkinfer.report.eta import WorkEstimate

PLAIN_INTERVAL_S = 10.0
# No ETA before this much generation time (seconds).
ETA_AFTER_S = 2.0


class Progress:
    """Tracks rows done and tokens generated; shows them as fits the stream.

    Args:
        total: expected rows (an estimate; None when unknown).
        stream: where to show progress (the terminal's stderr by default, also
            while the engine's log captures file descriptor 2).
        force_plain: plain lines even on a terminal.
        task: what is counted, shown before the rows (``generating``; the
            eval's perplexity pass shows ``perplexity``).
        tokens: which tokens the tokens/s counts (``completion``, or
            ``reference`` for the perplexity pass).
        clock: seconds, monotonic (tests pass a fake one).
        prior, max_running: for the ETA, see :class:`WorkEstimate` (an
            earlier run's completion lengths, and whether it was this job).
    """

    def __init__(
        self,
        total: int | None,
        stream: IO[str] | None = None,
        force_plain: bool = False,
        task: str = "generating",
        tokens: str = "completion",
        clock: Callable[[], float] = time.monotonic,
        prior: LengthPrior | None = None,
        max_running: int | None = None,
    ):
        self.total = total
        self.task, self.tokens = task, tokens
        self.stream = stream or terminal()
        self.clock = clock
        self.done = 0
        self.failed = 0
        self.completion_tokens = 0
        self._failed_unplanned = 0
        self._start = clock()
        lengths, same_job = prior or LengthPrior([], same_job=False)
        self.work = WorkEstimate(self._start, lengths, max_running, same_job=same_job)
        self._last_line = self._start
        self._interval = _plain_interval()
        # (when, ETA s, expected final completion tok/s): computed at most once a second
        self._outlook: tuple[float, float | None, float | None] = (-1.0, None, None)
        self._bar: Any = None
        self._task: Any = None
        if not force_plain and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn(f"[bold]{task}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                TextColumn("{task.fields[tps]}"),
                TextColumn("eta {task.fields[eta]}"),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._bar.add_task("generate", total=total, tps="", eta="-:--:--")
            self._bar.start()

    def elapsed(self) -> float:
        return self.clock() - self._start

    def tokens_per_s(self) -> float:
        """Tokens generated so far (finished rows or, once :meth:`tick` is
        called, the engine's live count) per second since the start."""
        elapsed = self.elapsed()
        tokens = max(self.completion_tokens, self.work.generated_tokens)
        return tokens / elapsed if elapsed > 0 else 0.0

    def total_tokens_per_s(self) -> float | None:
        """Prompt and completion tokens the engine processed per second since
        the start (the report's ``total_tokens_per_s``); None without live
        engine counts."""
        elapsed = self.elapsed()
        if not self.work.done or elapsed <= 0:
            return None
        return self.work.done / elapsed

    def eta_s(self) -> float | None:
        """Seconds left (see :class:`WorkEstimate`; recomputed at most once a
        second); None before :data:`ETA_AFTER_S` seconds or before any tokens
        were timed. Without live engine counts (no :meth:`tick`: the
        perplexity pass), rows left over the rate of rows done."""
        return self._outlook_now()[0]

    def expected_tokens_per_s(self) -> float | None:
        """The completion tokens/s the run is expected to end with: the
        tokens generated and the tokens left (:meth:`WorkEstimate.remaining_tokens`)
        over the seconds so far and the ETA; None without an ETA from live
        engine counts (see the module docstring)."""
        return self._outlook_now()[1]

    def _outlook_now(self) -> tuple[float | None, float | None]:
        now = self.clock()
        if now - self._outlook[0] >= 1.0:
            self._outlook = (now, *self._compute_outlook())
        return self._outlook[1], self._outlook[2]

    def _compute_outlook(self) -> tuple[float | None, float | None]:
        elapsed = self.elapsed()
        if elapsed < ETA_AFTER_S or not self.total:
            return None, None
        if self.work.planned_rows:
            eta = self.work.eta_s(self.total, self._failed_unplanned)
            if eta is None:
                return None, None
            _, completion_left = self.work.remaining_tokens(self.total, self._failed_unplanned)
            return eta, (self.work.generated_tokens + completion_left) / (elapsed + eta)
        if self.done >= max(1, self.total // 20):  # rows finish in bursts: not from the first few
            return max(self.total - self.done, 0) * elapsed / self.done, None
        return None, None

    def planned(self, prompt_tokens: int, max_tokens: int) -> None:
        """A row was planned (see :meth:`WorkEstimate.plan`)."""
        self.work.plan(prompt_tokens, max_tokens)

    def update(self, done: int = 0, failed: int = 0, completion_tokens: int = 0, planned: bool = True) -> None:
        """Rows ended: ``done`` completed with ``completion_tokens`` in all
        (one row: its length, which the ETA learns from), ``failed`` failed;
        ``planned``: they ended after they were planned (a row that fails
        reading or planning is not)."""
        self.done += done + failed
        self.failed += failed
        self.completion_tokens += completion_tokens
        if not planned:
            self._failed_unplanned += failed
        elif done == 1 and not failed:
            self.work.finish(completion_tokens)
        else:
            for _ in range(done + failed):
                self.work.finish(None)
        self._show()

    def tick(self, generated_tokens: int, prefilled_tokens: int, running: list[int]) -> None:
        """The engine's live counts after a step (see :meth:`WorkEstimate.observe`)."""
        self.work.observe(self.clock(), generated_tokens, prefilled_tokens, running)
        self._show()

    def _show(self) -> None:
        if self._bar is not None:
            # 80 columns: the completion figures only, the ETA without them
            eta, expected = self._outlook_now()
            tps = f"{self.tokens_per_s():.1f} {self.tokens} tok/s"
            tps += "" if expected is None else f", run ~{expected:.1f}"
            self._bar.update(
                self._task,
                completed=self.done,
                tps=tps,
                eta="-:--:--" if eta is None else dt.timedelta(seconds=round(eta)),
            )
            return
        now = self.clock()
        if now - self._last_line >= self._interval:
            self._last_line = now
            self._plain_line()

    def _rates(self) -> str:
        total = self.total_tokens_per_s()
        rates = "" if total is None else f"{total:.1f} tok/s, "
        return rates + f"{self.tokens_per_s():.1f} {self.tokens} tok/s"

    def _plain_line(self) -> None:
        stamp = dt.datetime.now().isoformat(timespec="seconds")
        of = f"/{self.total}" if self.total else ""
        task = "" if self.task == "generating" else f"{self.task}: "
        line = f"{stamp} bulkinfer: {task}{self.done}{of} rows ({self.failed} failed)"
        line += f", {self._rates()}"
        eta = self._eta_text()
        if eta:
            line += f", eta {eta}"
        print(line, file=self.stream, flush=True)

    def _eta_text(self) -> str:
        """``H:MM:SS`` left and the run's expected completion tokens/s, e.g.
        ``0:01:10 (run ~117.8 completion tok/s)``; empty without an ETA."""
        eta, expected = self._outlook_now()
        if eta is None:
            return ""
        text = str(dt.timedelta(seconds=round(eta)))
        return text if expected is None else f"{text} (run ~{expected:.1f} {self.tokens} tok/s)"

    def close(self) -> None:
        """Stop the bar (or print the last plain line); a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._outlook = (-1.0, None, None)  # the last line's ETA is of now
        if self._bar is not None:
            self._bar.stop()
        else:
            self._plain_line()


def _plain_interval() -> float:
    """Seconds between plain progress lines: ``BULKINFER_PROGRESS_INTERVAL_S``, else :data:`PLAIN_INTERVAL_S`."""
    try:
        return max(float(os.environ.get("BULKINFER_PROGRESS_INTERVAL_S", PLAIN_INTERVAL_S)), 0.1)
    except ValueError:
        return PLAIN_INTERVAL_S
