"""End to end: `bulkinfer eval` with the real engine and the default model, and
its perplexity checked against Hugging Face transformers on the same model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from bulkinfer.errors import EXIT_BELOW_BAR
from bulkinfer.metrics.text import METRICS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def bulkinfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bulkinfer", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("eval")
    golden = tmp / "golden.jsonl"
    rows = read_jsonl(ROOT / "sample_data" / "golden.jsonl")[:10]
    rows[1]["reference"] = [rows[1]["reference"], "A second, shorter reference."]
    golden.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp / "out.jsonl"
    proc = bulkinfer(
        "eval", str(golden), "-o", str(out), "--apply-chat-template", "--max-tokens", "32",
        "--temperature", "0", "--perplexity", "--bootstrap", "50", "--plain-progress",
    )  # fmt: skip
    return {"proc": proc, "golden": golden, "out": out, "rows": rows, "tmp": tmp}


def test_eval_writes_all_metrics_with_signatures(evaluated: dict[str, Any]) -> None:
    proc = evaluated["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = orjson.loads(evaluated["out"].with_name("out.eval.json").read_bytes())
    scores = report["scores"]
    for name in METRICS:
        assert 0 <= scores[name] <= 100, name
        low, high = scores["ci"][name]
        assert low <= scores[name] + 1e-9 and scores[name] <= high + 1e-9
    assert scores["signatures"]["bleu"].startswith("nrefs:var|")
    assert "chrF2" in scores["signatures"]["chrf"] or scores["signatures"]["chrf"].startswith("nrefs")
    assert scores["perplexity"] > 1
    assert report["row_counts"]["scored"] == 10 and report["row_counts"]["unmatched_golden"] == []
    assert set(report["metrics_version"]) >= {"sacrebleu", "rouge-score"}
    assert "bleu" in proc.stdout and "signature" in proc.stdout


def test_eval_output_rows_carry_per_row_scores(evaluated: dict[str, Any]) -> None:
    outputs = read_jsonl(evaluated["out"])
    assert sorted(o["id"] for o in outputs) == sorted(r["id"] for r in evaluated["rows"])
    for o in outputs:
        assert 0 <= o["bleu"] <= 100 and 0 <= o["rougeL"] <= 100 and o["exact_match"] in (0, 100)
        assert o["perplexity"] > 1
        assert o["completion_tokens"] <= 32


def test_corpus_perplexity_is_exp_of_mean_nll(evaluated: dict[str, Any]) -> None:
    # corpus perplexity = exp(total NLL / total tokens) lies between the row extremes
    outputs = read_jsonl(evaluated["out"])
    report = orjson.loads(evaluated["out"].with_name("out.eval.json").read_bytes())
    rows = [o["perplexity"] for o in outputs]
    assert min(rows) <= report["scores"]["perplexity"] <= max(rows)


def test_perplexity_agrees_with_transformers(evaluated: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bulkinfer.models import resolve_model

    path = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outputs = {o["id"]: o for o in read_jsonl(evaluated["out"])}
    for row in evaluated["rows"][:3]:
        reference = row["reference"] if isinstance(row["reference"], str) else row["reference"][0]
        chat = [{"role": "user", "content": row["prompt"]}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reference_ids = tokenizer(reference, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + reference_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        token_logprobs = logprobs.gather(1, targets[:, None])[:, 0]
        nll = -token_logprobs[len(prompt_ids) - 1 :].sum().item()
        expected = math.exp(nll / len(reference_ids))
        assert outputs[row["id"]]["perplexity"] == pytest.approx(expected, rel=0.02)


def test_predictions_mode_fail_under_and_compare(evaluated: dict[str, Any]) -> None:
    tmp = evaluated["tmp"]
    rescored = tmp / "rescored.jsonl"
    proc = bulkinfer(
        "eval", str(evaluated["golden"]), "--predictions", str(evaluated["out"]), "-o", str(rescored),
        "--fail-under", "bleu=99,exact_match=100", "--compare", str(evaluated["out"].with_name("out.eval.json")),
    )  # fmt: skip
    assert proc.returncode == EXIT_BELOW_BAR, proc.stderr[-3000:]
    assert "below the bar: bleu" in proc.stderr
    assert "+0.00" in proc.stdout  # same predictions: no change against the previous eval
    report = orjson.loads(rescored.with_name("rescored.eval.json").read_bytes())
    first = orjson.loads(evaluated["out"].with_name("out.eval.json").read_bytes())
    assert report["scores"]["bleu"] == pytest.approx(first["scores"]["bleu"], abs=1e-9)
    assert report["fail_under"]["below"][0].startswith("bleu")
