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

from bulkinfer.prep.planner import bucket_index, bucket_label
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
    """Write ``report`` as indented JSON, atomically (:func:`bulkinfer.io.files.atomic_write`).

    Raises:
        OSError: the file cannot be written (no temporary file is left).
    """
    from bulkinfer.io.files import atomic_write

    atomic_write(path, orjson.dumps(report, option=orjson.OPT_INDENT_2, default=str))


# completion-length histogram bins (tokens): 1, 2, 3-4, 5-8, ..., 8193+
LENGTH_BINS: tuple[int, ...] = tuple(2**i for i in range(14))


class RunStats:
    """Counters that observe one run's feed loop: seconds by phase (``plan``,
    ``generate``, ``write``), prompt and completion tokens of the rows this
    attempt finished, their completion lengths (power-of-two bins) and the
    cumulative completion tokens over generation time (at most one point a
    second), for the report and its HTML charts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.seconds = {"plan": 0.0, "generate": 0.0, "write": 0.0}
        self.prompt_tokens = self.completion_tokens = 0
        self.completion_lengths: Counter[int] = Counter()
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self._started = clock()

    def start(self) -> None:
        """Generation starts: the first request is about to be handed over."""
        self._started = self.clock()

    def generation_ended(self) -> None:
        self.seconds["generate"] = self.clock() - self._started

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the time of the ``with`` block to ``seconds[phase]``."""
        t = self.clock()
        try:
            yield
        finally:
            self.seconds[phase] += self.clock() - t

    def finished(self, completion: Completion) -> None:
        """A row completed."""
        self.prompt_tokens += completion.prompt_tokens
        self.completion_tokens += completion.completion_tokens
        self.completion_lengths[bucket_index(completion.completion_tokens, LENGTH_BINS)] += 1

    def sample(self, generated_tokens: int) -> None:
        """The engine's live count of completion tokens, after a step (the timeline)."""
        elapsed = self.clock() - self._started
        if elapsed - self.timeline[-1][0] >= 1.0:
            self.timeline.append((round(elapsed, 2), max(generated_tokens, self.completion_tokens)))

    def report(
        self,
        *,
        paths: dict[str, Path],
        model: str,
        model_path: str,
        counts: tuple[int, int, int],
        done: Done,
        load_s: float,
        total_s: float,
        padding: dict[str, Any],
        plan: dict[str, Any],
        engine: dict[str, Any],
        sampling: dict[str, Any],
        chat_template_applied: bool | str,
    ) -> dict[str, Any]:
        """The run report. ``counts``: (completed, failed, skipped blank
        lines) of the whole output, resumed rows included, as are ``tokens``
        and ``request_counts``; ``throughput``, ``buckets`` and
        ``padding_efficiency`` cover the rows this attempt ran."""
        completed, failed, skipped = counts
        ran = completed - done.completed
        seconds = {"load": load_s, **self.seconds, "total": total_s}
        return {
            **{name: str(path) for name, path in paths.items()},
            "model": model,
            "model_path": model_path,
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
            "throughput": throughput(ran, self.prompt_tokens, self.completion_tokens, seconds["generate"]),
            "throughput_end_to_end": throughput(ran, self.prompt_tokens, self.completion_tokens, total_s),
            **padding,
            "plan": plan,
            "engine": engine,
            "sampling": sampling,
            "chat_template_applied": chat_template_applied,
            "completion_length_histogram": [
                {"range": bucket_label(i, LENGTH_BINS), "rows": n} for i, n in sorted(self.completion_lengths.items())
            ],
            "timeline": [*self.timeline, (round(seconds["generate"], 2), self.completion_tokens)],
        }
