"""End to end: evaluation with the real engine and the default model (the
session's shared engine, through ``bulkinfer.evaluate``: generation, then
perplexity on the same engine), its perplexity checked against Hugging Face
transformers on the same model; ``bulkinfer eval --predictions`` (the CLI:
scoring only, no engine) on what it wrote."""

from __future__ import annotations

import io
import math
from typing import Any

import orjson
import pytest
from e2e_helpers import ROOT, bulkinfer, read_jsonl
from rich.console import Console

import bulkinfer as api
from bulkinfer.errors import EXIT_BELOW_BAR
from bulkinfer.metrics.text import METRICS
from bulkinfer.report.eval_view import print_eval

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory, shared_engine: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("eval")
    golden = tmp / "golden.jsonl"
    rows = read_jsonl(ROOT / "sample_data" / "golden.jsonl")[:10]
    rows[1]["reference"] = [rows[1]["reference"], "A second, shorter reference."]
    golden.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp / "out.jsonl"
    result = api.evaluate(
        golden, out, engine=shared_engine, apply_chat_template=True, max_tokens=32, temperature=0,
        perplexity=True, bootstrap=50, progress_plain=True,
    )  # fmt: skip
    shown = io.StringIO()
    print_eval(result.report, None, Console(file=shown, width=200))  # what `bulkinfer eval` prints
    return {"result": result, "stdout": shown.getvalue(), "golden": golden, "out": out, "rows": rows, "tmp": tmp}


def test_eval_writes_all_metrics_with_signatures(evaluated: dict[str, Any]) -> None:
    assert evaluated["result"].exit_code == 0
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
    assert "bleu" in evaluated["stdout"] and "signature" in evaluated["stdout"]


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
    # the engine's dtype, as bulkinfer decided it for this machine: float32 agrees within 2% per row; bfloat16
    # (chosen where the dtype probe found it within 2% of float32 over its whole text) within 5% per row
    dtype = orjson.loads(evaluated["out"].with_name("out.report.json").read_bytes())["engine"]["dtype"]
    tolerance = 0.02 if dtype == "float32" else 0.05
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
        assert outputs[row["id"]]["perplexity"] == pytest.approx(expected, rel=tolerance), dtype


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
