"""A job's decode work and a decode step's cost (bulkinfer/jobs/decode_steps.py):
the steps a continuous batch takes, the context its rows attend over, and
the line fitted to measured steps (the real engine's steps:
tests/e2e/test_e2e.py::test_a_decode_step_costs_more_with_more_rows_and_context)."""

from __future__ import annotations

import pytest

from bulkinfer.jobs.decode_steps import (
    DECODE_GRID,
    SIMULATED_ROWS,
    DecodeCost,
    DecodeWork,
    decode_steps,
    decode_work,
    fit_decode_cost,
    fit_decode_line,
    grid_context,
)


def test_a_continuous_batch_refills_a_freed_slot_at_once() -> None:
    # two slots: rows of 3 and 1 start; the 1 ends after step 1, the 2 takes its slot and ends at step 3 with the 3
    assert decode_steps([3, 1, 2], rows=3, max_num_seqs=2) == 3
    # one slot: one row after another
    assert decode_steps([3, 1, 2], rows=3, max_num_seqs=1) == 6
    # every row at once: the longest decides
    assert decode_steps([3, 1, 2], rows=3, max_num_seqs=256) == 3
    # the sample cycled: 6 rows of 3, 1, 2, 3, 1, 2 in two slots -> 6 steps
    assert decode_steps([3, 1, 2], rows=6, max_num_seqs=2) == 6


def test_rows_of_no_tokens_take_no_step_and_long_jobs_are_scaled() -> None:
    assert decode_steps([0, 5], rows=4, max_num_seqs=1) == 10  # two rows of 5, one after the other
    assert decode_steps([0, 0], rows=4, max_num_seqs=1) == 0
    assert decode_steps([], rows=4, max_num_seqs=1) == 0
    # a million rows of 4 tokens, 256 at once: 15,625 full steps (simulated as SIMULATED_ROWS, scaled)
    assert SIMULATED_ROWS < 10**6 and decode_steps([4], rows=10**6, max_num_seqs=256) == 15_625
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_steps([1], rows=1, max_num_seqs=0)


def test_the_work_counts_every_rows_context_at_every_step() -> None:
    # a row of 10 prompt tokens generating 3: its steps attend over 10, 11 and 12 tokens
    assert decode_work([(10, 3)], rows=1, max_num_seqs=8) == DecodeWork(steps=3, tokens=3, context=33, prompt_tokens=10)
    # two such rows and one of 100 x 2 (100 + 101), all at once
    assert decode_work([(10, 3), (10, 3), (100, 2)], 3, 8) == DecodeWork(3, 8, 267, 120)
    # the sample cycled to a job of 30 rows: ten times its tokens, context and prompts; its steps simulated
    work = decode_work([(10, 3), (10, 3), (100, 2)], 30, 8)
    assert (work.tokens, work.context, work.prompt_tokens) == (80, 2670, 1200)
    assert work.steps == decode_steps([3, 3, 2], 30, 8)
    assert decode_work([], 5, 8) == DecodeWork(0, 0, 0)


def test_the_fit_finds_a_line_again_and_keeps_every_term_at_least_zero() -> None:
    truth = DecodeCost(fixed_s=0.02, per_row_s=0.001, per_context_token_s=4e-6)
    points = [(r, grid_context(r, p), 0.02 + 0.001 * r + 4e-6 * grid_context(r, p)) for r, p in DECODE_GRID]
    fitted = fit_decode_line(points)
    assert fitted.fixed_s == pytest.approx(truth.fixed_s)
    assert fitted.per_row_s == pytest.approx(truth.per_row_s)
    assert fitted.per_context_token_s == pytest.approx(truth.per_context_token_s)
    # the step of most context is the fastest: the context term fits below 0 (-1/1975) and is dropped; then the
    # fixed cost fits below 0 (-0.5) and is dropped; the rows alone: (0.5 + 2 x 2 + 4 x 4) / (1 + 4 + 16) a row
    odd = fit_decode_line([(1, 1000, 0.5), (2, 10, 2.0), (4, 5, 4.0)])
    assert odd == DecodeCost(fixed_s=0.0, per_row_s=pytest.approx(20.5 / 21), per_context_token_s=0.0)
    with pytest.raises(ValueError, match="cannot fit"):
        fit_decode_line([(1, 1, 1.0)])


def test_the_grids_prefill_is_its_seconds_over_its_prompt_tokens() -> None:
    # 1 x 32 tokens at 1 ms a token (a whole step for few tokens), 64 x 512 at 0.1 ms: 32.768 s of 32,800 tokens
    # weigh as such, not as the mean of the two points' figures (0.55 ms)
    steps = {(r, p): 0.02 + 0.001 * r + 4e-6 * grid_context(r, p) for r, p in DECODE_GRID}
    grid = [(r, p, steps[r, p], 1e-3 if (r, p) == (1, 32) else 1e-4) for r, p in DECODE_GRID]
    prompts = sum(r * p for r, p in DECODE_GRID)
    cost = fit_decode_cost(grid)
    assert cost.per_prompt_token_s == pytest.approx((32 * 1e-3 + (prompts - 32) * 1e-4) / prompts)
    assert cost.per_context_token_s == pytest.approx(4e-6)


def test_a_cost_prices_work_and_reads_back_only_what_it_wrote() -> None:
    cost = DecodeCost(fixed_s=0.02, per_row_s=0.001, per_context_token_s=4e-6, per_prompt_token_s=1e-4)
    work = DecodeWork(steps=100, tokens=1_000, context=1_000_000, prompt_tokens=20_000)
    assert cost.seconds(work) == pytest.approx(2 + 1 + 4 + 2)
    assert DecodeCost.from_json(cost.to_json()) == cost
    assert DecodeCost.from_json({"fixed_s": 1}) is None
    assert DecodeCost.from_json(None) is None
