"""`bulkinfer plan`: counts and padding figures against values computed
independently here, with the default model's real tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from bulkinfer.config import load_settings
from bulkinfer.jobs.plan import plan_file
from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.report.calibration import record_calibration

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


def test_plan_estimate_comes_from_the_last_run(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"prompt": "hello there", "max_tokens": 50}) + b"\n" for _ in range(10)))
    settings = load_settings(None, {"model": model})
    assert plan_file(src, settings)["estimate"] is None
    record_calibration({
        "model_path": model, "output": "x", "request_counts": {"completed": 100}, "resumed": {"completed": 0},
        "throughput": {"completion_tokens_per_s": 250.0, "prompt_tokens_per_s": 500.0, "requests_per_s": 2.0},
        "seconds": {"load": 30.0}, "engine": {"device": "cpu", "dtype": "float32"},
    })  # fmt: skip
    estimate = plan_file(src, settings)["estimate"]
    assert estimate["generate_seconds_at_most"] == pytest.approx(10 * 50 / 250.0)
    assert estimate["load_seconds"] == 30.0


def test_calibrate_records_what_plan_estimates_from(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fakes import FakeEngine

    from bulkinfer.jobs.calibrate import calibrate
    from bulkinfer.report.calibration import load_calibrations

    model = resolve_model(None)
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    entry = calibrate(load_settings(None, {"model": model}), engine_factory=lambda m, s: FakeEngine())
    assert load_calibrations()[model] == entry
    assert entry["rows"] == 64 and entry["completion_tokens_per_s"] > 0
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"prompt": "hi", "max_tokens": 10}) + b"\n")
    estimate = plan_file(src, load_settings(None, {"model": model}))["estimate"]
    assert estimate["generate_seconds_at_most"] == pytest.approx(10 / entry["completion_tokens_per_s"])
