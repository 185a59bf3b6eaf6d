"""The ETA's step model: fitted back from steps a known model timed; stored
and read back; its neighbours (the models a run cannot tell from it)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from bulkinfer.report.step_cost import (
    CALM_SPREAD,
    POOLED_FITS,
    Step,
    StepCost,
    batch_rates,
    fit_step_cost,
    median_model,
    pooled,
)


def timed_steps(model: StepCost, scale: float, seed: int = 0) -> list[Step]:
    """A run's steps as an engine of ``model`` would time them (2% noise):
    prefill-heavy steps, full batches with growing context, a draining tail."""
    rng = random.Random(seed)
    steps = []
    for k in range(600):
        running = 256 if k < 450 else 256 - (k - 450) * 256 // 150
        prefilled = 2048 if k < 20 else rng.choice((0, 0, 0, 40, 300))
        context = running * (120 + (k % 200))
        step = Step(0.0, running, prefilled, context)
        steps.append(Step(scale * model.work(step) * rng.uniform(0.98, 1.02), running, prefilled, context))
    return steps


@pytest.mark.parametrize(
    "truth", [StepCost(0.002, 0.5, overhead_tokens=16.0), StepCost(0.0005, 1.0, overhead_tokens=32.0)]
)
def test_the_fit_finds_the_weights_the_steps_were_timed_with(truth: StepCost) -> None:
    fitted = fit_step_cost(timed_steps(truth, 0.003))
    assert fitted is not None
    assert (fitted.context_weight, fitted.prefill_weight, fitted.overhead_tokens) == (
        truth.context_weight,
        truth.prefill_weight,
        truth.overhead_tokens,
    )
    assert 0.05 <= fitted.spread < 0.1  # the noise is 2%: the floor, MIN_SPREAD, or a little above


def test_the_fit_keeps_how_much_slower_its_full_batches_ran() -> None:
    """An engine whose full batches (256 rows) take 1.5x the model's time:
    the fit's batch rates say so, from its decode-only steps; an engine the
    model fits says nothing."""
    truth = StepCost(0.002, 0.5, overhead_tokens=16.0)
    steps = [
        Step(s.seconds * (1.5 if s.decoded == 256 and not s.prefilled else 1.0), s.decoded, s.prefilled, s.context)
        for s in timed_steps(truth, 0.003)
    ]
    rates = batch_rates(steps, truth, 256)
    assert rates[1] - rates[0] == pytest.approx(math.log(1.5), abs=0.03)
    assert all(abs(v) < 0.03 for v in batch_rates(timed_steps(truth, 0.003), truth, 256))
    fitted = fit_step_cost(steps)
    assert fitted is not None and fitted.batch_rates == ()  # the fit alone: the run's end adds them (WorkEstimate)
    assert StepCost.from_json(replace(truth, batch_rates=rates).to_json()) == replace(truth, batch_rates=rates)
    assert StepCost.from_json({**truth.to_json(), "batch_rates": [0.1]}) == truth  # not one per bin: none
    # pooled: each bin's median over the fits that have batch rates
    pooled_ = median_model([replace(truth, batch_rates=(0.0, 0.2)), replace(truth, batch_rates=(0.0, 0.4)), truth])
    assert pooled_ is not None and pooled_.batch_rates == pytest.approx((0.0, 0.3))
    # and the rate: the median over the fits that know one
    rated = median_model([replace(truth, rate=1e-3), replace(truth, rate=3e-3), truth])
    assert rated is not None and rated.rate == pytest.approx(2e-3)


def test_too_few_steps_fit_nothing() -> None:
    assert fit_step_cost(timed_steps(StepCost(), 0.003)[:63]) is None


def test_a_stored_model_reads_back_and_a_broken_one_reads_as_none() -> None:
    model = StepCost(0.004, 0.75, 0.08, 24.0)
    assert StepCost.from_json(model.to_json()) == model
    assert StepCost.from_json(replace(model, rate=0.0012).to_json()) == replace(model, rate=0.0012)
    assert StepCost.from_json({**model.to_json(), "rate": -1.0}) is None
    assert StepCost.from_json({"context_weight": 0.001, "prefill_weight": 0.5, "spread": 0.1}) == StepCost(
        0.001, 0.5, 0.1
    )
    for broken in (None, [], {"context_weight": "x", "prefill_weight": 0.5, "spread": 0.1}, {"prefill_weight": 1}):
        assert StepCost.from_json(broken) is None
    assert StepCost.from_json({"context_weight": -1, "prefill_weight": 0.5, "spread": 0.1}) is None


def test_the_neighbours_halve_and_double_each_weight_the_model_first() -> None:
    model = StepCost(0.002, 0.6, 0.1, 16.0)
    neighbours = model.neighbours()
    assert len(neighbours) == 27 and neighbours[0] == model
    assert {n.context_weight for n in neighbours} == {0.001, 0.002, 0.004}
    assert {n.overhead_tokens for n in neighbours} == {8.0, 16.0, 32.0}
    assert {round(n.prefill_weight, 3) for n in neighbours} == {0.4, 0.6, 0.9}
    assert {n.context_weight for n in StepCost(0.0).neighbours()} == {0.0, 0.00025, 0.0005}


def test_pooled_fits_are_the_median_of_the_newest_calm_ones_each_weight_apart() -> None:
    calm = [StepCost(0.002, 0.5, 0.06, 16.0), StepCost(0.004, 0.75, 0.08, 16.0), StepCost(0.002, 0.75, 0.07, 8.0)]
    contended = StepCost(0.008, 1.5, 0.4, 32.0)
    assert weights(pooled(calm[:2])) == pytest.approx(StepCost(0.003, 0.625, 0.07, 16.0).to_json())  # two: halfway
    assert pooled(calm + [contended]) == pooled(calm) == StepCost(0.002, 0.75, 0.07, 16.0)  # the contended left out
    assert pooled([calm[1]]) == pooled([calm[1], contended]) == calm[1]
    assert pooled([]) is None
    assert pooled([contended] * 3) is None  # no calm fit: the defaults
    assert pooled([StepCost(spread=CALM_SPREAD)]) == StepCost(spread=CALM_SPREAD)
    older = [StepCost(0.032, 3.0, 0.05, 64.0)] * 10
    assert pooled(older + calm + calm[:2]) == StepCost(0.002, 0.75, 0.07, 16.0)  # only the newest POOLED_FITS count
    assert POOLED_FITS == 5


def weights(model: StepCost | None) -> dict[str, float]:
    assert model is not None
    return model.to_json()
