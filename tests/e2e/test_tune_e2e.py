"""End to end: `bulkinfer calibrate` runs the dtype probe with the real engine
on the default model (its numbers printed: `pytest -s`), its float32
perplexity agrees with transformers on the same text, and a later run uses
the stored dtype and says why in its report."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from bulkinfer.jobs.tune import PROBE_PASSAGES, choose_dtype
from bulkinfer.models import resolve_model

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def bulkinfer(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bulkinfer", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", "BULKINFER_HOME": str(home)},
    )


def transformers_perplexity(model: str) -> float:
    """The probe's text scored as the probe does (title as a raw prompt, each
    passage's tokens given it), in float32 with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    total, count = 0.0, 0
    for title, text in PROBE_PASSAGES:
        prompt = tokenizer(title)["input_ids"]
        reference = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + reference])
        with torch.no_grad():
            logprobs = torch.log_softmax(lm(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        scored = logprobs[torch.arange(len(targets)), targets][len(prompt) - 1 :]
        total -= float(scored.sum())
        count += len(reference)
    return math.exp(total / count)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("home")
    model = resolve_model(None)  # the default model, prepared in the real home; the store goes to `home`
    proc = bulkinfer(home, "calibrate", "--model", model)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = orjson.loads((home / "calibration.json").read_bytes())
    (probe,) = [c for c in store["choices"] if c["kind"] == "dtype"]
    return {"home": home, "model": model, "proc": proc, "store": store, "probe": probe}


def test_the_probe_scores_both_dtypes_and_chooses_by_its_rule(calibrated: dict[str, Any]) -> None:
    probe = calibrated["probe"]
    trials = {t["dtype"]: t for t in probe["trials"]}
    print(f"dtype probe on {probe['machine']}: {probe['trials']} -> {probe['dtype']} ({probe['why']})")
    assert set(trials) == {"float32", "bfloat16"}
    assert probe["reference_tokens"] > 200
    assert trials["float32"]["completion_tokens_per_s"] > 0
    assert (probe["dtype"], probe["why"]) == choose_dtype(probe["trials"])
    assert f"dtype: {probe['dtype']} (float32 perplexity {trials['float32']['perplexity']:.3f}" in (
        calibrated["proc"].stdout
    )
    # the calibration workload ran with the chosen dtype
    (entry,) = calibrated["store"]["entries"]
    assert entry["source"] == "calibrate" and entry["dtype"] == probe["dtype"]


def test_the_float32_perplexity_agrees_with_transformers(calibrated: dict[str, Any]) -> None:
    ours = {t["dtype"]: t for t in calibrated["probe"]["trials"]}["float32"]["perplexity"]
    theirs = transformers_perplexity(calibrated["model"])
    print(f"probe text perplexity, float32: vLLM {ours:.4f}, transformers {theirs:.4f}")
    assert ours == pytest.approx(theirs, rel=0.01)


def test_a_later_run_uses_the_stored_dtype_and_says_why(calibrated: dict[str, Any], tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "What is the capital of France?"}\n')
    out = tmp_path / "out.jsonl"
    proc = bulkinfer(calibrated["home"], "run", str(src), "-o", str(out), "--model", calibrated["model"],
                     "--max-tokens", "8", "--plain-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = orjson.loads(out.with_name("out.report.json").read_bytes())
    probe = calibrated["probe"]
    assert report["engine"]["dtype"] == probe["dtype"]
    assert report["engine_choice"]["dtype"]["why"] == probe["why"]
    assert report["engine_choice"]["dtype"]["measured_at"] == probe["measured_at"]
