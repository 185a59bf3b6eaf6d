"""The ETA of a generation run: the completion tokens left, and the engine
steps they take. Under continuous batching hundreds of rows run at once and
few finish early on, so rows left over rows done would mislead; the work
left does not.

Two parts, both measured during the run:

- **Lengths**: the Kaplan-Meier estimate of the completion lengths (rows
  still running are censored at the tokens they have), joined with the
  lengths of an earlier run of the same job (or, failing that, of the same
  model) where bulkinfer has one: ``PRIOR_ROWS`` rows' worth, which the
  run's own rows soon outweigh. Without one, rows are assumed to run to
  ``max_tokens`` past the lengths seen: the ETA errs long, never short.
- **The same job run again** (``same_job``): its rows as a whole are
  expected to generate the earlier run's mean per row, so the completion
  tokens left are that total less the tokens generated so far (at least
  what the running rows are expected to add). Rows are fed in length
  order, so the rows left differ from the rows done: 1,000 short questions
  finished their short answers first, and the estimate from the rows done
  was 43% short at half-time; the total less the tokens done was 12% short
  (``python -m bench.eta_trace replay`` on the recording below, its own
  lengths as the prior).
- **Steps**: an engine step decodes one token for each running request,
  prefills some prompt tokens, and costs ``rate * (decoded + OVERHEAD_TOKENS
  + PREFILL_WEIGHT * prefilled)`` seconds, ``rate`` the median over the
  recent steps. While rows wait, the engine runs full; once none waits, the
  running rows drain: the steps cost less but only the longest rows are
  left, so the tail is simulated row by row.

Measured on a recording of a real run (``python -m bench.eta_trace``,
1,000 short questions, AMD EPYC 2 cores, SmolLM2-135M): a step costs
~0.065 s plus ~4 ms per decoded token and ~2 ms per prompt token, hence
``OVERHEAD_TOKENS`` = 16 and ``PREFILL_WEIGHT`` = 0.5.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, deque
from collections.abc import Sequence

# A step's fixed cost in decoded-token equivalents (see the module docstring).
OVERHEAD_TOKENS = 16.0


# A prompt token's cost, in decoded tokens (see the module docstring).
PREFILL_WEIGHT = 0.5


# Steps whose rate the median is taken over.
RECENT_STEPS = 32


# An earlier run's lengths weigh as much as this many rows of this run.
PRIOR_ROWS = 50


# Completion lengths kept of a run for later runs: the quantiles 0, 1, ..., 100 %.
LENGTH_QUANTILES = 101


# Without a prior, completion lengths are estimated only where at least this
# many rows are known to reach them.
MIN_AT_RISK = 20


# Low-discrepancy spread of quantiles over the running rows (the golden ratio's fraction).
SPREAD = 0.6180339887498949


class WorkEstimate:
    """Work done and left in a generation run and the time it takes (see
    the module docstring for the model).

    Completion length: ``S(k)``, the share of rows longer than ``k`` tokens
    (:meth:`survival`). A row that has ``g`` tokens is expected to add
    ``sum(S(k) for k >= g) / S(g)`` more. Rows not yet planned (the input is
    planned window by window) are assumed like the planned ones on average.

    Args:
        start: when generation started (seconds, the clock of :meth:`observe`).
        prior: completion lengths (tokens) of an earlier run, e.g. its
            :meth:`length_quantiles`; empty for none.
        max_running: the most requests the engine runs at once (vLLM's
            ``max_num_seqs``); None: the most seen running so far.
        same_job: ``prior`` is an earlier run of this job (the same output):
            the completion tokens left are its mean per row times the rows,
            less the tokens generated (see the module docstring).
    """

    def __init__(
        self,
        start: float = 0.0,
        prior: Sequence[int] = (),
        max_running: int | None = None,
        same_job: bool = False,
    ) -> None:
        self.planned_rows = 0
        self.planned_prompt_tokens = 0
        self.planned_max_tokens = 0
        self.longest_max_tokens = 0
        self.finished_rows = 0  # planned rows that ended, with or without error
        self.lengths: Counter[int] = Counter()  # completion lengths of the rows that ended with one
        self.prior = Counter(prior)
        self.same_job = same_job and bool(prior)
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.running: list[int] = []  # the tokens so far of each row the engine is generating
        self.max_running = max_running
        self.concurrency = 0  # the most rows seen generating at once
        self._last_step = (start, 0, 0)  # time, prefilled, generated when the counts last moved
        self._rates: deque[float] = deque(maxlen=RECENT_STEPS)  # seconds per unit of a step's work

    def plan(self, prompt_tokens: int, max_tokens: int) -> None:
        """A row was planned: ``prompt_tokens`` long, at most ``max_tokens`` to generate."""
        self.planned_rows += 1
        self.planned_prompt_tokens += prompt_tokens
        self.planned_max_tokens += max_tokens
        self.longest_max_tokens = max(self.longest_max_tokens, max_tokens)

    def finish(self, completion_tokens: int | None) -> None:
        """A planned row ended: with ``completion_tokens``, or None (it failed)."""
        self.finished_rows += 1
        if completion_tokens is not None:
            self.lengths[completion_tokens] += 1

    def observe(self, now: float, generated_tokens: int, prefilled_tokens: int, running: list[int]) -> None:
        """The engine's totals at ``now`` (seconds): completion tokens
        generated, prompt tokens processed, and the completion tokens so far
        of each request it is generating. Counts that moved since the last
        call end an engine step: its seconds per unit of work (see the
        module docstring) join the recent rates."""
        self.generated_tokens, self.prefilled_tokens, self.running = generated_tokens, prefilled_tokens, running
        self.concurrency = max(self.concurrency, len(running))
        then, prompt_then, completion_then = self._last_step
        if (prefilled_tokens, generated_tokens) == (prompt_then, completion_then):
            return  # a step still running
        self._last_step = (now, prefilled_tokens, generated_tokens)
        work = generated_tokens - completion_then + OVERHEAD_TOKENS + PREFILL_WEIGHT * (prefilled_tokens - prompt_then)
        if now > then:
            self._rates.append((now - then) / work)

    @property
    def done(self) -> int:
        """Tokens processed so far, prompt and completion."""
        return self.prefilled_tokens + self.generated_tokens

    def survival(self) -> list[float]:
        """``S[k]`` for k = 0 .. the longest ``max_tokens``: the Kaplan-Meier
        estimate of the share of completions longer than ``k`` tokens, the
        prior's lengths counted as :data:`PRIOR_ROWS` rows that ended."""
        top = self.longest_max_tokens
        censored = Counter(min(g, top) for g in self.running)  # running with g tokens: longer than g
        prior_weight = PRIOR_ROWS / self.prior.total() if self.prior else 0.0
        ended = {k: float(n) for k, n in self.lengths.items()}
        for length, n in self.prior.items():
            ended[min(length, top)] = ended.get(min(length, top), 0.0) + n * prior_weight
        at_risk: float = self.lengths.total() + len(self.running) + (PRIOR_ROWS if self.prior else 0)
        last_seen = max(max(self.lengths, default=0), max(self.running, default=0))
        s, out = 1.0, []
        for k in range(top + 1):
            if not self.prior and (k > last_seen or at_risk < MIN_AT_RISK):
                out.append(s if k < top else 0.0)  # past what was seen well: the rows left run to max_tokens
                continue
            s *= 1 - ended.get(k, 0.0) / at_risk if at_risk > 0 else 1.0
            out.append(max(s, 0.0) if k < top else 0.0)
            at_risk -= ended.get(k, 0.0) + censored.get(k, 0)
        return out

    def length_quantiles(self) -> list[int]:
        """The completion lengths of the rows that ended, as
        :data:`LENGTH_QUANTILES` quantiles (tokens; [] when none ended): a
        later run's ``prior``."""
        lengths = sorted(self.lengths.elements())
        if not lengths:
            return []
        last = len(lengths) - 1
        return [lengths[round(i * last / (LENGTH_QUANTILES - 1))] for i in range(LENGTH_QUANTILES)]

    def remaining_tokens(self, total_rows: int | None, failed_rows: int = 0) -> tuple[float, float]:
        """(prompt, completion) tokens left for ``total_rows`` rows in all
        (None: only the planned ones) of which ``failed_rows`` failed before
        they were planned."""
        if not self.planned_rows:
            return 0.0, 0.0
        completion = self._completion_left(self.survival(), self._rows_left(total_rows, failed_rows))
        return self._prompt_left(total_rows, failed_rows), completion

    def eta_s(self, total_rows: int | None, failed_rows: int = 0) -> float | None:
        """Seconds left for ``total_rows`` rows in all (see
        :meth:`remaining_tokens`); None before a step was timed."""
        if not self._rates or not self.planned_rows:
            return None
        rate = statistics.median(self._rates)
        survival = self.survival()
        waiting = self._rows_left(total_rows, failed_rows)
        if waiting <= 0:  # draining: the rows running are all that is left
            return _drain_s(rate, _residuals(survival, self.running))
        full = max(self.max_running or self.concurrency, 1)
        tokens = self._completion_left(survival, waiting)
        # the engine runs full until the last row waiting starts; then the full
        # batch drains, its rows part-way through (a renewal process's residual lengths)
        drain = _equilibrium_residuals(survival, full)
        steps = max(tokens - sum(drain), 0.0) / full
        prefill_s = rate * PREFILL_WEIGHT * self._prompt_left(total_rows, failed_rows)
        return steps * rate * (full + OVERHEAD_TOKENS) + prefill_s + _drain_s(rate, drain)

    def _completion_left(self, survival: list[float], waiting: int) -> float:
        """Completion tokens expected of the ``waiting`` rows and of the running ones."""
        tail = _tail_sums(survival)
        running = sum(_expected_left(tail, survival, g) for g in self.running)
        if not self.same_job:
            return waiting * tail[0] + running
        mean = sum(k * n for k, n in self.prior.items()) / self.prior.total()
        rows = self.lengths.total() + len(self.running) + waiting
        generated = sum(k * n for k, n in self.lengths.items()) + sum(self.running)
        return max(rows * mean - generated, running)

    def _prompt_left(self, total_rows: int | None, failed_rows: int) -> float:
        """Prompt tokens not yet processed, the unplanned rows' at the planned rows' mean."""
        mean_prompt = self.planned_prompt_tokens / self.planned_rows
        unplanned = max((total_rows or 0) - self.planned_rows - failed_rows, 0)
        return max(self.planned_prompt_tokens - self.prefilled_tokens, 0) + unplanned * mean_prompt

    def _rows_left(self, total_rows: int | None, failed_rows: int) -> int:
        """Rows not started: planned and waiting, or not yet planned."""
        unplanned = max((total_rows or 0) - self.planned_rows - failed_rows, 0)
        return max(self.planned_rows - self.finished_rows - len(self.running), 0) + unplanned


def _drain_s(rate: float, residuals: list[int]) -> float:
    """Seconds until rows with these tokens left all finish, one token per
    step each, a step with ``n`` rows costing ``rate * (n + OVERHEAD_TOKENS)``."""
    seconds, done, left = 0.0, 0, len(residuals)
    for r in sorted(residuals):
        seconds += (r - done) * rate * (left + OVERHEAD_TOKENS)
        done, left = r, left - 1
    return seconds


def _tail_sums(survival: list[float]) -> list[float]:
    """``tail[g] = sum(S(k) for g <= k < top)``: a row's expected tokens past ``g``, times ``S(g)``."""
    top = len(survival) - 1
    tail = [0.0] * (top + 1)
    for k in range(top - 1, -1, -1):
        tail[k] = tail[k + 1] + survival[k]
    return tail


def _expected_left(tail: list[float], survival: list[float], g: int) -> float:
    g = min(g, len(survival) - 1)
    return tail[g] / survival[g] if survival[g] > 0 else 0.0


def _residuals(survival: list[float], running: list[int]) -> list[int]:
    """Tokens left of each running row: a quantile of its length given that
    it passed ``g`` tokens, the quantiles spread over the rows."""
    top = len(survival) - 1
    falling = [-s for s in survival]  # non-decreasing: bisect finds where S drops below a level
    out, q = [], 0.5
    for g in sorted(min(g, top) for g in running):
        q = (q + SPREAD) % 1.0
        level = (1.0 - q) * survival[g]
        k = bisect.bisect_left(falling, -level, lo=min(g + 1, top))
        out.append(max(min(k, top) - g, 1))
    return out


def _equilibrium_residuals(survival: list[float], rows: int) -> list[int]:
    """Tokens left of ``rows`` rows caught part-way through at a random step
    (the residual lengths of a renewal process: ``P(R = r)`` proportional to
    ``S(r - 1)``), as ``rows`` evenly spaced quantiles."""
    cumulative, total = [], 0.0
    for s in survival[:-1]:
        total += s
        cumulative.append(total)
    if total <= 0:
        return [1] * rows
    return [bisect.bisect_left(cumulative, (i + 0.5) / rows * total) + 1 for i in range(rows)]
