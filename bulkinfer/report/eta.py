"""The ETA of a generation run: the tokens left (prompt and completion) and
the time they take at the rate measured. Under continuous batching hundreds
of rows run at once and few finish early on, so rows left over rows done
would mislead; the work left does not."""

from __future__ import annotations

from collections import Counter

# The time model (WorkEstimate): intervals of at least SAMPLE_S seconds, weighed
# down by half every HALF_LIFE_S seconds; before prompt and completion tokens were
# timed apart, a completion token costs PRIOR_RATIO prompt tokens (fitted on the runs of
# bench/results/eta.json, CPU, SmolLM2-135M: 2.0 to 2.7), a pull as strong as PRIOR_WEIGHT
# of the data.
SAMPLE_S = 1.0


HALF_LIFE_S = 30.0


PRIOR_RATIO = 2.5


PRIOR_WEIGHT = 0.3


# Completion lengths are estimated where at least this many rows are known to reach them.
MIN_AT_RISK = 20


class WorkEstimate:
    """Work done and left in a generation run, in prompt and completion tokens,
    and the time it takes.

    Time: every interval of at least :data:`SAMPLE_S` seconds between two
    observations gives ``dt = a * prompt_tokens + b * completion_tokens``
    (the tokens processed in it); ``a`` and ``b`` (seconds per token) are the
    least-squares fit over the intervals so far, each weighted down with age
    (half-life :data:`HALF_LIFE_S` s, so a slower tail is seen), with a pull
    towards ``b = PRIOR_RATIO * a`` that matters while the two kinds of
    token have not been seen apart. A completion token costs more than a prompt token:
    it is decoded alone and goes through the LM head and the sampler.

    Completion length: the Kaplan-Meier estimate of the distribution of
    completion lengths (each capped at its ``max_tokens``): finished rows are
    observed lengths, rows still running are censored at the tokens they
    have. Past the longest length observed, or where fewer than
    :data:`MIN_AT_RISK` rows are known to reach a length, the rows left are
    assumed to run to ``max_tokens``: before rows end, the ETA errs long. A row that has ``g`` tokens is expected to add
    ``sum(S(k) for k >= g) / S(g)`` more, ``S(k)`` being the share of rows
    longer than ``k`` tokens. Rows not yet planned (the input is planned window
    by window) are assumed like the planned ones on average.
    """

    def __init__(self, start: float = 0.0) -> None:
        """``start``: when generation started (seconds, the clock of :meth:`observe`)."""
        self.planned_rows = 0
        self.planned_prompt_tokens = 0
        self.planned_max_tokens = 0
        self.longest_max_tokens = 0
        self.finished_rows = 0  # planned rows that ended, with or without error
        self.lengths: Counter[int] = Counter()  # completion lengths of the rows that ended with one
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.running: list[int] = []  # the tokens so far of each row the engine is generating
        self._last = (start, 0, 0)  # time, prefilled, generated at the last sample
        # decayed sums of the normal equations: [PP, PG, GG, Pt, Gt]
        self._sums = [0.0] * 5

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
        of each request it is generating."""
        self.generated_tokens, self.prefilled_tokens, self.running = generated_tokens, prefilled_tokens, running
        then, prompt_then, completion_then = self._last
        dt = now - then
        p, g = prefilled_tokens - prompt_then, generated_tokens - completion_then
        if dt < SAMPLE_S or not (p or g):  # an engine step still running: its time goes with its tokens
            return
        self._last = (now, prefilled_tokens, generated_tokens)
        keep = 0.5 ** (dt / HALF_LIFE_S)
        for i, value in enumerate((p * p, p * g, g * g, p * dt, g * dt)):
            self._sums[i] = self._sums[i] * keep + value

    @property
    def done(self) -> int:
        """Tokens processed so far, prompt and completion."""
        return self.prefilled_tokens + self.generated_tokens

    def seconds_per_token(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per prompt token and per completion token; None
        before any tokens were timed."""
        pp, pg, gg, pt, gt = self._sums
        if pp + gg <= 0:
            return None
        # minimise sum (dt - a p - b g)^2 + mu (b - R a)^2
        mu, r = PRIOR_WEIGHT * (pp + gg), PRIOR_RATIO
        m11, m12, m22 = pp + mu * r * r, pg - mu * r, gg + mu
        det = m11 * m22 - m12 * m12
        if det > 0:
            a, b = (m22 * pt - m12 * gt) / det, (m11 * gt - m12 * pt) / det
            if a >= 0 and b >= 0:
                return a, b
        # no fit with both costs positive: one rate, b = R a
        a = (pt + r * gt) / (pp + 2 * r * pg + r * r * gg)
        return a, r * a

    def survival(self) -> list[float]:
        """``S[k]`` for k = 0 .. the longest ``max_tokens``: the Kaplan-Meier
        estimate of the share of completions longer than ``k`` tokens."""
        top = self.longest_max_tokens
        censored = Counter(min(g, top) for g in self.running)  # running with g tokens: longer than g
        at_risk = sum(self.lengths.values()) + len(self.running)
        last_seen = max(max(self.lengths, default=0), max(self.running, default=0))
        s = 1.0 - self.lengths.get(0, 0) / at_risk if at_risk else 1.0
        at_risk -= self.lengths.get(0, 0)
        out = [s]
        for k in range(1, top + 1):
            if k > last_seen or at_risk < MIN_AT_RISK:  # past what was seen well: the rows left run to max_tokens
                out.append(s if k < top else 0.0)
                continue
            ended = self.lengths.get(k, 0)
            s *= 1 - ended / at_risk  # at_risk >= MIN_AT_RISK >= 1 here
            out.append(s)
            at_risk -= ended + censored.get(k, 0)
        return out

    def remaining_tokens(self, total_rows: int | None, failed_rows: int = 0) -> tuple[float, float]:
        """(prompt, completion) tokens left for ``total_rows`` rows in all
        (None: only the planned ones) of which ``failed_rows`` failed before
        they were planned."""
        if not self.planned_rows:
            return 0.0, 0.0
        mean_prompt = self.planned_prompt_tokens / self.planned_rows
        unplanned = max((total_rows or 0) - self.planned_rows - failed_rows, 0)
        survival = self.survival()
        top = len(survival) - 1
        # tail[g]: the expected tokens past g of a row, times S(g) (sum of S(k) for g <= k < top)
        tail = [0.0] * (top + 1)
        for k in range(top - 1, -1, -1):
            tail[k] = tail[k + 1] + survival[k]
        cap = min(round(self.planned_max_tokens / self.planned_rows), top)
        waiting = max(self.planned_rows - self.finished_rows - len(self.running), 0)
        completion = (waiting + unplanned) * (tail[0] - tail[cap])
        for g in self.running:
            g = min(g, top)
            completion += tail[g] / survival[g] if survival[g] > 0 else 0.0
        prompt = max(self.planned_prompt_tokens - self.prefilled_tokens, 0) + unplanned * mean_prompt
        return prompt, completion

    def eta_s(self, total_rows: int | None, failed_rows: int = 0) -> float | None:
        """Seconds left; None before any tokens were timed."""
        costs = self.seconds_per_token()
        if costs is None:
            return None
        prompt, completion = self.remaining_tokens(total_rows, failed_rows)
        return costs[0] * prompt + costs[1] * completion
