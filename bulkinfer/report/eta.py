"""The ETA of a generation run, as a range: the completion tokens left, and
the engine steps and seconds they take, with what is not known yet drawn
many times over.

Under continuous batching hundreds of rows run at once and few finish early
on, so rows left over rows done would mislead; the work left does not. What
is unknown is the completion length of every row not finished (how long the
running ones still go, how long the waiting ones will be) and the rate of
the steps to come. :meth:`WorkEstimate.outlook` draws
:data:`~bulkinfer.report.futures.SAMPLES` futures
(:class:`~bulkinfer.report.futures.Futures`): in each, every running row
gets a length past the tokens it has, the last waiting rows (one per slot)
get lengths and are fed to the slots as they free (the tail, which decides
how many steps the drain takes), the waiting rows before them add their
expected tokens (their sum's spread from the central limit theorem), and
the steps are timed by one of the step model's neighbours at its own rate,
scaled by a draw of the rate's drift (:mod:`bulkinfer.report.step_cost`;
at least :data:`OTHER_JOBS_SPREAD` where the step model is other jobs'; by
the model alone, its drift at least :data:`SAME_JOB_SPREAD`, where it is
the job's own).
The range is the 10th to 90th percentile of the futures' seconds, the point
their median: its width is the spread of what is still unknown, and it
narrows as rows finish.

- **Lengths, a first run**: the Kaplan-Meier estimate of the completion
  lengths (rows still running are censored at the tokens they have) over
  the rows that started last (:meth:`WorkEstimate._cohort`: rows are fed in
  prompt length order and lengths drift along it), joined with the lengths
  of an earlier run of the model where bulkinfer has one: ``PRIOR_ROWS``
  rows' worth (alone until this run has seen :data:`MIN_AT_RISK` rows, then
  only up to the lengths this run's rows reach; its longest lengths count
  as cut, not ended). Where fewer than :data:`MIN_AT_RISK` of this run's
  rows are known to reach a length, what lies past it is not known: each
  future has those rows stop at its own share of the way to ``max_tokens``
  (one draw per future: the unknown is the job's, not each row's). Each
  future also scales the lengths of the rows still to start by a draw of
  the drift measured along the feed (:meth:`WorkEstimate.length_drift`),
  times sqrt(d / 3) for the share d of the rows still to start (their mean
  as a random walk along the feed): the rows to come need not be like the
  rows seen, and the fewer there are, the less they can stray. The running
  rows are the rows the lengths are estimated from: not scaled.
- **The same job run again** (``same_job``): its rows are expected to have
  the earlier run's lengths, the ones already seen taken out
  (:meth:`~bulkinfer.report.futures.Futures._pool`). Rows are fed in length
  order, so the rows left differ from the rows done (1,000 short questions
  finished their short answers first); the earlier run's lengths less the
  ones done know that.
- **Steps**: :mod:`bulkinfer.report.step_cost` (the fixed cost of a step,
  the tokens it decodes, attends over and prefills, not those from the
  prefix cache); its scale is the median over the :data:`RECENT_STEPS`
  latest steps (a run timed by its own job's fits: its earlier runs' rate
  for those not seen yet). The context attended over is the running rows'
  own prompts and completions so far (the engine's ``running_prompt_tokens``);
  in the futures the running rows keep their mean prompt, and the rows still
  to start have the mean prompt of the prompt tokens not yet processed (rows
  are fed longest prompt first). A run timed by its own job's fits also
  times its steps to come by their batches (full or not) at the rates its
  earlier runs saw (``batch_rates``): the futures give each step's rows.
  A first run does so at its own batch rates once it has seen both kinds
  of batch (its drain has begun); other jobs' are not its own.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bulkinfer.report.futures import SAMPLES, Futures, spread_factors
from bulkinfer.report.planned import PlannedWork
from bulkinfer.report.step_cost import Step, StepCost, batch_rates, fit_step_cost

# Steps whose rate the median is taken over.
RECENT_STEPS = 64


# Steps kept (every one, then every 2nd, 4th, ... in order) for the run's own step-cost fit at its end.
FIT_STEPS = 4096


# An earlier run's lengths weigh as much as this many rows of this run.
PRIOR_ROWS = 50


# Completion lengths kept of a run for later runs: the quantiles 0, 1, ..., 100 %.
LENGTH_QUANTILES = 101


# Without a prior, completion lengths are estimated only where at least this
# many rows are known to reach them.
MIN_AT_RISK = 20


# A first run's lengths are estimated from the rows started last: this many
# of the 4 x as many that ended last (see WorkEstimate._cohort).
COHORT_ROWS = 256


# A first run's rows still to start may not be like the rows seen: each future
# scales their lengths by exp(drift x z), the drift measured along the feed
# (WorkEstimate.length_drift), at least the first, the second until measured.
MIN_LENGTH_DRIFT = 0.15


UNKNOWN_LENGTH_DRIFT = 0.5


# A run timed by other jobs' step models (a first run) draws its rate's drift at least this wide: the
# weights fitted to a job differ more between jobs than between runs, and a borrowed model's
# forecasts erred by +42% (ShareGPT's run again timed by the median of other jobs' fits, replayed)
# and -29% (the multi-turn job's first run at 40%: 6.2 ms a completion token forecast, 8.7 ms taken),
# 2-core Zen 3 (bench/results/eta-range-zen3b.md).
OTHER_JOBS_SPREAD = 0.3


# A run timed by its own job's fits (earlier runs that wrote the same output) takes that model alone,
# not its neighbours: fitted over whole runs of the same mix of steps, it times this one as well as any
# model its steps cannot tell apart, and the neighbours' rates, rescaled to the latest steps, part
# whenever the mix changes (ShareGPT's run again was +-58% wide at 30% of the run, while long prompts
# were still prefilled, +-8% after). Its rate's drift is drawn at least this wide: timed so, the points
# of nine runs again erred -28% to +26% at worst, and the 10th to 90th percentiles of a drift of 0.2
# span -23% to +29% (0.15 held the multi-turn run again 76% of the time; replayed, 2-core Zen 3:
# bench/results/eta-range-zen3{,b,c}-replayed.md).
SAME_JOB_SPREAD = 0.2


# The range's ends: these quantiles of the futures' seconds.
RANGE_QUANTILES = (0.1, 0.9)


@dataclass(frozen=True, slots=True)
class EtaRange:
    """Seconds left: ``low`` and ``high`` (the 10th and 90th percentiles of
    the drawn futures) around ``point`` (their median); ``completion_tokens``:
    the completion tokens left, the futures' mean."""

    low: float
    point: float
    high: float
    completion_tokens: float


class WorkEstimate(PlannedWork):
    """Work done and left in a generation run and the time it takes (see
    the module docstring for the model).

    Completion length: ``S(k)``, the share of rows longer than ``k`` tokens
    (:meth:`survival`). Rows not yet planned (the input is planned window by
    window) are assumed like the planned ones on average. A "row" here is a
    sequence (:mod:`bulkinfer.report.planned`): a row of ``n`` choices is
    ``n`` of them, each with its own length.

    Args:
        start: when generation started (seconds, the clock of :meth:`observe`).
        prior: completion lengths (tokens) of an earlier run, e.g. its
            :meth:`length_quantiles`; empty for none.
        max_running: the most sequences the engine runs at once (vLLM's
            ``max_num_seqs``); None: the most seen running so far.
        same_job: ``prior`` is an earlier run of this job (the same output).
        step_cost: the step model's weights for this model and machine
            (stored by an earlier run); the defaults when None.
        seed: of the futures' draws (an estimate is reproducible).
        step_cost_same_job: ``step_cost`` was fitted to earlier runs of this
            job (see :data:`SAME_JOB_SPREAD`).
    """

    def __init__(
        self,
        start: float = 0.0,
        prior: Sequence[int] = (),
        max_running: int | None = None,
        same_job: bool = False,
        step_cost: StepCost | None = None,
        seed: int = 0,
        *,
        step_cost_same_job: bool = False,
    ) -> None:
        super().__init__()
        self.lengths: Counter[int] = Counter()  # completion lengths of the rows that ended with one
        # (step it started at, length) of the rows that ended last with one
        self._recent: deque[tuple[int, int]] = deque(maxlen=4 * COHORT_ROWS)
        # rows that ended, by the span of steps they started in (see _span): [rows, completion tokens]
        self._by_start: dict[int, list[int]] = {}
        self.prior = Counter(prior)
        self.same_job = same_job and bool(prior)
        self.generated_tokens = 0
        self.max_running = max_running
        self.concurrency = 0  # the most rows seen generating at once
        self.step_cost = step_cost or StepCost()
        self.step_cost_stored = step_cost is not None
        self.step_cost_same_job = step_cost_same_job and step_cost is not None
        self.steps: deque[Step] = deque(maxlen=RECENT_STEPS)
        self.sampled_steps: list[Step] = []  # every _stride-th step, in order, for fit_step_cost
        self._stride = 1
        self.step_count = 0
        self._last_step = (start, 0, 0)  # time, prefilled, generated when the counts last moved
        self.rng = random.Random(seed)

    def finish(self, completion_tokens: int | None) -> None:
        """A planned sequence ended: with ``completion_tokens``, or None (it failed)."""
        self.finished_rows += 1
        if completion_tokens is not None:
            self.lengths[completion_tokens] += 1
            start = self.step_count - completion_tokens
            self._recent.append((start, completion_tokens))
            block = self._by_start.setdefault(start // self._span(), [0, 0])
            block[0] += 1
            block[1] += completion_tokens

    def observe(
        self,
        now: float,
        generated_tokens: int,
        prefilled_tokens: int,
        running: list[int],
        cached_tokens: int = 0,
        running_prompt_tokens: int | None = None,
        ended_sequences: int = 0,
    ) -> None:
        """The engine's totals at ``now`` (seconds): completion tokens
        generated, prompt tokens processed (``cached_tokens`` of them served
        from the prefix cache), the completion tokens so far of each sequence
        it is generating and those sequences' prompt tokens, summed (None: at
        the planned sequences' mean), and the sequences that ended while their
        row runs on (the engine's ``ended_sequences``). Counts that moved since the last call end
        an engine step (its seconds, tokens and context join the recent
        steps); the step prefilled the prompt tokens it computed, not the
        cached ones (a multi-turn job found 49% of its prompt tokens in the
        cache: counted, its prefill weight halved against other jobs').
        The context is the running rows' own (at the mean, a multi-turn job's full
        batches looked 1.6x slower than its drain: :func:`~.step_cost.batch_rates`)."""
        self.generated_tokens, self.prefilled_tokens, self.running = generated_tokens, prefilled_tokens, running
        self.ended = ended_sequences
        prompts = running_prompt_tokens
        self.running_prompt = len(running) * self.mean_prompt() if prompts is None else prompts
        self.concurrency = max(self.concurrency, len(running))
        then, prompt_then, completion_then = self._last_step
        if (prefilled_tokens, generated_tokens) == (prompt_then, completion_then):
            return  # a step still running
        self._last_step = (now, prefilled_tokens, generated_tokens)
        computed = prefilled_tokens - prompt_then - max(cached_tokens - self.cached_tokens, 0)
        self.cached_tokens = max(cached_tokens, self.cached_tokens)
        if now <= then:
            return
        step = Step(
            now - then, generated_tokens - completion_then, max(computed, 0), sum(running) + self.running_prompt
        )
        self.steps.append(step)
        self.step_count += 1
        if self.step_count % self._stride == 0:  # every stride-th step, in order
            self.sampled_steps.append(step)
            if len(self.sampled_steps) >= FIT_STEPS:
                del self.sampled_steps[::2]
                self._stride *= 2

    @property
    def done(self) -> int:
        """Tokens processed so far, prompt and completion."""
        return self.prefilled_tokens + self.generated_tokens

    def survival(self) -> list[float]:
        """``S[k]`` for k = 0 .. the longest ``max_tokens``: the Kaplan-Meier
        estimate of the share of completions longer than ``k`` tokens, the
        prior's lengths counted as :data:`PRIOR_ROWS` rows that ended. Past
        where the lengths are known (see :meth:`survival_and_known`), ``S``
        stays flat: the rows left run to ``max_tokens``."""
        return self.survival_and_known()[0]

    def _cohort(self) -> Counter[int]:
        """The lengths of the :data:`COHORT_ROWS` rows that started last
        among the rows that ended lately (with the running ones, censored,
        they say most about the rows still to come: rows are fed in prompt
        length order, and completion lengths drift along it), or of every
        row that ended when fewer than :data:`MIN_AT_RISK` did."""
        latest = heapq.nlargest(COHORT_ROWS, self._recent)
        if len(latest) < MIN_AT_RISK:
            return self.lengths
        return Counter(length for _, length in latest)

    def length_drift(self) -> float:
        """How far the mean completion length strays along the feed: the sd
        of the log of the mean length of the rows that started in each span
        of :meth:`_span` steps (spans of at least :data:`MIN_AT_RISK` rows
        whose rows have all ended: ``max_tokens`` steps ago), at least
        :data:`MIN_LENGTH_DRIFT`; :data:`UNKNOWN_LENGTH_DRIFT` before two such spans."""
        span = self._span()
        ended_before = (self.step_count - self.longest_max_tokens) // span
        means = [
            math.log(tokens / rows)
            for at, (rows, tokens) in self._by_start.items()
            if at < ended_before and rows >= MIN_AT_RISK and tokens > 0
        ]
        if len(means) < 2:
            return UNKNOWN_LENGTH_DRIFT
        return max(statistics.pstdev(means), MIN_LENGTH_DRIFT)

    def _span(self) -> int:
        """Steps per span of :meth:`length_drift`: an eighth of ``max_tokens``, at least 8."""
        return max(self.longest_max_tokens // 8, 8)

    def survival_and_known(self) -> tuple[list[float], int]:
        """:meth:`survival` and the length up to which it is estimated from
        this run's rows (tokens: where fewer than :data:`MIN_AT_RISK` of them
        are known to reach it, or past the longest seen), in one pass. An
        earlier run's lengths stand in until this run has seen
        :data:`MIN_AT_RISK` rows, then count within the known lengths only;
        its longest count as rows still running, not as rows that ended there
        (most likely they were cut at its ``max_tokens``, which need not be this
        job's: 1,000 short questions (max_tokens 256) with ShareGPT's lengths
        (128) took every row past 128 to end at 129, and the ETA was 50% short)."""
        top = self.longest_max_tokens
        lengths = self._cohort()
        running = Counter(min(g, top) for g in self.running)  # running with g tokens: longer than g
        censored = {k: float(n) for k, n in running.items()}
        ended = {k: float(n) for k, n in lengths.items()}
        prior_weight = PRIOR_ROWS / self.prior.total() if self.prior else 0.0
        prior_top = min(max(self.prior, default=0), top)
        for length, n in self.prior.items():
            if min(length, top) < prior_top:
                ended[length] = ended.get(length, 0.0) + n * prior_weight
            else:
                censored[prior_top] = censored.get(prior_top, 0.0) + n * prior_weight
        run_at_risk = lengths.total() + len(self.running)
        own_rows = not self.prior or run_at_risk >= MIN_AT_RISK  # else the earlier run's lengths stand in
        at_risk: float = run_at_risk + (PRIOR_ROWS if self.prior else 0)
        last_seen = max(max(lengths, default=0), max(self.running, default=0))
        s, out, known = 1.0, [], top
        for k in range(top + 1):
            if own_rows and (k > last_seen or run_at_risk < MIN_AT_RISK):
                known = min(known, k)
                out.append(s if k < top else 0.0)  # past what was seen well: the tail (see Futures)
                continue
            s *= 1 - ended.get(k, 0.0) / at_risk if at_risk > 0 else 1.0
            out.append(max(s, 0.0) if k < top else 0.0)
            at_risk -= ended.get(k, 0.0) + censored.get(k, 0)
            run_at_risk -= lengths.get(k, 0) + running.get(k, 0)
        return out, known

    def length_quantiles(self) -> list[int]:
        """The completion lengths of the rows that ended, as
        :data:`LENGTH_QUANTILES` quantiles (tokens; [] when none ended): a
        later run's ``prior``."""
        lengths = sorted(self.lengths.elements())
        if not lengths:
            return []
        last = len(lengths) - 1
        return [lengths[round(i * last / (LENGTH_QUANTILES - 1))] for i in range(LENGTH_QUANTILES)]

    def eta_s(self, total_rows: int | None, failed_rows: int = 0) -> float | None:
        """Seconds left for ``total_rows`` rows in all: :meth:`outlook`'s point; None before a step was timed."""
        outlook = self.outlook(total_rows, failed_rows)
        return None if outlook is None else outlook.point

    def outlook(self, total_rows: int | None, failed_rows: int = 0) -> EtaRange | None:
        """The seconds left as a range (see the module docstring) for
        ``total_rows`` rows in all (None: the planned ones), of which
        ``failed_rows`` failed before they were planned. None before a row
        was planned or before a step was timed."""
        if not self.planned_rows or not self.steps:
            return None
        rows = Futures(self, total_rows, failed_rows)
        prefill_left = self._prompt_left(total_rows, failed_rows) * (1 - self.cached_share())
        most = self._most_rows()
        if self.step_cost_same_job:
            models, spread = [self.step_cost], max(self.step_cost.spread, SAME_JOB_SPREAD)
        else:  # other jobs' batch rates are theirs: this run's own, once it has seen both kinds of batch
            own = batch_rates(self.sampled_steps, self.step_cost, most, every_bin=True)
            models = [replace(model, batch_rates=own) for model in self.step_cost.neighbours()]
            spread = self.step_cost.spread if self.same_job else max(self.step_cost.spread, OTHER_JOBS_SPREAD)
        drift = spread_factors(spread, self.rng)
        rates = [self._rate(model) for model in models]
        seconds, tokens = [], []
        for i in range(SAMPLES):
            steps, decoded, context, batches = rows.draw(i)
            cost, rate = models[i % len(models)], rates[i % len(models)]
            decoding = cost.overhead_tokens * steps + decoded + cost.context_weight * context
            decoding *= cost.batches_factor(batches, most)
            work = decoding + cost.prefill_weight * prefill_left
            seconds.append(rate * drift[i] * work)
            tokens.append(decoded)
        seconds.sort()
        low, high = (seconds[min(round(q * (SAMPLES - 1)), SAMPLES - 1)] for q in RANGE_QUANTILES)
        return EtaRange(low, statistics.median(seconds), high, statistics.fmean(tokens))

    def _rate(self, model: StepCost) -> float:
        """Seconds per unit of a step's work under ``model``, the median over the recent steps
        (:meth:`StepCost.step_rates`), where a run timed by its own job's fit counts that fit's run's ``rate`` for
        each of the :data:`RECENT_STEPS` not seen yet: ShareGPT's run again's first steps ran at 1.83x its later
        rate, its first run at 1.00x (2-core Zen 4; ``bench/results/eta-range-replayed-20261205-prior-rate.md``)."""
        rates = model.step_rates(self.steps, self._most_rows())
        if self.step_cost_same_job and model.rate > 0:
            rates += [model.rate] * (RECENT_STEPS - len(rates))
        return statistics.median(rates)

    def _most_rows(self) -> int:
        """The most rows the engine decodes at once (its ``max_num_seqs``, else the most seen)."""
        return max(self.max_running or self.concurrency, self.concurrency, 1)

    def fitted_step_cost(self) -> StepCost | None:
        """The step model fitted to this run's steps, with its batch rates
        (None for too few) and its rate: the next run's ``step_cost``."""
        fit = fit_step_cost(self.sampled_steps)
        if fit is None:
            return None
        fit = replace(fit, batch_rates=batch_rates(self.sampled_steps, fit, most := self._most_rows()))
        return replace(fit, rate=statistics.median(fit.step_rates(self.sampled_steps, most)))
