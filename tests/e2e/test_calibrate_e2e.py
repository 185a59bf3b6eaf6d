"""End to end: `bulkinfer calibrate` runs the dtype probe with the real engine
on the default model (its numbers printed: `pytest -s`) in the session's
``BULKINFER_HOME``, first of the end-to-end modules: every later run of the
session uses the stored dtype and says why in its report
(``e2e_helpers.check_dtype_decision``, on each run's report). Its float32
perplexity agrees with transformers on the same text. With
``BULKINFER_E2E_DTYPE`` set, the forced dtype is stored again afterwards."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from e2e_helpers import bulkinfer, stored_dtype_choice

from bulkinfer.jobs.tune import PROBE_PASSAGES, PROBE_SPEED_CUTOFF, choose_dtype, dtype_machine
from bulkinfer.models import resolve_model
from bulkinfer.report.calibration import record_choice

pytestmark = pytest.mark.e2e


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
def calibrated(e2e_home: Path) -> dict[str, Any]:
    model = resolve_model(None)
    forced = stored_dtype_choice() if os.environ.get("BULKINFER_E2E_DTYPE") else None
    proc = bulkinfer("calibrate", "--model", model)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = orjson.loads((e2e_home / "calibration.json").read_bytes())
    (probe,) = [c for c in store["choices"] if c["kind"] == "dtype"]
    if forced is not None:  # the rest of the session runs the forced dtype again
        record_choice("dtype", model, dtype_machine(), {k: forced[k] for k in ("dtype", "why", "trials")})
    return {"home": e2e_home, "model": model, "proc": proc, "store": store, "probe": probe}


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


def test_a_dtype_slower_than_float32_is_timed_no_longer_than_the_cutoff(calibrated: dict[str, Any]) -> None:
    """A speed trial still running at PROBE_SPEED_CUTOFF x float32's time is
    stopped: its rate so far is then under 1 / cutoff of float32's."""
    trials = {t["dtype"]: t for t in calibrated["probe"]["trials"]}
    reference = trials["float32"]
    for trial in trials.values():
        if "speed_trial_cut" in trial:
            assert trial["speed_trial_s"] < PROBE_SPEED_CUTOFF * reference["speed_trial_s"] + 15  # one engine step
            assert trial["completion_tokens_per_s"] < reference["completion_tokens_per_s"] / PROBE_SPEED_CUTOFF
