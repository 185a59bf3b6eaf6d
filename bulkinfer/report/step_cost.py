"""What an engine step costs: the time model of the ETA.

An engine step decodes one token for each running request, prefills some
prompt tokens, and attends over the context of every running request. Its
seconds are modelled as::

    scale * (decoded + OVERHEAD_TOKENS + context_weight * context + prefill_weight * prefilled)

``decoded``, ``prefilled`` and ``context`` (the prompt and completion tokens
so far of the running requests) in tokens. ``scale`` (seconds per decoded
token) is measured during each run (the median over its recent steps); the
weights are a property of the model and the machine: fitted over a whole
run's steps when it ends (:func:`fit_step_cost`) and stored with the run's
calibration entry; the next run of the model on the machine starts with the
median of the newest :data:`POOLED_FITS` stored fits (:func:`pooled`), so
one run disturbed by other work on the machine does not mis-time the
next. ``spread`` is how far the model's rate drifts over a run (the
standard deviation of the log of the median rate of blocks of
:data:`BLOCK_STEPS` steps, measured against the whole run's): the ETA
range's time component. ``batch_rates`` (:func:`batch_rates`): how much
slower per unit of work the run's full batches ran than its other
decode-only steps, for a run again of the same job. ``prefilled`` counts
the prompt tokens a step computed, not those from the prefix cache.

Fitted on two recordings of real runs on a 2-core AMD EPYC (SmolLM2-135M,
float32; ``bench/results/eta-trace-{short,sharegpt}.json``):
``context_weight`` 0.002 and 0.004, ``prefill_weight`` 0.5 and 0.75; the
fixed cost of a step is about 16 decoded tokens (``OVERHEAD_TOKENS``); the
defaults below sit between the two. Without the context term the rate
per decoded token rose 1.65x from the first tenth of a run to the last (the
context grows), and the ETA of a run again was 15% short at half-time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# A step's fixed cost in decoded-token equivalents (see the module docstring).
OVERHEAD_TOKENS = 16.0


# Steps per block when the drift of the rate is measured.
BLOCK_STEPS = 32


# The fit's grids (see fit_step_cost).
CONTEXT_WEIGHTS = (0.0, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
# Prefill weights from 1/16: on an AMX Xeon (bfloat16) a prompt token cost 0.12-0.4 of a decoded one
# (least squares over each run's steps, bench/results/eta-range-xeon*-*.json), under 0.25, the floor before.
PREFILL_WEIGHTS = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
OVERHEADS = (4.0, 8.0, 16.0, 32.0, 64.0)


# No fewer steps are fitted.
MIN_FIT_STEPS = 64


# A run's step model: the median of this many newest fits of the model on the machine.
POOLED_FITS = 5


# The smallest spread a fit reports: a run is never known to better than this.
MIN_SPREAD = 0.05


# Only fits whose rate wandered at most this much (their spread) time other runs (see pooled): on a
# 2-core Zen 3 the ETA bench's runs alone fitted 0.05-0.10, ten serve batches beside online requests
# 0.16-0.67 (overhead 64, context weight 0), and a first run timed by those erred +171% and +195% at
# its end (ShareGPT, replayed: bench/results/eta-range-zen3-calm.md), +24% and -25% by the defaults.
CALM_SPREAD = 0.15


# A fit's batch rates (see batch_rates): decode-only steps in two bins, full batches (at least this
# share of the run's most rows at once) and the rest.
FULL_BATCH = 0.875


BATCH_BINS = 2


# A bin's rate is measured over at least this many steps (else it counts as the run's median).
MIN_BIN_STEPS = 4


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: ``seconds`` it took, tokens ``decoded`` and
    ``prefilled`` in it, ``context`` tokens of its running requests."""

    seconds: float
    decoded: int
    prefilled: int
    context: float


@dataclass(frozen=True, slots=True)
class StepCost:
    """The weights of the step model (see the module docstring), the rate's
    ``spread``, the fitted run's ``batch_rates`` (:func:`batch_rates`;
    empty: none) and its ``rate``: the median of its steps' seconds per unit
    of work (seconds; 0: not known), which a run again of the same job takes
    until it has seen steps of its own (``WorkEstimate._rate``)."""

    context_weight: float = 0.003
    prefill_weight: float = 0.6
    spread: float = 0.1
    overhead_tokens: float = OVERHEAD_TOKENS
    batch_rates: tuple[float, ...] = ()
    rate: float = 0.0

    def work(self, step: Step) -> float:
        """A step's work in decoded-token equivalents."""
        return (
            step.decoded
            + self.overhead_tokens
            + self.context_weight * step.context
            + self.prefill_weight * step.prefilled
        )

    def step_rates(self, steps: Sequence[Step], most: float) -> list[float]:
        """Each step's seconds per unit of work (a decode-only step's work at
        its batch's rate, :meth:`batch_factor`; ``most``: the most rows at once)."""
        return [
            s.seconds / (self.work(s) * (1.0 if s.prefilled else self.batch_factor(s.decoded, most))) for s in steps
        ]

    def neighbours(self) -> list[StepCost]:
        """The models around this one that a run's steps cannot tell apart
        from it (each weight halved, kept and doubled; a zero context weight
        tried at :data:`CONTEXT_WEIGHTS`' next two): 27 models, this one first."""
        contexts = (
            [self.context_weight * f for f in (1.0, 0.5, 2.0)] if self.context_weight else [0.0, *CONTEXT_WEIGHTS[1:3]]
        )
        return [
            StepCost(c, p * self.prefill_weight, self.spread, o * self.overhead_tokens)
            for c in contexts
            for p in (1.0, 2 / 3, 1.5)
            for o in (1.0, 0.5, 2.0)
        ]

    @property
    def calm(self) -> bool:
        """The fitted run's rate wandered at most :data:`CALM_SPREAD`: the fit may time other runs."""
        return self.spread <= CALM_SPREAD

    def batch_factor(self, rows: float, most: float) -> float:
        """How much slower per unit of work a decode-only step of ``rows``
        rows ran than the fitted run's median, ``most`` the most rows at once
        (:func:`batch_rates`; 1.0 without them)."""
        if len(self.batch_rates) != BATCH_BINS or most <= 0:
            return 1.0
        return math.exp(self.batch_rates[_bin(rows, most)])

    def batches_factor(self, batches: Sequence[tuple[int, float]], most: float) -> float:
        """Steps to come (``batches``: (rows, steps)) at their batches' rates
        (:meth:`batch_factor`): their mean factor, each step weighted by its
        work (rows and the fixed cost); 1.0 without batch rates or steps."""
        if not self.batch_rates or not batches:
            return 1.0
        weights = [(rows + self.overhead_tokens) * steps for rows, steps in batches]
        factors = [self.batch_factor(rows, most) for rows, _ in batches]
        return sum(w * f for w, f in zip(weights, factors, strict=True)) / sum(weights)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = asdict(self)
        data["batch_rates"] = list(self.batch_rates)
        return data

    @classmethod
    def from_json(cls, data: Any) -> StepCost | None:
        """A stored model, or None when ``data`` is not one."""
        if not isinstance(data, dict):
            return None
        try:
            values = [float(data[name]) for name in ("context_weight", "prefill_weight", "spread")]
            values += [float(data.get("overhead_tokens", OVERHEAD_TOKENS)), float(data.get("rate", 0.0))]
            bins = tuple(float(v) for v in data.get("batch_rates") or ())
        except (KeyError, TypeError, ValueError):
            return None
        if not all(math.isfinite(v) and v >= 0 for v in values) or not all(math.isfinite(v) for v in bins):
            return None
        context, prefill, spread, overhead, rate = values
        return cls(context, prefill, spread, overhead, bins if len(bins) == BATCH_BINS else (), rate)


def fit_step_cost(steps: Sequence[Step]) -> StepCost | None:
    """The step model (weights on :data:`CONTEXT_WEIGHTS` x
    :data:`PREFILL_WEIGHTS` x :data:`OVERHEADS`) under which the steps'
    seconds per unit of work vary least (the absolute log deviation from
    their median, each step weighted by its seconds), and the drift of that
    rate over the run (:func:`_drift`) as its ``spread`` (at least
    :data:`MIN_SPREAD`). None for fewer than :data:`MIN_FIT_STEPS` steps.

    Weighted by seconds because the ETA forecasts seconds: a run's few
    prefill-heavy steps (10 of 245 in a ShareGPT run, a quarter of its
    time) priced wrong mis-time its first estimates, which take the rate
    from those steps; counted one per step they barely moved the fit, and a
    ShareGPT run again's point erred +36% at 10% of the run on an AMX Xeon
    (+28% weighted; replayed, ``bench/results/eta-range-xeon-nucleus-replayed-own-fits.md``)."""
    steps = [s for s in steps if s.seconds > 0]
    if len(steps) < MIN_FIT_STEPS:
        return None
    seconds = [s.seconds for s in steps]
    best: tuple[float, StepCost] | None = None
    for context_weight in CONTEXT_WEIGHTS:
        for prefill_weight in PREFILL_WEIGHTS:
            for overhead in OVERHEADS:
                model = StepCost(context_weight, prefill_weight, overhead_tokens=overhead)
                logs = [math.log(s.seconds / model.work(s)) for s in steps]
                centre = statistics.median(logs)
                deviation = sum(t * abs(v - centre) for t, v in zip(seconds, logs, strict=True))
                if best is None or deviation < best[0]:
                    best = (deviation, model)
    assert best is not None
    model = best[1]
    return StepCost(
        model.context_weight, model.prefill_weight, max(_drift(steps, model), MIN_SPREAD), model.overhead_tokens
    )


def pooled(fits: Sequence[StepCost]) -> StepCost | None:
    """The step model of several runs' fits (``fits`` oldest first): each
    weight and the spread the median of the newest :data:`POOLED_FITS` whose
    spread is at most :data:`CALM_SPREAD`. A fit of a run whose rate
    wandered more is left out: a run slowed by other work on the machine
    (measured on a 2-core Zen 3: context weight 0.008, prefill 1.5, overhead
    32 against 0.002-0.004, 0.5-0.75 and 16 alone) or a serve batch beside
    online requests. None for no calm fits: the defaults time the run."""
    return median_model([f for f in fits if f.calm][-POOLED_FITS:])


def median_model(fits: Sequence[StepCost]) -> StepCost | None:
    """Each weight, the spread, each batch rate and the rate (over the fits
    that have them) the median over ``fits``; None for none."""
    if not fits:
        return None
    rates = [f.batch_rates for f in fits if len(f.batch_rates) == BATCH_BINS]
    bins = tuple(statistics.median(b) for b in zip(*rates, strict=True)) if rates else ()
    context, prefill, spread, overhead = (statistics.median(getattr(f, name) for f in fits) for name in _FIELDS)
    rate = statistics.median([f.rate for f in fits if f.rate > 0] or [0.0])
    return StepCost(context, prefill, spread, overhead, bins, rate)


_FIELDS = ("context_weight", "prefill_weight", "spread", "overhead_tokens")


def _drift(steps: Sequence[Step], model: StepCost) -> float:
    """How far the rate of blocks of :data:`BLOCK_STEPS` steps strays from
    the whole run's: the root mean square of the log of their ratio."""
    rates = [s.seconds / model.work(s) for s in steps]
    whole = statistics.median(rates)
    starts = range(0, len(rates), BLOCK_STEPS)
    blocks = [math.log(statistics.median(rates[i : i + BLOCK_STEPS]) / whole) for i in starts]
    return math.sqrt(statistics.fmean(b * b for b in blocks))


def batch_rates(steps: Sequence[Step], model: StepCost, most: float, *, every_bin: bool = False) -> tuple[float, ...]:
    """What the linear model misses of how a step's cost grows with its
    batch: the decode-only steps (none prefilled) in :data:`BATCH_BINS` bins,
    full batches (:data:`FULL_BATCH` of ``most``, the most rows the engine
    decodes at once, as :meth:`StepCost.batch_factor` is asked) and the rest,
    each the log of its median seconds per unit of work over the median of
    them all (0 for a bin of fewer than :data:`MIN_BIN_STEPS` steps). A run
    again of the same job takes its recent rate and times each step to come
    at their bins' ratio. On an AMX Xeon (bfloat16) a multi-turn job's full
    batches (256 rows) took 0.45-0.7 s a step and its batches of 150-180
    rows 0.2-0.27 s: +0.39 and -0.08 (first run), +0.40 and -0.12 (run
    again), and timed at its full batches' rate that run again's point
    erred +49% at 60% of the run (``bench/results/eta-range-xeon-own-fits.md``).
    Most of that was the context mis-counted: each row's at the planned
    rows' mean prompt (597 tokens), while the full batches' rows held prompts
    of 800-930 and the drain's of 40-150 (rows are fed longest first).
    Counted from the running rows' own prompts, the same runs' bins are
    within +-0.17 (refitted by ``bench.eta_trace.fitted_step_cost``). Empty without
    decode-only steps, and with ``every_bin`` unless every bin has
    :data:`MIN_BIN_STEPS` (a run still going: it knows only what it saw)."""
    decode = [s for s in steps if s.prefilled == 0 and s.decoded > 0 and s.seconds > 0]
    if not decode:
        return ()
    rates = [s.seconds / model.work(s) for s in decode]
    centre = statistics.median(rates)
    bins: list[list[float]] = [[] for _ in range(BATCH_BINS)]
    for s, rate in zip(decode, rates, strict=True):
        bins[_bin(s.decoded, most)].append(rate)
    if every_bin and min(len(b) for b in bins) < MIN_BIN_STEPS:
        return ()
    return tuple(math.log(statistics.median(b) / centre) if len(b) >= MIN_BIN_STEPS else 0.0 for b in bins)


def _bin(rows: float, most: float) -> int:
    """A decode-only step's batch bin: 1 for a full batch (:data:`FULL_BATCH`), else 0."""
    return int(rows >= FULL_BATCH * most)
