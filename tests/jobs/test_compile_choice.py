"""Eager or compiled (bulkinfer/jobs/compile_choice.py): the break-even, the
decision a run makes from what ``calibrate --compile`` stored, and the
measurement itself on stand-in engines (the real engines: the compile bench,
bench/compile.py, and tests/e2e/test_calibrate_e2e.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import bulkinfer.jobs.compile_choice as cc
import bulkinfer.jobs.served_engine as se
from bulkinfer.config import Settings, with_engine
from bulkinfer.engine import compile_key
from bulkinfer.errors import EngineError
from bulkinfer.io.inputs import InputScan
from bulkinfer.jobs.decode_steps import DECODE_GRID, GRID_TOKENS, DecodeCost, DecodeWork, grid_context
from bulkinfer.report.calibration import record_choice


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


F32 = with_engine(Settings(), dtype="float32")


def store(
    eager_rate: float = 200.0, compiled_rate: float = 250.0, cold: float | None = 100.0, spread: float = 0.0
) -> None:
    """A measurement: eager starts in 10 s, compiled in ``cold`` s cold and
    20 s warm; each engine's two trials ``spread`` tokens/s either side of its rate."""
    entry = {
        "eager": {"start_s": 10.0, "completion_tokens_per_s": eager_rate},
        "compiled": {"cold_start_s": cold, "warm_start_s": 20.0, "completion_tokens_per_s": compiled_rate},
    }
    for side in entry.values():
        rate = side["completion_tokens_per_s"]
        side["trial_rates"] = [rate - spread, rate + spread]
    record_choice("compile", "m", cc.compile_machine(F32), entry)


# Decode costs of the shape measured on a 2-core AMD EPYC Zen 4 (bfloat16; bench/results/step-curve-zen4-bf16-*):
# compiling saves a little a step and a row, and half of what a context token costs.
EAGER = DecodeCost(fixed_s=0.019, per_row_s=0.001, per_context_token_s=4.5e-6, per_prompt_token_s=2e-4)
COMPILED = DecodeCost(fixed_s=0.015, per_row_s=0.0009, per_context_token_s=2.3e-6, per_prompt_token_s=1.5e-4)


def store_with_costs(eager_rate: float = 200.0, compiled_rate: float = 250.0) -> None:
    """A measurement with decode costs (EAGER, COMPILED): eager starts in 10 s, compiled 100 s cold, 20 s warm."""
    store(eager_rate, compiled_rate)
    entry = dict(cc.stored_choice("compile", "m", cc.compile_machine(F32)) or {})
    entry.pop("measured_at", None)
    entry["eager"]["decode_cost"] = EAGER.to_json()
    entry["compiled"]["decode_cost"] = COMPILED.to_json()
    record_choice("compile", "m", cc.compile_machine(F32), entry)


def fill_cache(home: Path) -> None:
    """What a compiled start leaves in the compile cache."""
    (home / "inductor" / "fxgraph").mkdir(parents=True)


def warm_cache(home: Path) -> None:
    fill_cache(home)
    cc.record_compiled_start("m", F32, 20.0)


def test_the_break_even_is_the_extra_start_over_the_seconds_saved_a_token() -> None:
    # 90 s more to start; a token takes 1/200 - 1/250 = 0.001 s less: 90,000 tokens
    assert cc.break_even(90.0, 200.0, 250.0) == pytest.approx(90_000)
    assert cc.break_even(-5.0, 200.0, 250.0) == 0  # a compiled engine that starts sooner pays at once
    assert cc.break_even(90.0, 200.0, 200.0) is None  # not faster: never pays


def test_a_user_setting_wins_and_an_unmeasured_machine_runs_eager(home: Path) -> None:
    settings, choice = cc.choose_compile("m", with_engine(F32, enforce_eager=False), 10**9)
    assert settings.engine.enforce_eager is False and choice["why"] == "set by the user"
    settings, choice = cc.choose_compile("m", F32, 10**9)
    assert settings.engine.enforce_eager is True
    assert "calibrate --compile" in choice["why"]


BF16 = with_engine(Settings(), dtype="bfloat16")


def test_unmeasured_bfloat16_decides_by_the_prior_and_the_probes_eager_rate(home: Path) -> None:
    # cold: 420 s of eager generation at the probe's 250 tok/s: 105,000 tokens
    assert cc.PRIOR_BREAK_EVEN_S == {"cold": 420.0, "warm": 120.0}
    settings, choice = cc.choose_compile("m", BF16, 104_999, eager_rate=250.0)
    assert settings.engine.enforce_eager is True
    assert choice["cache"] == "cold" and choice["break_even_completion_tokens"] == 105_000
    assert choice["prior"] == {"break_even_eager_s": 420.0, "eager_completion_tokens_per_s": 250.0}
    assert "not measured" in choice["why"] and "the job's expected 104,999 are under it" in choice["why"]
    settings, choice = cc.choose_compile("m", BF16, 105_000, eager_rate=250.0)
    assert settings.engine.enforce_eager is False and "at or over" in choice["why"]
    # a compiled start of these settings left the cache warm: 120 s, 30,000 tokens
    fill_cache(home)
    cc.record_compiled_start("m", BF16, 30.0)
    settings, choice = cc.choose_compile("m", BF16, 31_000, eager_rate=250.0)
    assert choice["cache"] == "warm" and choice["break_even_completion_tokens"] == 30_000
    assert settings.engine.enforce_eager is False
    # a faster machine's eager rate moves the break-even up: the same job runs eager there
    assert cc.choose_compile("m", BF16, 31_000, eager_rate=500.0)[1]["enforce_eager"] is True


def test_the_prior_needs_bfloat16_a_probe_rate_and_a_known_size(home: Path) -> None:
    stopped_by = (
        (F32, 10**9, 250.0, "no prior for dtype float32"),
        (BF16, 10**9, None, "no eager rate at this dtype from a dtype probe"),
        (BF16, None, 250.0, "completion tokens are unknown"),
    )
    for settings, tokens, rate, why in stopped_by:
        chosen, choice = cc.choose_compile("m", settings, tokens, eager_rate=rate)
        assert chosen.engine.enforce_eager is True and "prior" not in choice, (settings.engine.dtype, tokens, rate)
        # the why names the one condition that stopped the prior, and how to measure instead
        assert "calibrate --compile" in choice["why"] and why in choice["why"], choice["why"]
        assert sum(w in choice["why"] for *_, w in stopped_by) == 1, choice["why"]
    # a measurement replaces the prior
    record_choice("compile", "m", cc.compile_machine(BF16), {
        "eager": {"start_s": 10.0, "completion_tokens_per_s": 250.0, "trial_rates": [250.0, 250.0]},
        "compiled": {"cold_start_s": 100.0, "warm_start_s": 20.0, "completion_tokens_per_s": 240.0,
                     "trial_rates": [240.0, 240.0]},
    })  # fmt: skip
    _, choice = cc.choose_compile("m", BF16, 10**9, eager_rate=250.0)
    assert choice["enforce_eager"] is True and "not faster" in choice["why"] and "prior" not in choice


def test_a_cold_cache_compiles_only_past_the_cold_break_even(home: Path) -> None:
    store()  # cold: 90 s more -> 90,000 tokens
    settings, choice = cc.choose_compile("m", F32, 89_000)
    assert settings.engine.enforce_eager is True
    assert choice["cache"] == "cold" and choice["break_even_completion_tokens"] == 90_000
    assert "expected 89,000 completion tokens are under the break-even of 90,000" in choice["why"]
    settings, choice = cc.choose_compile("m", F32, 91_000)
    assert settings.engine.enforce_eager is False and "at or over" in choice["why"]


def test_a_warm_cache_moves_the_break_even_down(home: Path) -> None:
    store()
    warm_cache(home)  # warm: 10 s more -> 10,000 tokens
    settings, choice = cc.choose_compile("m", F32, 12_000)
    assert settings.engine.enforce_eager is False
    assert choice["cache"] == "warm" and choice["break_even_completion_tokens"] == 10_000
    # other graph settings are another graph: the cache is cold for them
    _, other = cc.choose_compile("m", with_engine(F32, max_num_batched_tokens=8192), 12_000)
    assert other["cache"] == "cold" and other["enforce_eager"] is True
    # the cache emptied (a new machine, a cleaned cache): cold again
    (home / "inductor" / "fxgraph").rmdir()
    assert cc.choose_compile("m", F32, 12_000)[1]["cache"] == "cold"


def test_a_start_into_another_compile_cache_leaves_this_one_cold(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run given its own TORCHINDUCTOR_CACHE_DIR (bench.compile's) fills
    that directory: the default one is still cold for a later run or calibrate."""
    store()
    fill_cache(home)  # the default cache holds something (another model's graph, say)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(home / "bench-cache"))
    (home / "bench-cache" / "fxgraph").mkdir(parents=True)
    cc.record_compiled_start("m", F32, 80.0)
    assert cc.cache_warm("m", F32) is not None  # warm where it went
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(home / "inductor"))
    assert cc.cache_warm("m", F32) is None
    assert cc.choose_compile("m", F32, 12_000)[1]["cache"] == "cold"


def test_a_start_recorded_under_an_earlier_key_revision_leaves_the_cache_cold(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled start recorded before bulkinfer changed the compile keys
    (compile_key.KEY_REVISION) filled entries no start finds now."""
    store()
    fill_cache(home)
    revision = compile_key.KEY_REVISION
    monkeypatch.setattr(compile_key, "KEY_REVISION", revision - 1)
    cc.record_compiled_start("m", F32, 20.0)
    assert cc.cache_warm("m", F32) is not None
    monkeypatch.setattr(compile_key, "KEY_REVISION", revision)
    assert cc.cache_warm("m", F32) is None
    assert cc.choose_compile("m", F32, 12_000)[1]["cache"] == "cold"


def test_compiling_that_is_not_faster_and_an_unknown_size_or_cold_cost_run_eager(home: Path) -> None:
    store(compiled_rate=210.0, spread=6.0)  # compiled's slowest trial (204) under eager's fastest (206)
    settings, choice = cc.choose_compile("m", F32, 10**9)
    assert settings.engine.enforce_eager is True and "not faster" in choice["why"]
    assert choice["break_even_completion_tokens"] is None
    store(compiled_rate=210.0, spread=4.0)  # 206 against 204: every compiled trial beat every eager one
    assert cc.choose_compile("m", F32, 10**9)[1]["enforce_eager"] is False
    store()
    assert cc.choose_compile("m", F32, None)[1]["enforce_eager"] is True  # a shared engine, stdin
    replicas = with_engine(F32, data_parallel_size=2)  # measured for one engine on every core
    assert cc.choose_compile("m", replicas, 10**9)[1]["enforce_eager"] is True
    store(cold=None)  # measured on a warm cache: a cold start's cost unknown
    settings, choice = cc.choose_compile("m", F32, 10**9)
    assert settings.engine.enforce_eager is True and "cold compile was not measured" in choice["why"]


def test_the_decode_costs_price_each_jobs_own_work_not_its_tokens_alone(home: Path) -> None:
    """Two jobs of the same 65,000 completion tokens: short rows and rows
    attending over long contexts. At the measured costs compiling saves
    the first 15.9 s (under the 90 s a cold compile adds: eager) and the
    second 132.5 s (compiled); a warm cache (10 s more) compiles both."""
    store_with_costs()
    short = DecodeWork(steps=1_000, tokens=65_000, context=2_000_000, prompt_tokens=20_000)
    long = DecodeWork(steps=1_000, tokens=65_000, context=55_000_000, prompt_tokens=20_000)
    settings, choice = cc.choose_compile("m", F32, 65_000, short)
    # eager 19 + 65 + 9 + 4 = 97.0 s; compiled 15 + 58.5 + 4.6 + 3 = 81.1 s: 15.9 s saved
    assert choice["expected_generation_s"] == {"eager": 97.0, "compiled": 81.1}
    assert choice["extra_start_s"] == 90.0 and settings.engine.enforce_eager is True
    assert choice["decode_work"] == {
        "steps": 1_000, "completion_tokens": 65_000, "context_tokens": 2_000_000, "prompt_tokens": 20_000,
    }  # fmt: skip
    assert "does not pay" in choice["why"] and "15.9 s" in choice["why"]
    assert "break_even_completion_tokens" not in choice  # decided by the work, not a token count
    settings, choice = cc.choose_compile("m", F32, 65_000, long)
    # eager 19 + 65 + 247.5 + 4 = 335.5 s; compiled 15 + 58.5 + 126.5 + 3 = 203.0 s: 132.5 s saved
    assert choice["expected_generation_s"] == {"eager": 335.5, "compiled": 203.0}
    assert settings.engine.enforce_eager is False and "pays" in choice["why"]
    warm_cache(home)
    assert cc.choose_compile("m", F32, 65_000, short)[1]["enforce_eager"] is False  # 15.9 s > 10 s
    # without the work (a Parquet input) the trials' break-even decides, as before: 10 s / (1/200 - 1/250)
    _, choice = cc.choose_compile("m", F32, 9_000, None)
    assert choice["break_even_completion_tokens"] == 10_000 and choice["enforce_eager"] is True
    # trials in which compiling was not clearly faster: eager, whatever the costs say
    store_with_costs(compiled_rate=200.0)
    _, choice = cc.choose_compile("m", F32, 65_000, long)
    assert choice["enforce_eager"] is True and "not faster" in choice["why"]


def test_a_job_sized_run_decides_from_rows_n_and_max_tokens(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.jobs import engine_choice

    monkeypatch.setattr(engine_choice, "detect_device", lambda: "cpu")
    monkeypatch.setattr(engine_choice, "sized_kv_cache", lambda *a: {})
    monkeypatch.setattr(engine_choice, "measured_settings", lambda model, s, *a: (with_engine(s, dtype="float32"), {}))
    store()  # cold break-even 90,000
    assert Settings().sampling.max_tokens == 256 and Settings().sampling.n == 1
    big = InputScan(rows=1000, mentions_priority=False, bytes=10_000)  # 1000 x 256 tokens at most
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), big, measure=True, size_kv_cache=True)
    assert choice["compile"]["expected_completion_tokens"] == 256_000
    assert settings.engine.enforce_eager is False
    small = InputScan(rows=100, mentions_priority=False, bytes=1_000)
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), small, measure=True, size_kv_cache=True)
    assert settings.engine.enforce_eager is True
    _, choice = engine_choice.choose_engine_settings("m", Settings(), big, measure=True, size_kv_cache=False)
    assert choice["compile"]["expected_completion_tokens"] is None  # an engine that outlives the job


def test_a_run_passes_the_dtype_probes_rate_at_the_chosen_dtype(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.jobs import engine_choice

    trials = [
        {"dtype": "float32", "completion_tokens_per_s": 180.0},
        {"dtype": "bfloat16", "completion_tokens_per_s": 250.0},
    ]
    probed = {"dtype": {"dtype": "bfloat16", "why": "faster", "trials": trials}}
    monkeypatch.setattr(engine_choice, "detect_device", lambda: "cpu")
    monkeypatch.setattr(engine_choice, "sized_kv_cache", lambda *a: {})
    monkeypatch.setattr(
        engine_choice, "measured_settings", lambda model, s, *a: (with_engine(s, dtype="bfloat16"), probed)
    )
    big = InputScan(rows=1000, mentions_priority=False, bytes=10_000)  # 256,000 tokens at most: over 105,000
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), big, measure=True, size_kv_cache=True)
    assert choice["compile"]["prior"]["eager_completion_tokens_per_s"] == 250.0
    assert settings.engine.enforce_eager is False
    user = {"dtype": {"dtype": "bfloat16", "why": "set by the user"}}  # this run probed nothing
    monkeypatch.setattr(
        engine_choice, "measured_settings", lambda model, s, *a: (with_engine(s, dtype="bfloat16"), user)
    )
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), big, measure=True, size_kv_cache=True)
    assert settings.engine.enforce_eager is True and "prior" not in choice["compile"]  # and none is stored: eager
    assert "none has run" in choice["compile"]["why"]
    stored = {"dtype": "float32", "trials": [{"dtype": "bfloat16", "completion_tokens_per_s": 240.0}]}
    monkeypatch.setattr(engine_choice, "known_dtype", lambda model: stored)  # a probe ran here before
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), big, measure=True, size_kv_cache=True)
    assert choice["compile"]["prior"]["eager_completion_tokens_per_s"] == 240.0
    assert settings.engine.enforce_eager is False  # as the probe's own choice of bfloat16 would


def test_a_dtype_the_user_set_times_the_job_at_the_stored_probes_rate(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The huge pages choice weighs the job's generation time: with the
    dtype set by the user, at the rate the stored probe measured at it (the
    compile choice has no prior at float32: eager)."""
    from bulkinfer.jobs import engine_choice

    user = {"dtype": {"dtype": "float32", "why": "set by the user"}}
    stored = {"dtype": "bfloat16", "trials": [{"dtype": "float32", "completion_tokens_per_s": 160.0}]}
    timed: list[float | None] = []
    monkeypatch.setattr(engine_choice, "detect_device", lambda: "cpu")
    monkeypatch.setattr(engine_choice, "sized_kv_cache", lambda *a: {})
    set_by_user = with_engine(Settings(), dtype="float32")
    monkeypatch.setattr(engine_choice, "measured_settings", lambda model, s, *a: (set_by_user, user))
    monkeypatch.setattr(engine_choice, "choose_huge_pages", lambda s, seconds: (timed.append(seconds), (s, {}))[1])
    small = InputScan(rows=10, mentions_priority=False, bytes=1_000)  # 10 x 256 tokens at most
    for probe, seconds in ((stored, 2560 / 160.0), (None, None)):
        monkeypatch.setattr(engine_choice, "known_dtype", lambda model, probe=probe: probe)
        settings, _ = engine_choice.choose_engine_settings("m", Settings(), small, measure=True, size_kv_cache=True)
        assert timed.pop() == seconds and settings.engine.enforce_eager is True


def test_rows_that_set_their_own_max_tokens_decide_by_them(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OpenAI batch file's rows each carry max_tokens: the compile choice
    counts theirs (from the tokenized sample), not 256 a row."""
    from bulkinfer.jobs import engine_choice

    monkeypatch.setattr(engine_choice, "detect_device", lambda: "cpu")
    monkeypatch.setattr(engine_choice, "sized_kv_cache", lambda *a: {})
    monkeypatch.setattr(engine_choice, "measured_settings", lambda model, s, *a: (with_engine(s, dtype="float32"), {}))
    store()  # cold break-even 90,000
    scan = InputScan(rows=100, mentions_priority=False, bytes=10_000)  # at 256 a row: 25,600 tokens, eager
    taken: list[int] = []

    def long_rows() -> engine_choice.TokenSample:  # the first 10 of 100 rows ask for 2,000 tokens each
        taken.append(1)
        return engine_choice.TokenSample(rows=10, bytes=1_000, prompt_tokens=500, completion_tokens=20_000, whole=False)

    settings, choice = engine_choice.choose_engine_settings("m", Settings(), scan, True, True, long_rows)
    assert choice["compile"]["expected_completion_tokens"] == 200_000 and settings.engine.enforce_eager is False
    assert taken == [1]  # one sample for both the KV cache and the compile choice
    whole = engine_choice.TokenSample(rows=100, bytes=10_000, prompt_tokens=500, completion_tokens=3_200, whole=True)
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), scan, True, True, lambda: whole)
    assert choice["compile"]["expected_completion_tokens"] == 3_200 and settings.engine.enforce_eager is True
    users = with_engine(Settings(), enforce_eager=True, kv_cache_memory_bytes=2**30)
    engine_choice.choose_engine_settings("m", users, scan, True, True, long_rows)
    assert taken == [1, 1]  # the block size is still bulkinfer's to choose (bulkinfer/jobs/block_choice.py)
    users = with_engine(users, extra_args={"block_size": 64})  # nothing left to decide
    engine_choice.choose_engine_settings("m", users, scan, True, True, long_rows)
    assert taken == [1, 1]


def test_a_job_is_priced_by_its_sampled_rows_prompts_and_max_tokens(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile choice's decode work comes from the tokenized sample's
    rows (prompt tokens, max_tokens; a row of n choices n times), scaled
    to the input's rows, at the engine's max_num_seqs (256 unset)."""
    from bulkinfer.jobs import engine_choice

    monkeypatch.setattr(engine_choice, "detect_device", lambda: "cpu")
    monkeypatch.setattr(engine_choice, "sized_kv_cache", lambda *a: {})
    monkeypatch.setattr(engine_choice, "measured_settings", lambda model, s, *a: (with_engine(s, dtype="float32"), {}))
    store_with_costs()
    scan = InputScan(rows=1_000, mentions_priority=False, bytes=100_000)
    # the first 10 of 1,000 rows: 1,000 prompt tokens and 1,000 completion tokens each
    lengths = ((1_000, 1_000),) * 10
    sample = engine_choice.TokenSample(10, 10_000, 10_000, 10_000, whole=False, lengths=lengths)
    settings, choice = engine_choice.choose_engine_settings("m", Settings(), scan, True, True, lambda: sample)
    # 1,000 rows of 1,000 tokens, 256 at once: 4 waves of 1,000 steps; each row 1,000 x 1,000 + 999 x 1,000 / 2
    assert choice["compile"]["decode_work"] == {
        "steps": 4_000, "completion_tokens": 1_000_000, "context_tokens": 1_499_500_000, "prompt_tokens": 1_000_000,
    }  # fmt: skip
    assert settings.engine.enforce_eager is False
    few_seqs = with_engine(Settings(), max_num_seqs=100)
    _, choice = engine_choice.choose_engine_settings("m", few_seqs, scan, True, True, lambda: sample)
    assert choice["compile"]["decode_work"]["steps"] == 10_000
    # no lengths (a sample of another kind) or no sample (Parquet): the trials' break-even decides
    bare = engine_choice.TokenSample(10, 10_000, 10_000, 10_000, whole=False)
    _, choice = engine_choice.choose_engine_settings("m", Settings(), scan, True, True, lambda: bare)
    assert "decode_work" not in choice["compile"] and choice["compile"]["break_even_completion_tokens"] == 90_000


class Timed:
    """Stands in for an engine: its start takes ``start_s`` (a clock advanced by the factory)."""

    def __init__(self, settings: Settings) -> None:
        self.eager = settings.engine.enforce_eager
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_measurement_stores_starts_and_rates_and_keeps_a_cold_figure_across_a_warm_cache(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [0.0]
    starts = iter([10.0, 100.0, 20.0, 11.0, 21.0, 19.0])  # eager, compiled (cold), compiled again; then all warm
    engines: list[Timed] = []

    def factory(model: str, settings: Settings) -> Timed:
        clock[0] += next(starts)
        engines.append(Timed(settings))
        return engines[-1]

    monkeypatch.setattr(se.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(se, "load_tokenizer", lambda model, trust: range(1000))  # a vocabulary of 1,000
    monkeypatch.setattr(se, "import_vllm", lambda: None)
    trials: list[bool | None] = []

    def speed(engine: Timed, tok: Any, rows: int, tokens: Any) -> tuple[float, int, bool]:
        trials.append(engine.eager)
        return (250.0 if engine.eager is False else 200.0, 1, False)

    monkeypatch.setattr(se, "speed", speed)
    asked: list[tuple[bool | None, int, int, int, int]] = []

    def step_seconds(engine: Timed, rows: int, prompt: int, tokens: int, vocab: int) -> tuple[float, float]:
        asked.append((engine.eager, rows, prompt, tokens, vocab))  # a cost of its own for each engine
        cost = EAGER if engine.eager else COMPILED
        step = cost.fixed_s + cost.per_row_s * rows + cost.per_context_token_s * grid_context(rows, prompt)
        disturbed = 1.5 if len(asked) <= len(DECODE_GRID) else 1.0  # the first points ran beside other work
        return step * disturbed, cost.per_prompt_token_s * disturbed

    monkeypatch.setattr(se, "step_seconds", step_seconds)
    served: list[se.LocalEngine] = []

    def here(model: str, settings: Settings, engine_factory: Any) -> se.LocalEngine:  # without the process
        served.append(se.LocalEngine(model, settings, engine_factory))
        return served[-1]

    fill_cache(home)  # as the first compiled start does
    entry = cc.measure_compile("m", F32, factory, serve=here)  # type: ignore[arg-type]
    fitted = {}
    for side in ("eager", "compiled"):
        assert [(r, p) for r, p, *_ in entry[side].pop("decode_steps")] == list(DECODE_GRID)
        fitted[side] = DecodeCost.from_json(entry[side].pop("decode_cost"))
    # both engines alive at once, taking turns: every trial and grid point on one then the other, swapped each pass
    assert trials == [True, False, True, False, False, True]  # the warm-ups, then the two trials
    turns = [(True, False), (False, True)]
    assert asked == [(e, r, p, GRID_TOKENS, 1000) for first in turns for r, p in DECODE_GRID for e in first]
    for got, truth in ((fitted["eager"], EAGER), (fitted["compiled"], COMPILED)):  # the undisturbed line again
        assert got is not None
        assert got.fixed_s == pytest.approx(truth.fixed_s, abs=1e-5)
        assert got.per_row_s == pytest.approx(truth.per_row_s, abs=1e-6)
        assert got.per_context_token_s == pytest.approx(truth.per_context_token_s, abs=1e-8)
        assert got.per_prompt_token_s == pytest.approx(truth.per_prompt_token_s)
    assert entry["eager"] == {"start_s": 10.0, "completion_tokens_per_s": 200.0, "trial_rates": [200.0, 200.0]}
    assert entry["compiled"] == {
        "cold_start_s": 100.0, "start_s": 100.0, "completion_tokens_per_s": 250.0, "trial_rates": [250.0, 250.0],
        "warm_start_s": 20.0,
    }  # fmt: skip
    assert [e.eager for e in engines] == [True, False, False] and all(e.closed for e in engines)
    assert len(served) == 3  # every engine in a process of its own, each as a run's first
    assert cc.cache_warm("m", F32) is not None
    again = cc.measure_compile("m", F32, factory, serve=here)  # type: ignore[arg-type]
    assert again["compiled"]["cold_start_s"] == 100.0  # its first compiled start was warm: the earlier cold figure
    assert again["compiled"]["warm_start_s"] == 19.0
    assert cc.choose_compile("m", F32, 12_000)[0].engine.enforce_eager is False  # warm: 19 - 11 s -> 8,000 tokens


def test_a_served_engine_runs_in_another_process_and_brings_back_its_answers_or_errors() -> None:
    served = se.ProcessEngine("m", F32, _fails, local_engine=_PidEngine)  # type: ignore[arg-type]
    try:
        assert served.start_s == 1.5
        assert served.ask("pid") != os.getpid()
        with pytest.raises(ValueError, match="no calibration trial 'speed'"):
            served.ask("speed", 64, (32,))
        assert served.ask("pid") == served.ask("pid")  # the same process after an error
    finally:
        served.close()
    with pytest.raises(EngineError, match="no engine"):
        se.ProcessEngine("m", F32, _fails, local_engine=_FailingEngine)  # type: ignore[arg-type]


class _PidEngine:
    """A served engine without an engine: answers with its process id."""

    start_s = 1.5

    def __init__(self, model: str, settings: Settings, engine_factory: Any) -> None:
        pass

    def ask(self, what: str, *args: Any) -> int:
        if what != "pid":
            raise ValueError(f"no calibration trial {what!r}")
        return os.getpid()

    def close(self) -> None:
        pass


class _FailingEngine(_PidEngine):
    def __init__(self, model: str, settings: Settings, engine_factory: Any) -> None:
        raise EngineError("no engine")


def _fails() -> None:
    raise EngineError("no engine")
