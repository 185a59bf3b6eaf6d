"""The run report: ``OUT.report.json`` and the summary table on the terminal.

Throughput is tokens (or requests) divided by ``seconds.generate``, the wall
time from the first request handed to the engine to the last result;
``throughput_end_to_end`` divides by ``seconds.total`` (model load included).
``seconds.plan`` and ``seconds.write`` are time the driver spent reading and
tokenizing, and writing; after the first window they overlap generation,
because the engine computes in its own process meanwhile.
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.engine.log import terminal
from bulkinfer.errors import InputFileError
from bulkinfer.prep.planner import bucket_index, bucket_label
from bulkinfer.report import threads
from bulkinfer.report.eval_model import EvalReport, RankEvalReport
from bulkinfer.report.model import REPORT_VERSION, RunReport
from bulkinfer.report.structured import StructuredStats
from bulkinfer.schema import Completion, Done


def rate(amount: float, seconds: float) -> float:
    """amount / seconds, 0.0 for a zero interval."""
    return amount / seconds if seconds > 0 else 0.0


def throughput(requests: int, prompt_tokens: int, completion_tokens: int, seconds: float) -> dict[str, float]:
    """Requests/s and tokens/s over ``seconds``."""
    return {
        "requests_per_s": rate(requests, seconds),
        "prompt_tokens_per_s": rate(prompt_tokens, seconds),
        "completion_tokens_per_s": rate(completion_tokens, seconds),
        "total_tokens_per_s": rate(prompt_tokens + completion_tokens, seconds),
    }


def peak_rss_bytes() -> dict[str, int]:
    """Peak resident set size in bytes of this process and of its largest
    finished child (the engine's worker processes, once shut down)."""
    return {
        "bulkinfer": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write a run, embed, eval or eval-rank ``report`` as indented JSON, atomically
    (:func:`write_json`), its first key ``report_version``
    (:data:`bulkinfer.report.model.REPORT_VERSION`); the format is
    ``report.schema.json`` beside this module and the types of
    :mod:`bulkinfer.report.model`, which read what was written back: a
    report they cannot read (a writer out of step with its readers: a bug)
    is still written, with a warning on the terminal.

    Raises:
        OSError: the file cannot be written (no temporary file is left).
    """
    data = write_json({"report_version": REPORT_VERSION, **report}, path)
    try:
        kind = RankEvalReport if "measures" in report else EvalReport if "scores" in report else RunReport
        kind.from_dict(orjson.loads(data), str(path))
    except InputFileError as exc:
        print(f"bulkinfer: warning: the report does not read back as one (a bug): {exc}", file=terminal())


def write_json(data: dict[str, Any], path: Path) -> bytes:
    """Write ``data`` as indented JSON (values JSON does not know, as their
    ``str``), atomically (:func:`bulkinfer.io.files.atomic_write`); returns the bytes written.

    Raises:
        OSError: the file cannot be written (no temporary file is left).
    """
    from bulkinfer.io.files import atomic_write

    encoded = orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str)
    atomic_write(path, encoded)
    return encoded


# completion-length histogram bins (tokens): 1, 2, 3-4, 5-8, ..., 8193+
LENGTH_BINS: tuple[int, ...] = tuple(2**i for i in range(14))


# The token series keeps at most this many points: when full, every other
# point goes and the interval between points doubles.
SERIES_MAX_POINTS = 512
# Seconds between two points of the token series at the start of a run.
SERIES_INTERVAL_S = 1.0


class TokenSeries:
    """The engine's live token counts over generation time, bounded: the
    cumulative completion tokens generated and prompt tokens processed
    (prefilled; as usage counts them, a request of ``n`` choices once:
    :meth:`~bulkinfer.report.progress.Progress.usage_prompt_tokens`) of
    finished and unfinished requests alike, the counts the
    progress line shows. A point every ``interval_s`` seconds (at most
    :data:`SERIES_MAX_POINTS`; when full, every other point is dropped and the
    interval doubles, so a run of any length keeps an even, bounded sample).
    """

    def __init__(self, interval_s: float | None = None, max_points: int = SERIES_MAX_POINTS) -> None:
        self.interval_s = SERIES_INTERVAL_S if interval_s is None else interval_s
        self.max_points = max(max_points, 2)
        self.points: list[tuple[float, int, int]] = [(0.0, 0, 0)]  # (seconds, completion, prompt)
        self.last: tuple[float, int, int] = (0.0, 0, 0)

    def observe(self, seconds: float, completion_tokens: int, prompt_tokens: int) -> None:
        """The live counts ``seconds`` after generation started."""
        self.last = (seconds, completion_tokens, prompt_tokens)
        if seconds - self.points[-1][0] < self.interval_s:
            return
        if len(self.points) >= self.max_points:
            self.points = self.points[::2]
            self.interval_s *= 2
            if seconds - self.points[-1][0] < self.interval_s:
                return
        self.points.append(self.last)

    def to_dict(self, end_s: float, completion_tokens: int, prompt_tokens: int) -> dict[str, Any]:
        """The report's ``tokens_over_time``: parallel lists ``seconds`` (since
        generation started), ``completion_tokens`` and ``prompt_tokens``
        (cumulative), ending at ``end_s`` with the given totals (the last live
        counts when larger), and the ``interval_s`` the points ended up at."""
        points = [p for p in self.points if p[0] < end_s]
        points.append((end_s, max(completion_tokens, self.last[1]), max(prompt_tokens, self.last[2])))
        return {
            "source": "engine live counts",
            "interval_s": self.interval_s,
            "seconds": [round(p[0], 3) for p in points],
            "completion_tokens": [p[1] for p in points],
            "prompt_tokens": [p[2] for p in points],
        }


def prefix_cache(cached_tokens: int, prompt_tokens: int, estimate: dict[str, Any] | None) -> dict[str, Any]:
    """The report's ``prefix_cache``: ``cached_tokens``, the prompt tokens
    vLLM served from its prefix cache (``RequestOutput.num_cached_tokens``
    summed over the finished rows), of ``prompt_tokens``; ``hit_rate`` =
    cached / prompt tokens (0.0 for none); ``estimate``: what the plan
    counted as shareable in whole blocks (see
    :class:`~bulkinfer.prep.prefix.PrefixStats`), or None when the engine's
    prefix cache is off."""
    return {
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "hit_rate": rate(cached_tokens, prompt_tokens),
        "estimate": estimate,
    }


class RunStats:
    """Counters that observe one run's feed loop: seconds by phase (``plan``,
    ``generate``, ``write``), prompt and completion tokens of the rows this
    attempt finished, their completion lengths (power-of-two bins; a row of
    ``n`` choices counts each choice's, as ``finish_reasons`` does) and the
    engine's live token counts over generation time (:class:`TokenSeries`),
    for the report and its HTML charts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.seconds = {"plan": 0.0, "generate": 0.0, "write": 0.0}
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.completion_lengths: Counter[int] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.structured = StructuredStats()
        self.series = TokenSeries()
        self._started = clock()
        # CPU seconds during generation: the feeding thread's, the whole process's (time.thread_time,
        # process_time), and by thread (bulkinfer.report.threads)
        self.cpu_seconds: dict[str, Any] = {}
        self._cpu_started = (time.thread_time(), time.process_time())
        self._threads_started: threads.Snapshot = {}
        # the clock when the engine first reported a completion token (None: not yet)
        self.first_token_at: float | None = None

    def start(self) -> None:
        """Generation starts: the first request is about to be handed over."""
        self._started = self.clock()
        self._cpu_started = (time.thread_time(), time.process_time())
        self._threads_started = threads.snapshot()

    def generation_ended(self) -> None:
        """Generation ended (call from the thread that called :meth:`start`):
        ``seconds["generate"]`` and :attr:`cpu_seconds` (``feed_thread``: the
        CPU seconds of the thread that fed the engine and handled its results,
        bulkinfer's own work; ``process``: every thread of this process, an
        engine in it included; ``threads``: every thread of this process and
        of the processes it started, by name, see :mod:`bulkinfer.report.threads`;
        absent without ``/proc``)."""
        self.seconds["generate"] = self.clock() - self._started
        thread_s, process_s = self._cpu_started
        self.cpu_seconds = {"feed_thread": time.thread_time() - thread_s, "process": time.process_time() - process_s}
        if self._threads_started:
            self.cpu_seconds["threads"] = threads.used(self._threads_started, threads.snapshot())

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the time of the ``with`` block to ``seconds[phase]``."""
        t = self.clock()
        try:
            yield
        finally:
            self.seconds[phase] += self.clock() - t

    def finished(self, completion: Completion, structured: dict[str, Any] | None = None) -> None:
        """A row completed; ``structured``: its constraint (vLLM's
        ``StructuredOutputsParams`` arguments), when it had one."""
        self.prompt_tokens += completion.prompt_tokens
        self.completion_tokens += completion.completion_tokens
        self.cached_tokens += completion.cached_tokens
        for length in completion.lengths:  # a row of n choices: each choice's, as its finish_reason
            self.completion_lengths[bucket_index(length, LENGTH_BINS)] += 1
        choices = [(c.text, c.finish_reason) for c in completion.choices]
        for text, reason in choices or [(completion.text, completion.finish_reason)]:
            self.finish_reasons[reason] += 1
            if structured is not None:
                self.structured.add(structured, text, reason)

    def sample(self, generated_tokens: int, prefilled_tokens: int) -> None:
        """The engine's live counts after a step: completion tokens generated
        and prompt tokens processed since this run started (the token series)."""
        if generated_tokens > 0 and self.first_token_at is None:
            self.first_token_at = self.clock()
        self.series.observe(
            self.clock() - self._started,
            max(generated_tokens, self.completion_tokens),
            max(prefilled_tokens, self.prompt_tokens),
        )

    def report(
        self,
        counts: tuple[int, int, int],
        done: Done,
        load_total_s: tuple[float, float],
        prefix: dict[str, Any] | None,
        generated: bool = True,
    ) -> dict[str, Any]:
        """The run report's figures this object measured. ``counts``:
        (completed, failed, skipped blank lines) of the whole output, resumed
        rows included, as are ``tokens`` and ``request_counts``;
        ``load_total_s``: seconds of the model load and of the whole run;
        ``throughput``, ``prefix_cache``, ``finish_reasons``,
        ``structured_outputs`` and the histograms cover the rows this attempt
        ran (``finish_reasons`` and the completion-length histogram only when
        the job ``generated`` text). ``prefix``: the planner's estimate of
        shareable prefix tokens (:class:`~bulkinfer.prep.prefix.PrefixStats`), or None."""
        completed, failed, skipped = counts
        load_s, total_s = load_total_s
        ran = completed - done.completed
        seconds = {"load": load_s, **self.seconds, "total": total_s}
        return {
            "rows": completed + failed + skipped,
            "request_counts": {
                "total": completed + failed + skipped,
                "completed": completed,
                "failed": failed,
                "skipped": skipped,
            },
            "resumed": {"completed": done.completed, "failed": done.failed},
            "tokens": {
                "prompt": done.prompt_tokens + self.prompt_tokens,
                "completion": done.completion_tokens + self.completion_tokens,
            },
            "seconds": seconds,
            **({"cpu_seconds": self.cpu_seconds} if self.cpu_seconds else {}),
            "throughput": throughput(ran, self.prompt_tokens, self.completion_tokens, seconds["generate"]),
            "throughput_end_to_end": throughput(ran, self.prompt_tokens, self.completion_tokens, total_s),
            "prefix_cache": prefix_cache(self.cached_tokens, self.prompt_tokens, prefix),
            **(self._completions() if generated else {}),
            "tokens_over_time": self.series.to_dict(seconds["generate"], self.completion_tokens, self.prompt_tokens),
        }

    def _completions(self) -> dict[str, Any]:
        """The report's figures of generated completions: finish reasons and the length histogram."""
        return {
            "finish_reasons": dict(self.finish_reasons.most_common()),
            "completion_length_histogram": [
                {"range": bucket_label(i, LENGTH_BINS), "rows": n} for i, n in sorted(self.completion_lengths.items())
            ],
        }

    def structured_report(self, backend: str | None) -> dict[str, Any] | None:
        """The report's ``structured_outputs``: the constrained rows and their
        validity, by kind (see :mod:`bulkinfer.report.structured`); ``backend``:
        the engine's structured-output backend; None when no row had a constraint."""
        return self.structured.to_dict(backend)
