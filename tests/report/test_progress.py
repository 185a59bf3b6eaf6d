"""The progress line's estimates: tokens/s from the engine's live counts and
an ETA from the work left (prompt and completion tokens), checked against a
simulated continuous-batching engine on a fake clock."""

from __future__ import annotations

import io
import math
import random
import re
import statistics
from dataclasses import dataclass, field

import pytest

import bulkinfer.report.eta as eta_module
import bulkinfer.report.progress as progress_module
from bulkinfer.report.calibration import LengthPrior
from bulkinfer.report.eta import SAME_JOB_SPREAD, EtaRange, WorkEstimate
from bulkinfer.report.progress import Progress, eta_text
from bulkinfer.report.step_cost import OVERHEAD_TOKENS, StepCost

PROMPT_S, COMPLETION_S, STEP_S = 0.001, 0.0025, 0.005  # the simulated engine's costs (ratio as measured on CPU)
BUDGET = 2048  # tokens per step, prompt and completion (vLLM's max_num_batched_tokens)
# The step model an earlier run on the simulated machine would have stored: no attention cost, a
# prompt token at PROMPT_S / COMPLETION_S of a decoded one.
SIMULATED_COST = StepCost(0.0, PROMPT_S / COMPLETION_S, 0.05, STEP_S / COMPLETION_S)
SIMULATED_MACHINE = LengthPrior([], False, SIMULATED_COST)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Simulation:
    """``slots`` requests decode together; a step costs STEP_S plus PROMPT_S per
    prompt token it prefills and COMPLETION_S per token it decodes, within a
    budget of BUDGET tokens (a new row's prompt is prefilled whole, in one
    step). Rows are (prompt tokens, completion length) in feed order."""

    rows: list[tuple[int, int]]
    slots: int
    max_tokens: int
    clock: Clock = field(default_factory=Clock)
    etas: list[tuple[float, float | None]] = field(default_factory=list)  # (time, eta)
    # (time, completion tok/s so far, the run's expected completion tok/s)
    rates: list[tuple[float, float, float | None]] = field(default_factory=list)

    def run(self, progress: Progress) -> float:
        for prompt, _ in self.rows:
            progress.planned(prompt, self.max_tokens)
        waiting = list(self.rows)
        running: list[list[int]] = []  # [tokens so far, length]
        generated = prefilled = 0
        while waiting or running:
            cost = STEP_S
            for row in running:
                row[0] += 1
                generated += 1
                cost += COMPLETION_S
            budget = BUDGET - len(running)
            while waiting and len(running) < self.slots and waiting[0][0] <= budget:
                prompt, length = waiting.pop(0)
                budget -= prompt
                running.append([1, length])  # the prefill step yields the first token
                prefilled += prompt
                generated += 1
                cost += PROMPT_S * prompt
            self.clock.now += cost
            for row in [r for r in running if r[0] >= r[1]]:
                running.remove(row)
                progress.update(done=1, completion_tokens=row[1])
            progress.tick(generated, prefilled, [r[0] for r in running])
            self.etas.append((self.clock.now, progress.eta_s()))
            self.rates.append((self.clock.now, progress.tokens_per_s(), progress.expected_tokens_per_s()))
        return self.clock.now

    def errors_at(self, fractions: tuple[float, ...]) -> list[float]:
        """eta / real time left - 1 at each fraction of the run's time."""
        end = self.clock.now
        out = []
        for fraction in fractions:
            t, eta = min(self.etas, key=lambda x: abs(x[0] - fraction * end))
            assert eta is not None
            out.append(eta / (end - t) - 1)
        return out


def mixed_rows(n: int, max_tokens: int, seed: int = 0) -> list[tuple[int, int]]:
    """Short answers (5-30 tokens) and long ones (most cut at max_tokens), prompts 10-400 tokens, longest first."""
    rng = random.Random(seed)
    rows = [
        (rng.randint(10, 400), rng.randint(5, 30) if rng.random() < 0.6 else min(rng.randint(100, 400), max_tokens))
        for _ in range(n)
    ]
    return sorted(rows, reverse=True)


@pytest.mark.parametrize(
    ("rows", "slots"),
    [
        (mixed_rows(1000, 256), 64),  # many more rows than slots: a steady stream
        ([(300, 128)] * 200, 64),  # every completion runs to max_tokens
    ],
)
def test_eta_from_the_work_left_is_close_from_10_percent_on(rows: list[tuple[int, int]], slots: int) -> None:
    max_tokens = max(length for _, length in rows)
    sim = Simulation(rows, slots, max_tokens)
    progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=sim.clock, prior=SIMULATED_MACHINE)
    sim.run(progress)
    errors = sim.errors_at((0.10, 0.25, 0.50, 0.75))
    assert all(abs(e) <= 0.35 for e in errors), errors


def test_eta_before_any_row_ended_assumes_max_tokens_then_comes_close() -> None:
    """Every row at once, 60% of them short: until rows end, nothing tells
    their lengths and the ETA assumes max_tokens (too long, never too short);
    from half-way it is within 35%."""
    rows = mixed_rows(300, 128, seed=1)
    sim = Simulation(rows, 256, 128)
    progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=sim.clock, prior=SIMULATED_MACHINE)
    sim.run(progress)
    early = sim.errors_at((0.10, 0.25))
    assert all(0 < e <= 1.0 for e in early), early
    late = sim.errors_at((0.50, 0.75))
    assert all(abs(e) <= 0.35 for e in late), late


def test_rows_left_over_rows_done_would_be_far_off() -> None:
    """The estimate the progress line used to print (rows left x time per row
    done) on the all-at-once case: the reason for the work-based one."""
    rows = mixed_rows(300, 128, seed=1)
    sim = Simulation(rows, 256, 128)
    progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=sim.clock, prior=SIMULATED_MACHINE)
    done_at: list[tuple[float, int]] = []
    real_update = progress.update

    def update(**kwargs: int) -> None:
        real_update(**kwargs)
        done_at.append((sim.clock.now, progress.done))

    progress.update = update  # type: ignore[method-assign]
    end = sim.run(progress)
    t, done = min(done_at, key=lambda x: abs(x[0] - 0.25 * end))
    by_rows = (len(rows) - done) * t / done
    assert abs(by_rows / (end - t) - 1) > 0.5


def test_tokens_per_s_counts_unfinished_rows() -> None:
    clock = Clock()
    progress = Progress(10, stream=io.StringIO(), force_plain=True, clock=clock)
    progress.planned(20, 100)
    clock.now = 4.0
    progress.tick(200, 20, [200])  # nothing finished yet: 200 tokens in 4 s
    assert progress.tokens_per_s() == pytest.approx(50.0)
    assert progress.done == 0


def test_a_job_that_generates_nothing_counts_its_prompt_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """embed and score: the line gives the prompt tokens/s, and neither a
    completion rate nor an expected one (they were 0.0 before 2026-12-07)."""
    monkeypatch.setenv("BULKINFER_PROGRESS_INTERVAL_S", "0")
    clock, stream = Clock(), io.StringIO()
    progress = Progress(10, stream=stream, force_plain=True, clock=clock, tokens="prompt")
    for _ in range(10):
        progress.planned(40, 1)
    clock.now = 4.0
    progress.tick(0, 200, [])  # 200 prompt tokens in 4 s
    assert progress.tokens_per_s() == pytest.approx(50.0)
    for _ in range(5):
        progress.update(done=1, lengths=[0])
    clock.now = 8.0
    progress.tick(0, 400, [])  # 400 in 8 s
    line = stream.getvalue().splitlines()[-1]
    assert line.split("bulkinfer: ")[1].startswith("5/10 rows (0 failed), 50.0 prompt tok/s, eta "), line
    assert "completion" not in stream.getvalue() and "(run ~" not in stream.getvalue()


def test_survival_is_kaplan_meier_with_running_rows_censored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bulkinfer.report.eta.MIN_AT_RISK", 1)
    work = WorkEstimate()
    work.plan(10, 4)
    for length in (1, 2):
        work.finish(length)
    work.observe(0.0, 3 + 3, 20, [2])  # one row still running with 2 tokens: longer than 2
    # k=1: 3 at risk, 1 ended -> 2/3; k=2: 2 at risk (one censored after k=2), 1 ended -> 1/3;
    # past the longest length seen (2) the one left runs to max_tokens (4)
    assert work.survival() == pytest.approx([1.0, 2 / 3, 1 / 3, 1 / 3, 0.0])


def test_plain_lines_show_eta_and_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKINFER_PROGRESS_INTERVAL_S", "1")
    stream = io.StringIO()
    rows = [(100, 50)] * 40
    sim = Simulation(rows, 8, 50)
    progress = Progress(len(rows), stream=stream, force_plain=True, clock=sim.clock, prior=SIMULATED_MACHINE)
    sim.run(progress)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert any(", eta 0:00:" in line and " (run ~" in line for line in lines), lines
    assert lines[-1].endswith(f"(run ~{progress.work.generated_tokens / sim.clock.now:.1f} completion tok/s)")
    assert lines[-1].split("bulkinfer: ")[1].startswith("40/40 rows (0 failed), ")


@pytest.mark.parametrize(
    ("value", "interval", "warned"), [("2.5", 2.5, False), ("0", 0.1, False), ("abc", 10.0, True), ("nan", 10.0, True)]
)
def test_the_interval_variable_is_read_or_its_bad_value_said(
    monkeypatch: pytest.MonkeyPatch, value: str, interval: float, warned: bool
) -> None:
    monkeypatch.setenv("BULKINFER_PROGRESS_INTERVAL_S", value)
    stream = io.StringIO()
    progress = Progress(4, stream=stream, force_plain=True)
    assert progress._interval == interval
    said = stream.getvalue()
    assert (f"warning: BULKINFER_PROGRESS_INTERVAL_S='{value}' is not a number of seconds" in said) == warned, said


def test_lengths_too_few_rows_reach_count_as_max_tokens() -> None:
    """Where fewer than MIN_AT_RISK rows are known to reach a length, one more
    row ending there would swing the estimate: the rows left are taken to run
    to max_tokens from there on."""
    work = WorkEstimate()
    work.plan(10, 100)
    for _ in range(30):
        work.finish(5)
    for _ in range(10):
        work.finish(50)
    work.observe(0.0, 30 * 5 + 10 * 50, 400, [])
    survival = work.survival()
    assert survival[5] == pytest.approx(10 / 40)
    assert survival[6:100] == [survival[5]] * 94  # 10 rows reach past 5: below MIN_AT_RISK (20)
    assert survival[100] == 0.0


def test_with_an_earlier_runs_lengths_the_eta_is_close_from_10_percent_on() -> None:
    """The all-at-once case above, run again as from cron: the first run's
    completion lengths (its quantiles) are the second run's prior, and the
    ETA is within 35% from the start instead of erring long."""
    rows = mixed_rows(300, 128, seed=1)
    first = Simulation(rows, 256, 128)
    earlier = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=first.clock, prior=SIMULATED_MACHINE)
    first.run(earlier)
    prior = earlier.work.length_quantiles()
    assert len(prior) == 101 and prior[0] == min(n for _, n in rows) and prior[-1] == max(n for _, n in rows)
    again = Simulation(rows, 256, 128)
    progress = Progress(
        len(rows),
        stream=io.StringIO(),
        force_plain=True,
        clock=again.clock,
        prior=LengthPrior(prior, False, SIMULATED_COST),
    )
    again.run(progress)
    errors = again.errors_at((0.10, 0.25, 0.50, 0.75))
    assert all(abs(e) <= 0.35 for e in errors), errors


def test_the_full_batch_is_the_engines_max_num_seqs_not_the_most_seen_yet() -> None:
    """Long prompts fill the engine a few rows per step (ShareGPT: 11 rows
    running 30 s in); the rows waiting will run max_num_seqs at a time, each
    step's overhead shared by all of them, not by as few as run so far."""

    def eta(max_running: int | None) -> float:
        work = WorkEstimate(0.0, prior=[50] * 101, max_running=max_running)
        for _ in range(300):
            work.plan(100, 50)
        work.observe(1.0, 11, 1100, [1] * 11)  # one step: 11 tokens decoded, 1,100 prefilled
        result = work.eta_s(300)
        assert result is not None
        return result

    told, blind = eta(256), eta(None)
    cost = StepCost()
    # one step: 11 decoded, 1,100 prefilled, 11 rows of 100 prompt tokens and 1 completion token in context
    rate = 1.0 / (11 + OVERHEAD_TOKENS + cost.context_weight * 11 * 101 + cost.prefill_weight * 1100)
    # the work left: 289 waiting rows x 50 tokens and 11 x 49, a step's overhead per step (256 rows
    # a step, then a drain of 50 steps), the context each token attends over, the waiting rows' prompts
    tokens = 289 * 50 + 11 * 49
    steps = tokens / 256 + 50
    context = 289 * (50 * 100 + 50 * 50 / 2) + 11 * (49 * 100 + (50 * 50 - 1) / 2)
    work = tokens + OVERHEAD_TOKENS * steps + cost.context_weight * context + cost.prefill_weight * 289 * 100
    assert told == pytest.approx(rate * work, rel=0.1)
    assert blind > 1.5 * told  # 16 overhead tokens a step shared by 11 rows, not 256


def test_prompt_tokens_from_the_prefix_cache_are_not_priced_as_computed() -> None:
    """A step that found half its 1,100 prompt tokens in the prefix cache
    prefilled 550; the prompts left are priced at the share computed so far."""

    def estimate(cached: int) -> tuple[WorkEstimate, float]:
        work = WorkEstimate(0.0, prior=[50] * 101, max_running=256)
        for _ in range(300):
            work.plan(100, 50)
        work.observe(1.0, 11, 1100, [1] * 11, cached)
        result = work.eta_s(300)
        assert result is not None
        return work, result

    (plain, whole), (cached, half) = estimate(0), estimate(550)
    assert (plain.steps[-1].prefilled, cached.steps[-1].prefilled) == (1100, 550)
    assert (plain.cached_share(), cached.cached_share()) == (0.0, 0.5)
    cost = StepCost()

    def eta(computed: float) -> float:  # the step's rate times the work left, as in the test above
        rate = 1.0 / (11 + OVERHEAD_TOKENS + cost.context_weight * 11 * 101 + cost.prefill_weight * computed)
        tokens = 289 * 50 + 11 * 49
        context = 289 * (50 * 100 + 50 * 50 / 2) + 11 * (49 * 100 + (50 * 50 - 1) / 2)
        prompts = cost.prefill_weight * 289 * 100 * computed / 1100
        return rate * (tokens + OVERHEAD_TOKENS * (tokens / 256 + 50) + cost.context_weight * context + prompts)

    assert whole == pytest.approx(eta(1100), rel=0.1)
    assert half == pytest.approx(eta(550), rel=0.1)
    assert half > 1.2 * whole  # the same second bought half the prefill: the tokens left cost more of it


def test_the_same_job_run_again_expects_its_earlier_total_not_the_rows_done_so_far() -> None:
    """Rows fed in prompt-length order whose answers grow along the order
    (the 1,000 short questions of bench.eta: short answers first). Run
    again with the first run's lengths: the rows done so far are shorter
    than the rows left, so an estimate from them errs short at half-time;
    the earlier run's total less the tokens done does not."""
    rng = random.Random(3)
    rows = [(400 - i // 4, 10 + i // 8 + rng.randint(0, 20)) for i in range(1000)]  # answers 10..155 tokens
    first = Simulation(rows, 64, 256)
    earlier = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=first.clock, prior=SIMULATED_MACHINE)
    first.run(earlier)
    prior = earlier.work.length_quantiles()

    def half_time_error(same_job: bool) -> float:
        again = Simulation(rows, 64, 256)
        progress = Progress(
            len(rows),
            stream=io.StringIO(),
            force_plain=True,
            clock=again.clock,
            prior=LengthPrior(prior, same_job, SIMULATED_COST),
        )
        again.run(progress)
        return again.errors_at((0.50,))[0]

    assert half_time_error(same_job=False) < -0.1  # from the rows seen, short answers: -16%
    assert abs(half_time_error(same_job=True)) <= 0.05  # +0.4%


def test_the_runs_expected_tokens_per_s_is_near_its_final_figure_when_the_figure_so_far_is_not() -> None:
    """Longest prompts first: the first steps mostly prefill, so the
    completion tokens/s so far starts far below the run's final figure (as
    on a CPU, where 300 ShareGPT rows made almost none in their first 100
    s). The figure the line prints after the ETA, the tokens generated and
    left over the time so far and the ETA, is near the final one from 10%
    of the run on."""
    rows = mixed_rows(1000, 256)
    sim = Simulation(rows, 64, 256)
    progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=sim.clock, prior=SIMULATED_MACHINE)
    end = sim.run(progress)
    final = progress.work.generated_tokens / end

    def errors_at(fraction: float) -> tuple[float, float]:
        _, so_far, expected = min(sim.rates, key=lambda x: abs(x[0] - fraction * end))
        assert expected is not None
        return so_far / final - 1, expected / final - 1

    assert errors_at(0.10)[0] < -0.5  # -79%
    for fraction in (0.10, 0.25, 0.50, 0.75):
        assert abs(errors_at(fraction)[1]) <= 0.20, (fraction, errors_at(fraction))  # +12%, -3%, +2%, +1%


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_fits_80_columns_with_the_runs_expected_tokens_per_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    stream = Terminal()
    rows = [(100, 50)] * 40
    sim = Simulation(rows, 8, 50)
    progress = Progress(len(rows), stream=stream, clock=sim.clock)
    sim.run(progress)
    progress.close()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())  # the bar's last state, no ANSI codes
    last = [line for line in re.split(r"[\r\n]", shown) if " rows " in line][-1]
    assert len(last) <= 80 and " 40/40 rows " in last, last
    assert re.search(r" completion tok/s, run ~[\d.]+ eta 0:00:00$", last.rstrip()), last


def held_and_widths(progress: Progress, end: float) -> tuple[float, list[tuple[float, float]]]:
    """From the progress's ETA trace: the share of estimates from 10% of the
    run on whose range held the real time left, and (fraction of the run, half
    width) of each estimate."""
    points = [(t, lo, pt, hi) for t, lo, pt, hi in progress.eta_trace if t >= 0.1 * end and end - t >= 0.01 * end]
    held = [lo * 0.99 <= end - t <= hi * 1.01 for t, lo, _, hi in points]
    return sum(held) / len(held), [(t / end, max(hi / pt - 1, 1 - lo / pt)) for t, lo, pt, hi in points]


def test_the_range_holds_the_real_time_left_and_a_run_again_starts_narrower() -> None:
    """The all-at-once case: a first run, then the same job again with the
    first run's lengths. Both ranges hold the real time left on at least 80%
    of estimates from 10% on and narrow as rows finish; the run again's is
    narrower than the first run's at the start."""
    rows = mixed_rows(300, 128, seed=1)
    first = Simulation(rows, 256, 128)
    earlier = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=first.clock, prior=SIMULATED_MACHINE)
    end = first.run(earlier)
    held, first_widths = held_and_widths(earlier, end)
    assert held >= 0.8, held
    again = Simulation(rows, 256, 128)
    prior = LengthPrior(earlier.work.length_quantiles(), True, SIMULATED_COST)
    progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=again.clock, prior=prior)
    held, again_widths = held_and_widths(progress, again.run(progress))
    assert held >= 0.8, held
    for widths in (first_widths, again_widths):
        assert max(w for f, w in widths if f >= 0.75) < max(w for f, w in widths if f <= 0.25)
    assert again_widths[0][1] < 0.75 * first_widths[0][1]  # 0.28 against 0.46


def test_the_eta_is_a_range_until_both_ends_are_within_10_percent() -> None:
    assert eta_text(EtaRange(100.0, 130.0, 220.0, 0.0)) == "0:01:40-0:03:40"
    assert eta_text(EtaRange(120.0, 130.0, 140.0, 0.0)) == "0:02:10"
    assert eta_text(EtaRange(2.2, 2.6, 3.1, 0.0)) == "0:00:03"  # under a second wide


def test_the_trace_keeps_at_most_trace_points_spread_over_the_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "TRACE_POINTS", 32)
    rows = mixed_rows(1000, 256)
    sim = Simulation(rows, 16, 256)  # a long run: over a hundred estimates
    progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=sim.clock, prior=SIMULATED_MACHINE)
    end = sim.run(progress)
    times = [t for t, *_ in progress.eta_trace]
    assert 16 <= len(times) < 32
    assert times == sorted(times) and times[0] < 0.01 * end and times[-1] > 0.95 * end
    assert all(lo <= pt <= hi for _, lo, pt, hi in progress.eta_trace)


def test_a_run_again_takes_the_lengths_done_out_of_the_earlier_runs() -> None:
    """Earlier: half the rows 10 tokens, half 100 (as quantiles). The 50 rows
    done ended at 9 tokens (not a length the quantiles hold): they take the
    short lengths out, and the 50 left are expected to run 100 tokens each."""
    work = WorkEstimate(0.0, prior=[10] * 50 + [100] * 51, max_running=64, same_job=True)
    for _ in range(100):
        work.plan(20, 128)
    for _ in range(50):
        work.finish(9)
    work.observe(1.0, 450, 2000, [])
    outlook = work.outlook(100)
    assert outlook is not None
    assert outlook.completion_tokens == pytest.approx(50 * 100, rel=0.03)
    assert outlook.low <= outlook.point <= outlook.high


def test_a_run_again_timed_by_its_own_jobs_step_model_takes_that_model_alone() -> None:
    """Long prompts prefilled while the first rows decode, then a decode-only
    end: the mix of the steps changes mid-run. A run again timed by its own
    job's fit (``step_cost_same_job``) draws that model alone, its rate's
    drift at least SAME_JOB_SPREAD: the range holds, as wide as that drift
    makes it (and a little for the lengths), narrower than the range of the
    model's neighbours, which part while the mix changes."""
    rows = mixed_rows(300, 128, seed=2)
    first = Simulation(rows, 128, 128)
    earlier = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=first.clock, prior=SIMULATED_MACHINE)
    first.run(earlier)
    lengths = earlier.work.length_quantiles()
    widest = {}
    for own in (True, False):
        again = Simulation(rows, 128, 128)
        prior = LengthPrior(lengths, True, SIMULATED_COST, own)
        progress = Progress(len(rows), stream=io.StringIO(), force_plain=True, clock=again.clock, prior=prior)
        held, widths = held_and_widths(progress, again.run(progress))
        assert progress.work.step_cost_same_job is own
        assert held >= 0.8, (own, held)
        widest[own] = max(w for f, w in widths if f >= 0.25)
    drift_width = math.exp(statistics.NormalDist().inv_cdf(0.9) * SAME_JOB_SPREAD) - 1  # +29%
    assert drift_width - 0.01 <= widest[True] <= drift_width + 0.05 < widest[False]  # 0.31, 0.40


def test_a_run_again_times_its_draining_steps_at_their_own_batch_rate() -> None:
    """Its job's full batches ran twice as slow per unit of work as its
    other steps (``batch_rates``); the recent steps are full batches. Rows
    that all end together decode in full batches to the end: the same ETA
    as without batch rates. Rows of spread lengths drain in smaller batches
    at half the full batches' rate: a shorter ETA."""

    def eta(lengths: list[int], batch_rates: tuple[float, ...]) -> float:
        cost = StepCost(0.0, 0.5, 0.05, 16.0, batch_rates)
        work = WorkEstimate(0.0, prior=lengths, max_running=128, same_job=True, step_cost=cost, step_cost_same_job=True)
        for _ in range(128):
            work.plan(100, 128)
        work.observe(1.0, 128, 12800, [1] * 128)  # the prompts: a step that prefilled
        clock = 1.0
        for k in range(2, 12):  # full batches at 2 x 1 ms per unit of work
            clock += 2 * 0.001 * (128 + 16)
            work.observe(clock, 128 * k, 12800, [k] * 128)
        result = work.eta_s(128)
        assert result is not None
        return result

    together, spread = [60] * 101, [12 + i for i in range(101)]
    slow_full = (0.0, math.log(2.0))
    assert eta(together, slow_full) == pytest.approx(eta(together, ()), rel=0.02)
    assert eta(spread, slow_full) < 0.8 * eta(spread, ())


def test_a_run_again_takes_its_earlier_runs_rate_for_the_steps_it_has_not_seen() -> None:
    """The earlier run of the job ran at 1 ms per unit of work; this run's
    first 10 steps at 3 ms (warm-up). Its rate: the earlier one while those
    10 are fewer than half of RECENT_STEPS, its own once they are most; a
    first run (another job's model) takes its own steps alone."""

    def rate(steps: int, same_job: bool) -> float:
        cost = StepCost(0.0, 0.5, 0.05, 16.0, rate=0.001)
        work = WorkEstimate(0.0, max_running=16, step_cost=cost, step_cost_same_job=same_job)
        for k in range(1, steps + 1):
            work.observe(k * 0.003 * (16 + 16), 16 * k, 0, [k] * 16)
        return work._rate(cost)

    assert rate(10, same_job=True) == pytest.approx(0.001)
    assert rate(40, same_job=True) == pytest.approx(0.003)
    assert rate(10, same_job=False) == pytest.approx(0.003)


def test_a_first_run_learns_its_own_batch_rates_once_it_has_seen_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed by another job's model: its full batches ran at 2 ms per unit
    of work, the first steps of its drain at 1 ms. Having seen both, it
    times the rest of its drain at the drain's rate, not at the median of
    its recent steps (mostly full batches); other jobs' batch rates are not
    its own and count for nothing."""

    def eta(learn: bool) -> float:
        borrowed = StepCost(0.0, 0.5, 0.05, 16.0, (0.0, math.log(3.0)))
        work = WorkEstimate(0.0, prior=[12 + i for i in range(101)], max_running=128, step_cost=borrowed)
        for _ in range(128):
            work.plan(100, 128)
        work.observe(1.0, 128, 12800, [1] * 128)  # the prompts: a step that prefilled
        clock, generated = 1.0, 128
        for k in range(2, 14):  # full batches
            clock += 0.002 * (128 + 16)
            generated += 128
            work.observe(clock, generated, 12800, [k] * 128)
        for _ in range(28):
            work.finish(13)
        for k in range(14, 20):  # the drain begins: 100 rows left
            clock += 0.001 * (100 + 16)
            generated += 100
            work.observe(clock, generated, 12800, [k] * 100)
        if not learn:
            monkeypatch.setattr(eta_module, "batch_rates", lambda *args, **kwargs: ())
        result = work.eta_s(128)
        monkeypatch.undo()
        assert result is not None
        return result

    assert eta(learn=True) < 0.75 * eta(learn=False)


def test_the_context_is_the_running_rows_own_prompts_not_the_planned_mean() -> None:
    """Rows fed longest prompt first (128 of 1,000 tokens, then 128 of 100),
    every one 50 tokens long, steps timed by a model with an attention cost.
    Told the running rows' prompt tokens (the engine's
    ``running_prompt_tokens``), a run again times the rest within 5%; at the
    planned rows' mean prompt (550) the recent steps' rate comes out too high
    and the second wave's steps too dear: 25% over."""
    cost = StepCost(0.004, 0.5, 0.05, 16.0)

    def seconds(decoded: int, prefilled: int, context: int) -> float:
        return 0.001 * (decoded + 16.0 + 0.004 * context + 0.5 * prefilled)

    def eta(told: bool) -> tuple[float, float]:
        work = WorkEstimate(0.0, prior=[50] * 101, max_running=128, same_job=True, step_cost=cost)
        work.step_cost_same_job = True
        for prompt in [1000] * 128 + [100] * 128:
            work.plan(prompt, 64)
        clock = seconds(128, 128_000, 128 * 1001)
        work.observe(clock, 128, 128_000, [1] * 128, 0, 128_000 if told else None)
        for k in range(2, 21):
            clock += seconds(128, 0, 128 * (1000 + k))
            work.observe(clock, 128 * k, 128_000, [k] * 128, 0, 128_000 if told else None)
        left = sum(seconds(128, 0, 128 * (1000 + k)) for k in range(21, 50))  # the first wave ends at 50 tokens
        left += seconds(128, 12_800, 128 * 101) + sum(seconds(128, 0, 128 * (100 + k)) for k in range(2, 51))
        result = work.eta_s(256)
        assert result is not None
        return result, left

    (told, real), (mean, _) = eta(True), eta(False)
    assert told == pytest.approx(real, rel=0.05)
    assert mean > 1.2 * real


def test_a_row_of_n_choices_is_timed_as_n_rows_of_one_and_its_lengths_kept_per_choice() -> None:
    """vLLM runs a row of ``n`` choices as ``n`` sequences sharing one
    prompt (prefilled by each, the prefix cache serving what a sibling
    computed; attended over by each): 25 of 40 rows of 4 choices planned
    are estimated as 100 of 160 rows of one, draw for draw, the engine
    counting the prompt once a sequence; the lengths kept for
    later runs are the choices', never past max_tokens (before: one row of
    the choices' sum, up to 4 x max_tokens, and a run's 2-3x too long first
    estimates, bulkinfer.report.planned)."""

    def estimate(lines: int, n: int) -> tuple[EtaRange | None, list[int]]:
        clock = Clock()
        progress = Progress(lines, stream=io.StringIO(), force_plain=True, clock=clock, max_running=64)
        rows = 100 // n
        for _ in range(rows):
            progress.planned(100, 64, n, n)
        prefilled = 100 * rows * n  # once a sequence (Engine.prefilled_tokens)
        cached = prefilled - 2_500  # the same 2,500 prompt tokens computed
        for k in range(1, 11):
            clock.now += 0.5
            progress.tick(64 * k + 8 * min(k, 4), prefilled, [k] * 64, cached, 64 * 100)
        lengths = [[5, 9, 12, 20], [30, 64, 64, 2]]
        for choices in lengths:
            if n == 1:
                for length in choices:
                    progress.update(done=1, completion_tokens=length)
            else:
                progress.update(done=1, completion_tokens=sum(choices), lengths=choices)
        return progress.work.outlook(lines, 0), progress.work.length_quantiles()

    (grouped, grouped_lengths), (single, single_lengths) = estimate(40, 4), estimate(160, 1)
    assert grouped is not None and grouped == single
    assert grouped_lengths == single_lengths and max(grouped_lengths) == 64


def test_the_total_rate_counts_a_prompt_as_usage_does_once_a_row_of_n_choices() -> None:
    """The engine prefills a row's prompt once a choice; the progress line's
    tok/s and the token series count it once, as usage and the report's
    ``total_tokens_per_s`` do: exact once the rows are prefilled, the mix of
    one row of 4 choices (100 tokens) and one of 1 (40 tokens) included."""
    clock = Clock()
    progress = Progress(2, stream=io.StringIO(), force_plain=True, clock=clock)
    progress.planned(100, 16, 4, 4)
    progress.planned(40, 16, 1, 1)
    clock.now += 2.0
    progress.tick(60, 4 * 100 + 40, [12] * 5)
    assert progress.usage_prompt_tokens(440) == 140
    assert progress.total_tokens_per_s() == pytest.approx((140 + 60) / 2.0)


def test_a_choice_that_ended_while_its_row_runs_on_is_neither_running_nor_waiting() -> None:
    """10 rows of 4 choices, 20 sequences running and 12 ended in rows that
    run on (the engine's ``ended_sequences``): 8 wait, not 20, and the
    futures do not draw the 12 a length again."""

    def work(ended: int) -> WorkEstimate:
        w = WorkEstimate(0.0, max_running=64)
        for _ in range(10):
            w.plan(100, 64, 4, 4)
        for k in range(1, 6):
            w.observe(0.5 * k, 32 * k, 1_000, [k] * 20, 0, 20 * 100, ended)
        return w

    told, untold = work(12), work(0)
    assert (told.rows_left(10, 0), untold.rows_left(10, 0)) == (8, 20)
    told_tokens, untold_tokens = (w.outlook(10, 0) for w in (told, untold))
    assert told_tokens is not None and untold_tokens is not None
    # untold, 12 lengths drawn anew (past the lengths seen, rows stop nearer max_tokens 64 than not)
    assert untold_tokens.completion_tokens - told_tokens.completion_tokens > 12 * 32
    assert untold_tokens.point > told_tokens.point
