"""Progress: a rich bar on a terminal, plain timestamped lines elsewhere.

Under cron or a pipe there is no terminal: one line every
:data:`PLAIN_INTERVAL_S` seconds (``BULKINFER_PROGRESS_INTERVAL_S`` overrides
it) on stderr, no ANSI codes, e.g. ``2026-11-22T20:41:07 bulkinfer: 120/300
rows (2 failed), 402.5 tok/s, 231.4 completion tok/s, eta 0:01:02-0:01:25
(run ~240.2 completion tok/s)`` (one line).

The first tokens/s counts the prompt and completion tokens the engine
processed, the second the completion tokens generated, of finished and
unfinished rows alike (the engine streams them), over the time since
generation started: the figures the report ends with. The ETA is the time the
tokens left take at the rate measured (:class:`WorkEstimate`), not rows left
over rows done: under continuous batching hundreds of rows run at once and
few finish early on. It is a range (the 10th to 90th percentile of the
futures :meth:`WorkEstimate.outlook` draws) until the range is within
:data:`SINGLE_WITHIN` of its point, then the point alone; every estimate is
kept (:attr:`Progress.eta_trace`, the report's ``eta_trace``) so it can be
scored against the run's real end.

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
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from bulkinfer.engine.log import terminal
from bulkinfer.report.calibration import LengthPrior
from bulkinfer.report.eta import EtaRange, WorkEstimate

PLAIN_INTERVAL_S = 10.0
INTERVAL_ENV = "BULKINFER_PROGRESS_INTERVAL_S"
# No ETA before this much generation time (seconds).
ETA_AFTER_S = 2.0


# Seconds between two estimates of the ETA (see Progress._outlook_now).
OUTLOOK_EVERY_S = 5.0


# The ETA is one figure once both ends of its range are within this share of its point.
SINGLE_WITHIN = 0.1


# ETA estimates kept in the trace at most (then every other one is dropped, and
# the interval between kept estimates doubles), and the first interval (seconds).
TRACE_POINTS = 1024


TRACE_INTERVAL_S = 1.0


class Progress:
    """Tracks rows done and tokens generated; shows them as fits the stream.

    Args:
        total: expected rows (an estimate; None when unknown).
        stream: where to show progress (the terminal's stderr by default, also
            while the engine's log captures file descriptor 2).
        force_plain: plain lines even on a terminal.
        task: what is counted, shown before the rows (``generating``; the
            eval's perplexity pass shows ``perplexity``).
        tokens: which tokens the tokens/s counts (``completion``;
            ``reference`` for the perplexity pass; ``prompt`` for a job that
            generates nothing, embed and score: the prompt tokens the engine
            processed, and no expected completion tok/s after the ETA).
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
        prior = prior or LengthPrior([], same_job=False)
        self.work = WorkEstimate(
            self._start,
            prior.lengths,
            max_running,
            prior.same_job,
            prior.step_cost,
            step_cost_same_job=prior.step_cost_same_job,
        )
        self._last_line = self._start
        self._interval = _plain_interval(self.stream)
        # (when, ETA range, expected final completion tok/s): computed at most once a second
        self._outlook: tuple[float, EtaRange | None, float | None] = (-1.0, None, None)
        # [seconds since the start, low, point, high]: each ETA as it was estimated (seconds)
        self.eta_trace: list[list[float]] = []
        self._trace_interval = TRACE_INTERVAL_S
        self.ended_s: float | None = None  # seconds from the start to close()
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
        called, the engine's live count) per second since the start; with
        ``tokens="prompt"``, the prompt tokens processed so far (the engine's
        live count, as usage counts them)."""
        elapsed = self.elapsed()
        if self.tokens == "prompt":
            tokens = self.usage_prompt_tokens(self.work.prefilled_tokens)
        else:
            tokens = max(self.completion_tokens, self.work.generated_tokens)
        return tokens / elapsed if elapsed > 0 else 0.0

    def total_tokens_per_s(self) -> float | None:
        """Prompt and completion tokens the engine processed per second since
        the start, the prompt tokens as usage counts them (:meth:`usage_prompt_tokens`:
        the report's ``total_tokens_per_s``); None without live engine counts."""
        elapsed = self.elapsed()
        if not self.work.done or elapsed <= 0:
            return None
        return (self.usage_prompt_tokens(self.work.prefilled_tokens) + self.work.generated_tokens) / elapsed

    def usage_prompt_tokens(self, prefilled_tokens: int) -> int:
        """The engine's prompt tokens processed (once a sequence: a row of
        ``n`` choices prefills its prompt ``n`` times) as usage counts them,
        once a request (:meth:`~bulkinfer.report.planned.PlannedWork.usage_prompt`)."""
        return self.work.usage_prompt(prefilled_tokens)

    def eta_s(self) -> float | None:
        """Seconds left (see :class:`WorkEstimate`; recomputed at most once a
        second); None before :data:`ETA_AFTER_S` seconds or before any tokens
        were timed. Without live engine counts (no :meth:`tick`: the
        perplexity pass), rows left over the rate of rows done."""
        outlook = self._outlook_now()[0]
        return None if outlook is None else outlook.point

    def eta_range(self) -> EtaRange | None:
        """The ETA's range (see :meth:`eta_s`; low = high = point for the rows-done estimate)."""
        return self._outlook_now()[0]

    def expected_tokens_per_s(self) -> float | None:
        """The completion tokens/s the run is expected to end with: the
        tokens generated and the tokens left (:attr:`EtaRange.completion_tokens`)
        over the seconds so far and the ETA; None without an ETA from live
        engine counts (see the module docstring)."""
        return self._outlook_now()[1]

    def _outlook_now(self) -> tuple[EtaRange | None, float | None]:
        """The ETA and the expected tok/s, estimated once a second, once
        :data:`OUTLOOK_EVERY_S` seconds apart later in the run (at most
        every 5% of the time so far: drawing futures costs ~60 ms of a
        core); in between, the last estimate less the time since."""
        now = self.clock()
        then, outlook, expected = self._outlook
        if now - then >= min(OUTLOOK_EVERY_S, max(1.0, 0.05 * self.elapsed())):
            self._outlook = (now, *self._compute_outlook())
            self._trace(self._outlook[1])
            return self._outlook[1], self._outlook[2]
        if outlook is None:
            return None, expected
        since = now - then
        low, point, high = (max(v - since, 0.0) for v in (outlook.low, outlook.point, outlook.high))
        return EtaRange(low, point, high, 0.0), expected

    def _compute_outlook(self) -> tuple[EtaRange | None, float | None]:
        elapsed = self.elapsed()
        if elapsed < ETA_AFTER_S or not self.total:
            return None, None
        if self.work.planned_rows:
            outlook = self.work.outlook(self.total, self._failed_unplanned)
            if outlook is None:
                return None, None
            if self.tokens == "prompt":  # nothing generated: no completion tok/s to expect
                return outlook, None
            expected = (self.work.generated_tokens + outlook.completion_tokens) / (elapsed + outlook.point)
            return outlook, expected
        if self.done >= max(1, self.total // 20):  # rows finish in bursts: not from the first few
            left = max(self.total - self.done, 0) * elapsed / self.done
            return EtaRange(left, left, left, 0.0), None
        return None, None

    def _trace(self, outlook: EtaRange | None) -> None:
        """Keep ``outlook`` in :attr:`eta_trace` (at most :data:`TRACE_POINTS`, evenly spread)."""
        if outlook is None or self.ended_s is not None:  # the run has ended: its last line is not an estimate
            return
        at = self.elapsed()
        if self.eta_trace and at - self.eta_trace[-1][0] < self._trace_interval:
            return
        self.eta_trace.append([round(at, 2), round(outlook.low, 2), round(outlook.point, 2), round(outlook.high, 2)])
        if len(self.eta_trace) >= TRACE_POINTS:
            del self.eta_trace[1::2]
            self._trace_interval *= 2

    def planned(self, prompt_tokens: int, max_tokens: int, sequences: int = 1, choices: int = 1) -> None:
        """A row was planned (see :meth:`~bulkinfer.report.planned.PlannedWork.plan`)."""
        self.work.plan(prompt_tokens, max_tokens, sequences, choices)

    def update(
        self,
        done: int = 0,
        failed: int = 0,
        completion_tokens: int = 0,
        planned: bool = True,
        lengths: Sequence[int] = (),
        sequences: int = 1,
    ) -> None:
        """Rows ended: ``done`` completed with ``completion_tokens`` in all,
        ``failed`` failed; ``planned``: they ended after they were planned (a
        row that fails reading or planning is not). One row done: its
        sequences' lengths (``lengths``, its choices'; by default one of
        ``completion_tokens``), which the ETA learns from; rows that failed
        after planning: ``sequences`` each."""
        self.done += done + failed
        self.failed += failed
        self.completion_tokens += completion_tokens
        if not planned:
            self._failed_unplanned += failed
        elif done == 1 and not failed:
            for length in lengths or (completion_tokens,):
                self.work.finish(length)
        else:
            for _ in range((done + failed) * sequences):
                self.work.finish(None)
        self._show()

    def tick(
        self,
        generated_tokens: int,
        prefilled_tokens: int,
        running: list[int],
        cached_tokens: int = 0,
        running_prompt_tokens: int | None = None,
        ended_sequences: int = 0,
    ) -> None:
        """The engine's live counts after a step (see :meth:`WorkEstimate.observe`)."""
        self.work.observe(
            self.clock(),
            generated_tokens,
            prefilled_tokens,
            running,
            cached_tokens,
            running_prompt_tokens,
            ended_sequences,
        )
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
                eta="-:--:--" if eta is None else eta_text(eta),
            )
            return
        now = self.clock()
        if now - self._last_line >= self._interval:
            self._last_line = now
            self._plain_line()

    def _rates(self) -> str:
        if self.tokens == "prompt":  # a job that generates nothing: its total is its prompt tokens
            return f"{self.tokens_per_s():.1f} prompt tok/s"
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
        """The ETA (:func:`eta_text`) and the run's expected completion tokens/s, e.g.
        ``0:01:02-0:01:25 (run ~117.8 completion tok/s)``; empty without an ETA."""
        eta, expected = self._outlook_now()
        if eta is None:
            return ""
        text = eta_text(eta)
        return text if expected is None else f"{text} (run ~{expected:.1f} {self.tokens} tok/s)"

    def close(self) -> None:
        """Stop the bar (or print the last plain line); a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.ended_s = round(self.elapsed(), 2)
        self._outlook = (-1.0, None, None)  # the last line's ETA is of now
        if self._bar is not None:
            self._bar.stop()
        else:
            self._plain_line()


def eta_text(eta: EtaRange) -> str:
    """``H:MM:SS-H:MM:SS`` (low to high), or ``H:MM:SS`` (the point) once both
    ends are within :data:`SINGLE_WITHIN` of it."""
    point = dt.timedelta(seconds=round(eta.point))
    if eta.high - eta.low <= 2 * SINGLE_WITHIN * eta.point or eta.high - eta.low < 1.0:
        return str(point)
    return f"{dt.timedelta(seconds=round(eta.low))}-{dt.timedelta(seconds=round(eta.high))}"


def _plain_interval(stream: IO[str]) -> float:
    """Seconds between plain progress lines: ``BULKINFER_PROGRESS_INTERVAL_S``
    (at least 0.1), else :data:`PLAIN_INTERVAL_S`; a value that is no finite
    number is said on ``stream`` and the default kept."""
    value = os.environ.get(INTERVAL_ENV)
    if value is None:
        return PLAIN_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        print(
            f"warning: {INTERVAL_ENV}={value!r} is not a number of seconds; a line every {PLAIN_INTERVAL_S:g} s",
            file=stream,
        )
        return PLAIN_INTERVAL_S
    return max(seconds, 0.1)
