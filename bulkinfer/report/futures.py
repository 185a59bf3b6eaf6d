"""The futures an ETA draws (:meth:`bulkinfer.report.eta.WorkEstimate.outlook`):
for each, the steps, completion tokens and context tokens left, from
lengths drawn for the rows not finished and the slots they are fed to.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Protocol


class Work(Protocol):
    """What the futures read of a run (:class:`bulkinfer.report.eta.WorkEstimate`)."""

    rng: random.Random
    longest_max_tokens: int
    max_running: int | None
    concurrency: int
    running: list[int]
    same_job: bool
    prior: Counter[int]
    lengths: Counter[int]

    def rows_left(self, total_rows: int | None, failed_rows: int) -> int: ...

    def sequences(self, total_rows: int | None, failed_rows: int) -> int: ...

    def running_mean_prompt(self) -> float: ...

    def waiting_mean_prompt(self, total_rows: int | None, failed_rows: int) -> float: ...

    def survival_and_known(self) -> tuple[list[float], int]: ...

    def length_drift(self) -> float: ...


# Past the known lengths, the futures' rows stop at these shares of the way to
# max_tokens: (i + 0.5) / SAMPLES to this power (below 1: nearer max_tokens).
BEYOND_POWER = 0.5


# Futures drawn per estimate (the range's ends are their 10th and 90th percentiles: from 32, the
# widest range of a replayed run moved from +-72% to +-132% with the random draws alone; 128 cost
# about 27 ms an estimate on a 2-core Zen 3, one every 5 s), and the last waiting rows per slot drawn
# one by one.
SAMPLES = 128


TAIL_ROWS_PER_SLOT = 1


# A run again draws its rows' lengths from at most this many (see Futures._pool).
POOL_ROWS = 8192


# A row's completion length drawn given the tokens it has (tokens -> tokens).
_Draw = Callable[[int], int]


def spread_factors(sd: float, rng: random.Random) -> list[float]:
    """:data:`SAMPLES` factors ``exp(sd x z)``, ``z`` at evenly spaced
    quantiles of the standard normal, in a random order (one per future)."""
    normal = statistics.NormalDist()
    factors = [math.exp(sd * normal.inv_cdf((i + 0.5) / SAMPLES)) for i in range(SAMPLES)]
    rng.shuffle(factors)
    return factors


class Futures:
    """Draws the futures of one estimate: for each, the steps left, the
    completion tokens left and their context (tokens attended over, summed over steps)."""

    def __init__(self, work: Work, total_rows: int | None, failed_rows: int) -> None:
        self.work = work
        self.rng = work.rng
        self.top = max(work.longest_max_tokens, 1)
        self.waiting = work.rows_left(total_rows, failed_rows)
        self.slots = max(work.max_running or work.concurrency, len(work.running), 1)
        self.tail = min(self.waiting, TAIL_ROWS_PER_SLOT * self.slots)
        self.running_prompt = work.running_mean_prompt()
        self.waiting_prompt = work.waiting_mean_prompt(total_rows, failed_rows)
        self.running = sorted(work.running, reverse=True)
        if work.same_job:
            self.pool = self._pool(work.sequences(total_rows, failed_rows))
        else:
            self.survival, self.known = work.survival_and_known()
            self.falling = [-p for p in self.survival]  # non-decreasing: bisect finds where S drops below a level
            # the rows still to start stray from those seen (the running ones are the cohort the lengths
            # come from): their mean length as a random walk along the feed, whose mean over the next
            # share d of the way strays by drift x sqrt(d / 3)
            feed_left = self.waiting / max(work.sequences(total_rows, failed_rows), self.waiting, 1)
            self.scales = spread_factors(work.length_drift() * math.sqrt(feed_left / 3), self.rng)

    def _pool(self, rows: int) -> list[int]:
        """The lengths of the rows not finished (sorted; at most
        :data:`POOL_ROWS`, evenly spaced quantiles when more): the earlier
        run's lengths for ``rows`` rows, less the lengths of the rows done.
        The earlier lengths are quantiles, not the rows' own lengths, so each
        length done takes out the nearest from below: the remaining count at
        or below ``k`` is the earlier run's less the rows done, never falling."""
        top = self.top
        quantiles = [min(v, top) for v in self.work.prior.elements()]
        expected = [0.0] * (top + 1)
        for v in quantiles:
            expected[v] += rows / len(quantiles)
        done = Counter(min(k, top) for k in self.work.lengths.elements())
        earlier = finished = at_or_below = 0.0
        cumulative = []
        for k in range(top + 1):
            earlier += expected[k]
            finished += done.get(k, 0)
            at_or_below = max(at_or_below, earlier - finished)
            cumulative.append(at_or_below)
        total = cumulative[-1]
        n = min(round(total), POOL_ROWS)
        return [bisect.bisect_left(cumulative, (j + 0.5) / n * total) for j in range(n)] if n > 0 else []

    def draw(self, i: int) -> tuple[float, float, float, list[tuple[int, float]]]:
        """One future: (steps, completion tokens, context tokens) left, and
        its steps by the rows they decode: (rows, steps), fewer rows later."""
        if self.work.same_job:
            draw_running = draw_waiting = self._from_pool()
        else:
            draw_running, draw_waiting = self._from_survival(i, 1.0), self._from_survival(i, self.scales[i])
        slots: list[float] = []
        decoded, context = 0.0, 0.0
        for g in self.running:  # the longest first: each can still draw a length past its own
            length = draw_running(g)
            slots.append(length - g)
            decoded += length - g
            context += (length - g) * self.running_prompt + (length * length - g * g) / 2
        slots += [0] * (self.slots - len(slots))
        tail = [draw_waiting(0) for _ in range(self.tail)]
        bulk_rows = self.waiting - self.tail
        if bulk_rows > 0:  # the rows fed before the tail: their expected sum, spread by the CLT
            mean = statistics.fmean(tail)
            mean_square = statistics.fmean(n * n for n in tail)
            sd = math.sqrt(max(mean_square - mean * mean, 0.0))
            bulk = max(bulk_rows * mean + math.sqrt(bulk_rows) * sd * self.rng.gauss(0.0, 1.0), 0.0)
            slots = _fill(slots, bulk)
            decoded += bulk
            context += bulk_rows * (mean * self.waiting_prompt + mean_square / 2)
        heapq.heapify(slots)
        for length in tail:
            heapq.heapreplace(slots, slots[0] + length)
            decoded += length
            context += length * self.waiting_prompt + length * length / 2
        return max(slots, default=0.0), decoded, context, _batches(slots)

    def _from_pool(self) -> _Draw:
        pool = list(self.pool)
        top, rng = self.top, self.rng

        def draw(g: int) -> int:
            start = bisect.bisect_right(pool, g)
            if start >= len(pool):  # longer than the earlier run's lengths left: one more token
                return min(g + 1, max(top, g + 1))
            return pool.pop(rng.randrange(start, len(pool)))

        return draw

    def _from_survival(self, i: int, scale: float) -> _Draw:
        """Future ``i``'s lengths; ``scale``: its rows longer or shorter than those seen."""
        survival, falling, known, top, rng = self.survival, self.falling, self.known, self.top, self.rng
        beyond = ((i + 0.5) / SAMPLES) ** BEYOND_POWER  # where this future's rows past the known lengths stop

        def draw(g: int) -> int:
            if scale == 1.0:
                return lengths(g)
            return max(min(g + round((lengths(g) - g) * scale), top), g + 1)

        def lengths(g: int) -> int:
            g = min(g, top - 1)
            if survival[g] <= 0:
                return g + 1
            level = rng.random() * survival[g]
            k = bisect.bisect_left(falling, -level, lo=g + 1)
            if k >= top and known < top:  # past the known lengths: this future's share of the way to top
                base = max(known, g)
                k = base + 1 + int(beyond * (top - base - 1))
            return max(min(k, top), g + 1)

        return draw


def _batches(ends: list[float]) -> list[tuple[int, float]]:
    """The steps to come by the rows they decode, from each slot's last
    step (every slot decodes one token a step until its end): (rows, steps)."""
    ordered = sorted(e for e in ends if e > 0)
    out, before = [], 0.0
    for k, end in enumerate(ordered):
        if end > before:
            out.append((len(ordered) - k, end - before))
            before = end
    return out


def _fill(slots: list[float], tokens: float) -> list[float]:
    """The slots' finishing steps after ``tokens`` more are decoded one per
    slot per step, the emptiest slots first (water filling)."""
    ordered = sorted(slots)
    level, used = ordered[0], 0.0
    for count, value in enumerate(ordered[1:], 1):
        if used + count * (value - level) > tokens:
            break
        used += count * (value - level)
        level = value
    else:
        count = len(ordered)
    level += (tokens - used) / count
    return [max(s, level) for s in ordered]
