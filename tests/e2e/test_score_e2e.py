"""``bulkinfer score`` end to end: the real CLI and vLLM's pooling runner.

The bi-encoder job (the embedded all-MiniLM-L6-v2, ``--truncate``, as
sentence-transformers cuts) scores 200 ShareGPT prompt/reply pairs (each
prompt with its own reply, or with another prompt's), reranks replies for
20 more prompts and answers OpenAI-style /v1/score and /v1/rerank lines,
with bad rows among them; its first run is killed with SIGKILL mid-run and
``--resume`` finishes it (every id once). Its output is checked against
sentence-transformers (``util.cos_sim`` of ``SentenceTransformer.encode`` on
the same model directory) and vLLM's response types.

The cross-encoder job scores the same rows with a tiny
``BertForSequenceClassification`` (one label, random weights) the test
saves locally, checked against sentence-transformers' ``CrossEncoder`` on
the same directory. (Error shapes, ties, top_n and the Parquet types are
checked with a fake encoder in tests/jobs/test_score_job.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import orjson
import pytest
from e2e_helpers import (
    SAMPLE,
    bulkinfer,
    kill_9_mid_run,
    read_jsonl,
    read_report,
    resume_to_the_end,
    row_key,
    write_jsonl,
)
from reference_types import check_scoring_line

from bulkinfer.default_model import prepare_default_encoder

pytestmark = pytest.mark.e2e

SHAREGPT = read_jsonl(SAMPLE / "sharegpt.jsonl")
PAIRS = [
    {
        "id": f"pair-{k}",
        "text_1": SHAREGPT[k]["prompt"],
        "text_2": SHAREGPT[k if k % 2 == 0 else (k + 1) % 200]["reference"],
        "matched": k % 2 == 0,
    }
    for k in range(200)
]


def _documents(i: int) -> list[str]:
    """Row ``i``'s own reply and three others of rows 200-219, the own one at position ``i % 4``."""
    picked = [i, *(200 + (i - 200 + d) % 20 for d in (1, 2, 3))]
    picked = picked[-(i % 4) :] + picked[: -(i % 4)] if i % 4 else picked
    return [SHAREGPT[k]["reference"] for k in picked]


RERANKS = [
    {"id": f"rerank-{i}", "query": SHAREGPT[i]["prompt"], "documents": _documents(i)}
    | ({"top_n": 2} if i % 5 == 0 else {})
    for i in range(200, 220)
]
TIE = {
    "id": "tie",
    "query": SHAREGPT[250]["prompt"],
    "documents": [SHAREGPT[251]["reference"], SHAREGPT[250]["reference"], SHAREGPT[251]["reference"]],
    "return_documents": True,
}
LINES = [
    {
        "custom_id": "line-score",
        "method": "POST",
        "url": "/v1/score",
        "body": {"queries": SHAREGPT[230]["prompt"], "documents": [SHAREGPT[k]["reference"] for k in (230, 231, 232)]},
    },
    {
        "custom_id": "line-rerank",
        "method": "POST",
        "url": "/v1/rerank",
        "body": {
            "query": SHAREGPT[233]["prompt"],
            "documents": [SHAREGPT[k]["reference"] for k in (234, 233, 235)],
            "top_n": 2,
        },
    },
]
BAD = [
    {"id": "bad-empty", "text_1": "", "text_2": "x"},
    {"id": "bad-docs", "query": "q", "documents": []},
    {"id": "bad-both", "text_1": "a", "text_2": "b", "query": "c"},
    {"id": "bad-prompt", "prompt": "hi"},
    {
        "custom_id": "bad-openai",
        "method": "POST",
        "url": "/v1/rerank",
        "body": {"query": "q", "documents": [], "top_n": 1},
    },
]
ROWS: list[Any] = [*PAIRS[:100], *BAD[:3], *RERANKS, TIE, *LINES, *PAIRS[100:], *BAD[3:]]


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job, killed once five rows are on disk, then resumed to the end (exit 3: the bad rows) without
    the killed run's ``--max-in-flight`` (there only so that the kill lands mid-run)."""
    killed = kill_9_mid_run(tmp_path_factory.mktemp("score"), "--truncate", command="score", data=ROWS, engines=None)
    return {**resume_to_the_end(killed, exit_code=3, flight_limit=False), "rows": ROWS}


@pytest.fixture(scope="module")
def model() -> Any:
    """sentence-transformers on the prepared default encoder's directory."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(prepare_default_encoder()), device="cpu")
    assert encoder.max_seq_length == 256
    return encoder


@pytest.fixture(scope="module")
def reference(model: Any) -> dict[str, np.ndarray]:
    """sentence-transformers' ``encode`` of every text of the job, by text."""
    texts = sorted(
        {r["text_1"] for r in PAIRS}
        | {r["text_2"] for r in PAIRS}
        | {t for r in [*RERANKS, TIE] for t in [r["query"], *r["documents"]]}
        | {t for r in LINES for t in [r["body"].get("query") or r["body"]["queries"], *r["body"]["documents"]]}
    )
    vectors = model.encode(texts, batch_size=32, convert_to_numpy=True)
    return dict(zip(texts, vectors, strict=True))


def cos_sim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sentence-transformers' ``util.cos_sim`` of ``a`` (n, dim) and ``b`` (m, dim): (n, m)."""
    from sentence_transformers import util

    return util.cos_sim(a, b).numpy()


def test_every_row_ends_as_one_record_and_the_report_says_how_it_scored(scored: dict[str, Any]) -> None:
    errors = {row_key(r): r for r in scored["error_records"]}
    assert set(errors) == {row_key(r) for r in BAD}
    assert "field 'body.documents'" in errors["bad-openai"]["error"]["message"]
    assert "`bulkinfer run`" in errors["bad-prompt"]["error"]["message"]
    assert "field 'documents'" in errors["bad-docs"]["error"]["message"]
    completed = len(PAIRS) + len(RERANKS) + 1 + len(LINES)
    assert scored["job"] == "score" and scored["request_counts"]["completed"] == completed
    scoring = scored["scoring"]
    assert (scoring["method"], scoring["max_seq_length"], scoring["truncate"]) == ("bi-encoder cosine", 256, True)
    assert scoring["normalize"] is True and scoring["truncated_inputs"] > 0


def test_pair_scores_equal_sentence_transformers_cos_sim(
    scored: dict[str, Any], reference: dict[str, np.ndarray], model: Any
) -> None:
    by_id = {r["id"]: r for r in scored["outputs"]}
    ours = np.array([by_id[r["id"]]["score"] for r in PAIRS])
    theirs = np.diagonal(
        cos_sim(np.stack([reference[r["text_1"]] for r in PAIRS]), np.stack([reference[r["text_2"]] for r in PAIRS]))
    )
    difference = np.abs(ours - theirs).max()
    print(f"pair scores vs sentence-transformers util.cos_sim over {len(PAIRS)} pairs: max |diff| {difference:.2e}")
    assert difference <= 1e-5
    matched = np.array([r["matched"] for r in PAIRS])
    assert ours[matched].mean() > ours[~matched].mean() + 0.1  # a prompt is nearer its own reply
    assert all(by_id[r["id"]]["matched"] == r["matched"] for r in PAIRS)  # passed through
    tokenizer = model.tokenizer
    tokens = [
        sum(len(ids) for ids in tokenizer([r["text_1"], r["text_2"]], truncation=True, max_length=256)["input_ids"])
        for r in PAIRS
    ]
    assert [by_id[r["id"]]["prompt_tokens"] for r in PAIRS] == tokens


def test_rerank_results_are_sentence_transformers_cosines_sorted(
    scored: dict[str, Any], reference: dict[str, np.ndarray]
) -> None:
    by_id = {r["id"]: r for r in scored["outputs"]}
    worst = 0.0
    for row in RERANKS:
        theirs = cos_sim(reference[row["query"]][None], np.stack([reference[d] for d in row["documents"]]))[0]
        results = by_id[row["id"]]["results"]
        order = sorted(range(len(theirs)), key=lambda k: -theirs[k])[: row.get("top_n", len(theirs))]
        assert [r["index"] for r in results] == order, (row["id"], theirs)
        worst = max(worst, max(abs(r["relevance_score"] - theirs[r["index"]]) for r in results))
    print(f"rerank relevance_score vs sentence-transformers util.cos_sim: max |diff| {worst:.2e}")
    assert worst <= 1e-5
    tie = by_id["tie"]["results"]
    assert [r["document"]["text"] for r in tie] == [TIE["documents"][r["index"]] for r in tie]
    same = {r["index"]: r["relevance_score"] for r in tie}
    assert abs(same[0] - same[2]) <= 1e-6  # the same document twice
    if same[0] == same[2]:
        assert [r["index"] for r in tie].index(0) < [r["index"] for r in tie].index(2)  # ties keep document order


def test_kill_9_mid_run_then_resume_scores_every_id_once(scored: dict[str, Any]) -> None:
    kept, rows = scored["kept"], scored["rows"]
    assert 5 <= kept < len(rows)
    assert scored["resumed"]["completed"] == kept
    good = [row_key(r) for r in rows if row_key(r) not in {row_key(b) for b in BAD}]
    assert [row_key(r) for r in scored["outputs"]] == good  # every id once, in input order


def test_openai_lines_are_vllms_score_and_rerank_responses_with_sentence_transformers_scores(
    scored: dict[str, Any], reference: dict[str, np.ndarray]
) -> None:
    lines = {r["custom_id"]: r for r in scored["outputs"] if "custom_id" in r}
    score = check_scoring_line(lines["line-score"])
    body = LINES[0]["body"]
    theirs = cos_sim(reference[body["queries"]][None], np.stack([reference[d] for d in body["documents"]]))[0]
    assert [d.index for d in score.data] == [0, 1, 2]
    assert max(abs(d.score - theirs[d.index]) for d in score.data) <= 1e-5
    rerank = check_scoring_line(lines["line-rerank"])
    body = LINES[1]["body"]
    theirs = cos_sim(reference[body["query"]][None], np.stack([reference[d] for d in body["documents"]]))[0]
    assert [r.index for r in rerank.results] == sorted(range(3), key=lambda k: -theirs[k])[:2]  # top_n 2
    assert all(r.document.text == body["documents"][r.index] for r in rerank.results)
    assert max(abs(r.relevance_score - theirs[r.index]) for r in rerank.results) <= 1e-5
    assert check_scoring_line(next(r for r in scored["error_records"] if r.get("custom_id") == "bad-openai")) is None


def make_cross_encoder(path: Any) -> Any:
    """A tiny one-label ``BertForSequenceClassification`` (2 layers, hidden
    128, 4 heads of 32: a head size vLLM's CPU attention has; 128
    positions, so long pairs are cut; random weights with a wide
    initializer, so scores spread) saved at ``path`` with the default
    encoder's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(prepare_default_encoder()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
        num_labels=1,
        initializer_range=0.2,
    )
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def crossed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same rows scored by a cross-encoder made here (``--truncate``)."""
    work = tmp_path_factory.mktemp("cross")
    model = make_cross_encoder(work / "tiny-cross-encoder")
    write_jsonl(work / "in.jsonl", ROWS)
    done = bulkinfer(
        "score", str(work / "in.jsonl"), "-o", str(work / "out.jsonl"), "--model", str(model), "--truncate"
    )
    assert done.returncode == 3, done.stderr[-3000:]
    outputs = {row_key(r): r for r in read_jsonl(work / "out.jsonl")}
    return {"model": model, "outputs": outputs, "report": read_report(work / "out.report.json")}


def test_a_cross_encoder_scores_as_sentence_transformers_cross_encoder(crossed: dict[str, Any]) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(crossed["model"]), device="cpu")
    outputs = crossed["outputs"]
    pairs = [(r["text_1"], r["text_2"]) for r in PAIRS]
    theirs = reference.predict(pairs, batch_size=32)
    ours = np.array([outputs[r["id"]]["score"] for r in PAIRS])
    difference = np.abs(ours - theirs).max()
    print(f"cross-encoder pair scores vs sentence-transformers CrossEncoder.predict: max |diff| {difference:.2e}")
    assert difference <= 1e-4 and np.std(ours) > 0.05  # scores that differ, and equal theirs
    worst = 0.0
    for row in RERANKS:
        expected = reference.predict([(row["query"], d) for d in row["documents"]])
        results = outputs[row["id"]]["results"]
        assert {r["index"] for r in results} == set(sorted(range(4), key=lambda k: -expected[k])[: row.get("top_n", 4)])
        worst = max(worst, max(abs(r["relevance_score"] - expected[r["index"]]) for r in results))
    line = check_scoring_line(outputs["line-rerank"])
    body = LINES[1]["body"]
    expected = reference.predict([(body["query"], d) for d in body["documents"]])
    worst = max(worst, max(abs(r.relevance_score - expected[r.index]) for r in line.results))
    assert worst <= 1e-4
    schema = orjson.loads((Path(__file__).parents[2] / "bulkinfer" / "report" / "report.schema.json").read_bytes())
    jsonschema.Draft202012Validator(schema).validate(crossed["report"])
    scoring = crossed["report"]["scoring"]
    assert (scoring["method"], scoring["max_seq_length"], scoring["truncate"]) == ("cross-encoder", 128, True)
    assert scoring["truncated_inputs"] > 0  # ShareGPT pairs over 128 tokens, cut longest first as CrossEncoder cuts


def test_eval_rank_scores_the_jobs_rankings_with_ir_measures(scored: dict[str, Any], tmp_path: Any) -> None:
    golden = [{**row, "relevant": [int(row["id"].split("-")[1]) % 4]} for row in RERANKS]  # each prompt's own reply
    write_jsonl(tmp_path / "golden.jsonl", golden)
    out = tmp_path / "ranked.jsonl"
    args = ["eval-rank", str(tmp_path / "golden.jsonl"), "--predictions", str(scored["output"]), "-o", str(out)]
    done = bulkinfer(*args, "--measure", "MRR@10", "--measure", "R@1", "--fail-under", "RR@10=0.99")
    report = read_report(tmp_path / "ranked.eval.json")
    by_id = {r["id"]: r for r in scored["outputs"]}
    expected = []
    for row in golden:
        ranked = [r["index"] for r in by_id[row["id"]]["results"]]
        own = row["relevant"][0]
        expected.append(1 / (ranked.index(own) + 1) if own in ranked else 0.0)
    assert report["measures"]["RR@10"] == pytest.approx(sum(expected) / len(expected))
    assert report["measures"]["R@1"] == pytest.approx(sum(e == 1.0 for e in expected) / len(expected))
    assert report["row_counts"]["scored"] == len(RERANKS) and report["scoring"]["method"] == "bi-encoder cosine"
    assert report["measures"]["RR@10"] > 0.5  # a prompt's own reply ranks near the top
    below = report["measures"]["RR@10"] < 0.99
    assert done.returncode == (8 if below else 0), done.stderr[-2000:]
    assert "RR@10" in done.stdout and f"{len(RERANKS)} of {len(RERANKS)} queries scored" in done.stdout
