"""The dtype probe's decision and the measured settings a run applies (fake
probe results and fake engines: the real probe is tests/e2e/test_tune_e2e.py),
also on the probe measurements recorded on each CPU kind seen
(probe_records.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

import bulkinfer.jobs.tune as tune
from bulkinfer.config import EngineSettings, Settings
from bulkinfer.report.calibration import record_choice, stored_choice


def trial(dtype: str, perplexity: float, rate: float) -> dict[str, Any]:
    return {"dtype": dtype, "perplexity": perplexity, "completion_tokens_per_s": rate}


def test_a_dtype_failing_the_probe_is_refused_however_fast() -> None:
    dtype, why = tune.choose_dtype([trial("float32", 10.0, 300.0), trial("bfloat16", 10.25, 700.0)])
    assert dtype == "float32"  # 2.5% off float32's perplexity: more than the 2% tolerance
    assert "bfloat16 refused: perplexity 10.250 vs float32's 10.000 (2.5%, more than 2%)" in why


def test_a_faster_dtype_within_the_tolerance_is_chosen_and_a_slower_one_is_not() -> None:
    assert tune.choose_dtype([trial("float32", 10.0, 300.0), trial("bfloat16", 9.85, 510.0)]) == (
        "bfloat16",
        "bfloat16 passed the probe (1.5% from float32's perplexity) at 1.70x",
    )
    dtype, why = tune.choose_dtype([trial("float32", 10.0, 300.0), trial("bfloat16", 10.1, 100.0)])
    assert dtype == "float32" and "at 0.33x" in why


@pytest.fixture
def home(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    return tmp_path


def no_engine(model: str, settings: Settings) -> Any:
    raise AssertionError("no engine may start")


def test_without_native_bfloat16_a_run_uses_float32_and_starts_no_probe(home: Any) -> None:
    settings, choice = tune.measured_settings("m", Settings(), "cpu", no_engine)
    assert settings.engine.dtype == "float32"
    assert "no native bfloat16" in choice["dtype"]["why"]
    assert stored_choice("dtype", "m", tune.dtype_machine()) is None  # nothing measured, nothing stored


def test_with_native_bfloat16_the_first_run_probes_once_and_later_runs_use_the_stored_answer(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tune, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    probes: list[str] = []

    def fake_probe(model: str, settings: Settings, engine_factory: Any, say: Any = None) -> dict[str, Any]:
        probes.append(model)
        trials = [trial("float32", 10.0, 300.0), trial("bfloat16", 13.0, 0.0)]
        return {"dtype": "float32", "why": tune.choose_dtype(trials)[1], "trials": trials}

    monkeypatch.setattr(tune, "probe_dtype", fake_probe)
    for _ in range(2):
        settings, choice = tune.measured_settings("m", Settings(), "cpu", no_engine)
        assert settings.engine.dtype == "float32"
        assert choice["dtype"]["why"].startswith("bfloat16 refused: perplexity 13.000")
    assert probes == ["m"]
    assert stored_choice("dtype", "m", tune.dtype_machine())["machine"]["bfloat16"] == "avx512_bf16"
    # another vLLM version is another machine: measured again
    monkeypatch.setattr(tune, "vllm_version", lambda: "9.9.9")
    tune.measured_settings("m", Settings(), "cpu", no_engine)
    assert probes == ["m", "m"]


def test_a_dtype_or_scheduler_limit_the_user_set_wins_and_a_gpu_is_left_to_vllm(home: Any) -> None:
    record_choice("dtype", "m", tune.dtype_machine(), {"dtype": "bfloat16", "why": "measured"})
    record_choice(
        "scheduler",
        "m",
        tune._tune_machine(),
        {"settings": {"max_num_seqs": 512, "max_num_batched_tokens": 8192}, "trials": []},
    )
    settings, choice = tune.measured_settings("m", Settings(), "cpu", no_engine)
    assert (settings.engine.dtype, settings.engine.max_num_seqs, settings.engine.max_num_batched_tokens) == (
        "bfloat16",
        512,
        8192,
    )
    mine = Settings(engine=EngineSettings(dtype="float32", max_num_seqs=64))
    settings, choice = tune.measured_settings("m", mine, "cpu", no_engine)
    assert (settings.engine.dtype, settings.engine.max_num_seqs, settings.engine.max_num_batched_tokens) == (
        "float32",
        64,
        8192,
    )
    assert choice["dtype"]["why"] == "set by the user" and choice["scheduler"]["settings"] == {
        "max_num_batched_tokens": 8192
    }
    assert tune.measured_settings("m", Settings(), "cuda", no_engine) == (Settings(), {})


RECORDS = {r["cpu"]: r for r in orjson.loads((Path(__file__).parent / "probe_records.json").read_bytes())["records"]}


# What the probe decides on each recorded CPU: (dtype, why).
PROBE_DECISIONS = {
    "amd-epyc-zen3": ("float32", "bfloat16 passed the probe (0.6% from float32's perplexity) at 0.19x"),
    "amd-epyc-zen4": ("bfloat16", "bfloat16 passed the probe (0.2% from float32's perplexity) at 1.23x"),
    "amd-epyc-zen5": ("bfloat16", "bfloat16 passed the probe (0.2% from float32's perplexity) at 1.60x"),
    "intel-xeon-amx": ("bfloat16", "bfloat16 passed the probe (0.1% from float32's perplexity) at 2.08x"),
}


# What a run on each recorded CPU does: (dtype, why, whether the probe runs, the stored machine's bfloat16).
RUN_CHOICES = {
    # no native bfloat16: float32 without starting the probe (whose answer would be float32 too, at 0.19x)
    "amd-epyc-zen3": ("float32", "this CPU has no native bfloat16 instructions (amx_bf16, avx512_bf16)", False, None),
    "amd-epyc-zen4": ("bfloat16", PROBE_DECISIONS["amd-epyc-zen4"][1], True, "avx512_bf16"),
    "amd-epyc-zen5": ("bfloat16", PROBE_DECISIONS["amd-epyc-zen5"][1], True, "avx512_bf16"),
    "intel-xeon-amx": ("bfloat16", PROBE_DECISIONS["intel-xeon-amx"][1], True, "amx_bf16"),
}


def test_every_recorded_cpu_has_its_expected_decisions() -> None:
    assert sorted(RECORDS) == sorted(PROBE_DECISIONS) == sorted(RUN_CHOICES)
    assert all(record["source"] and record["machine"] for record in RECORDS.values())


@pytest.mark.parametrize("cpu", sorted(PROBE_DECISIONS))
def test_the_probe_decides_on_each_recorded_cpus_measurements(cpu: str) -> None:
    assert tune.choose_dtype(RECORDS[cpu]["trials"]) == PROBE_DECISIONS[cpu]


@pytest.mark.parametrize("cpu", sorted(RUN_CHOICES))
def test_a_run_on_each_recorded_cpu_applies_its_dtype_and_says_why(
    home: Any, monkeypatch: pytest.MonkeyPatch, cpu: str
) -> None:
    """measured_settings with this CPU's flags, and the probe (when it runs)
    returning the recorded trials through choose_dtype, as probe_dtype does."""
    record = RECORDS[cpu]
    dtype, why, probes, bfloat16 = RUN_CHOICES[cpu]
    monkeypatch.setattr(tune, "cpu_flags", lambda: set(record["flags"]))
    probed: list[str] = []

    def recorded_probe(model: str, settings: Settings, engine_factory: Any, say: Any = None) -> dict[str, Any]:
        probed.append(model)
        chosen, reason = tune.choose_dtype(record["trials"])
        return {"dtype": chosen, "why": reason, "tolerance": tune.PROBE_TOLERANCE, "trials": record["trials"]}

    monkeypatch.setattr(tune, "probe_dtype", recorded_probe)
    settings, choice = tune.measured_settings("m", Settings(), "cpu", no_engine)
    assert (settings.engine.dtype, choice["dtype"]["dtype"], choice["dtype"]["why"]) == (dtype, dtype, why)
    assert probed == (["m"] if probes else [])
    assert choice["dtype"].get("trials") == (record["trials"] if probes else None)
    stored = stored_choice("dtype", "m", tune.dtype_machine())
    # the probe's answer is stored for this CPU's bfloat16 instructions; without them nothing is stored
    assert (stored["machine"]["bfloat16"] if stored else None) == bfloat16


class Measured:
    """Stands in for an engine in :func:`tune.tune`: its rate is looked up by its settings."""

    def __init__(self, settings: Settings) -> None:
        self.key = (settings.engine.max_num_seqs, settings.engine.max_num_batched_tokens)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_tuning_keeps_vllms_defaults_unless_a_settings_slowest_run_beats_the_defaults_fastest(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each setting's two runs; the defaults' control runs (measured again last) at the end
    runs = {
        (256, 4096): [200.0, 206.0, 199.0, 205.0],
        (128, 4096): [190.0, 192.0],
        (512, 4096): [204.0, 212.0],  # its best beats the defaults' best, its worst does not: noise
        (256, 2048): [180.0, 182.0],
        (256, 8192): [215.0, 220.0],  # both runs beat every run of the defaults
    }
    served = {key: iter(rates) for key, rates in runs.items()}
    engines: list[Measured] = []

    def factory(model: str, settings: Settings) -> Measured:
        engines.append(Measured(settings))
        return engines[-1]

    monkeypatch.setattr(tune, "load_tokenizer", lambda model, trust: None)

    def speed(
        engine: Measured, tokenizer: Any, rows: int, tokens: int, budget_s: Any = None
    ) -> tuple[float, float, bool]:
        return (next(served[engine.key]) if rows > 16 else 1.0), 1.0, False

    monkeypatch.setattr(tune, "speed", speed)
    entry = tune.tune("m", Settings(), factory)  # type: ignore[arg-type]
    assert entry["settings"] == {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
    assert [tuple(t["settings"].values()) for t in entry["trials"]] == [*runs, (256, 4096)]  # the control last
    assert entry["trials"][2] == {
        "settings": {"max_num_seqs": 512, "max_num_batched_tokens": 4096},
        "completion_tokens_per_s": 204.0,
        "trial_rates": [204.0, 212.0],
    }
    assert len(engines) == 2 * 6 and all(engine.closed for engine in engines)  # each run on an engine of its own
    assert stored_choice("scheduler", "m", tune._tune_machine())["settings"] == entry["settings"]


def test_tuning_measures_the_defaults_again_and_a_machine_that_sped_up_is_not_a_better_setting(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every run faster than the one before, the defaults' control runs too
    rates = iter([144.0, 150.0, 162.0, 166.0, 174.0, 177.0, 182.0, 184.0, 185.0, 188.0, 187.0, 189.0])
    monkeypatch.setattr(tune, "load_tokenizer", lambda model, trust: None)
    speed = lambda engine, tokenizer, rows, tokens, budget_s=None: (next(rates) if rows > 16 else 1.0, 1.0, False)  # noqa: E731
    monkeypatch.setattr(tune, "speed", speed)
    entry = tune.tune("m", Settings(), lambda model, settings: Measured(settings))  # type: ignore[arg-type,return-value]
    assert entry["settings"] == tune.TUNE_DEFAULTS  # the last setting's slowest (185) is under the control's 189
    assert len(entry["trials"]) == 6
