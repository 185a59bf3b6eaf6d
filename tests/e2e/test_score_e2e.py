"""``bulkinfer score`` end to end: the real CLI, vLLM's pooling runner and the
embedded all-MiniLM-L6-v2 as a bi-encoder. One job (``--truncate``, as
sentence-transformers cuts) scores 200 ShareGPT prompt/reply pairs (each
prompt with its own reply, or with another prompt's) and reranks replies for
20 more prompts, with bad rows among them; its first run is killed with
SIGKILL mid-run and ``--resume`` finishes it (every id once). The finished
output is checked against sentence-transformers: ``util.cos_sim`` of
``SentenceTransformer.encode`` on the same model directory. (Error shapes,
ties, top_n and the Parquet types are checked with a fake encoder in
tests/jobs/test_score_job.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from e2e_helpers import SAMPLE, kill_9_mid_run, read_jsonl, resume_to_the_end, row_key

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
BAD = [
    {"id": "bad-empty", "text_1": "", "text_2": "x"},
    {"id": "bad-docs", "query": "q", "documents": []},
    {"id": "bad-both", "text_1": "a", "text_2": "b", "query": "c"},
    {"id": "bad-prompt", "prompt": "hi"},
    {"custom_id": "bad-openai", "method": "POST", "url": "/v1/rerank", "body": {"query": "q", "documents": ["d"]}},
]


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job, killed once five rows are on disk, then resumed to the end (exit 3: the bad rows)."""
    rows: list[Any] = [*PAIRS[:100], *BAD[:3], *RERANKS, TIE, *PAIRS[100:], *BAD[3:]]
    killed = kill_9_mid_run(tmp_path_factory.mktemp("score"), "--truncate", command="score", data=rows, engines=None)
    return {**resume_to_the_end(killed, exit_code=3), "rows": rows}


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
    assert "not supported yet" in errors["bad-openai"]["error"]["message"]
    assert "`bulkinfer run`" in errors["bad-prompt"]["error"]["message"]
    assert "field 'documents'" in errors["bad-docs"]["error"]["message"]
    assert scored["job"] == "score" and scored["request_counts"]["completed"] == len(PAIRS) + len(RERANKS) + 1
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
    assert [r["id"] for r in scored["outputs"]] == good  # every id once, in input order
