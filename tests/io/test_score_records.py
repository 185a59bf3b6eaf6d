"""Scoring output records built from engine outputs: OpenAI-style /v1/score
and /v1/rerank lines checked against vLLM's BatchRequestOutput,
ScoreResponse and RerankResponse (no field they do not declare), a
cross-encoder's per-pair outputs, top_n and ties, error lines, and the
records read back for resume."""

from __future__ import annotations

import pytest
from reference_types import check_scoring_line

from bulkinfer.io.records import error_record, output_record, pair_scores, parse_output
from bulkinfer.prep.scores import parse_score_row
from bulkinfer.schema import Completion, RowError, RowInvalid

UNIT = {"a": [1.0, 0.0], "b": [0.0, 1.0], "ab": [0.6, 0.8]}


def line(url: str, body: dict) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": url, "body": body}


def done(vectors: list[list[float]], tokens: int = 11) -> Completion:
    return Completion("0", "", "stop", prompt_tokens=tokens, completion_tokens=0, embeddings=tuple(vectors))


def test_a_score_line_is_vllms_score_response_one_score_per_pair() -> None:
    request = parse_score_row(line("/v1/score", {"data_1": ["a", "b"], "data_2": ["ab", "ab"], "model": "m"}), 0, 1)
    record = output_record(request, done([UNIT["a"], UNIT["b"], UNIT["ab"], UNIT["ab"]]), "all-minilm-l6-v2")
    parsed = check_scoring_line(record)
    assert [(d.index, d.score) for d in parsed.data] == [(0, pytest.approx(0.6)), (1, pytest.approx(0.8))]
    assert (parsed.model, parsed.usage.prompt_tokens, parsed.usage.total_tokens) == ("m", 11, 11)
    assert record["custom_id"] == "c1" and record["response"]["status_code"] == 200 and record["error"] is None
    back = parse_output(record)
    assert back is not None and back.id == "c1"


def test_a_rerank_line_is_vllms_rerank_response_ranked_and_cut_to_top_n() -> None:
    body = {"query": "a", "documents": ["b", "ab", "a"], "top_n": 2}
    request = parse_score_row(line("/v1/rerank", body), 0, 1)
    record = output_record(request, done([UNIT["a"], UNIT["b"], UNIT["ab"], UNIT["a"]]), "enc")
    parsed = check_scoring_line(record)
    assert [(r.index, r.document.text) for r in parsed.results] == [(2, "a"), (1, "ab")]
    assert parsed.results[0].relevance_score == pytest.approx(1.0) and parsed.model == "enc"
    assert record["response"]["body"]["results"][0]["document"] == {"text": "a", "multi_modal": None}


def test_a_cross_encoders_outputs_are_the_scores_and_ties_keep_document_order() -> None:
    request = parse_score_row({"id": "r", "query": "q", "documents": ["d0", "d1", "d2"]}, 0, 1)
    assert request.similarity is not None
    request.similarity["method"] = "cross-encoder"
    record = output_record(request, done([[0.25], [0.75], [0.25]]), "ce")
    assert record["results"] == [
        {"index": 1, "relevance_score": 0.75},
        {"index": 0, "relevance_score": 0.25},
        {"index": 2, "relevance_score": 0.25},
    ]
    assert pair_scores({"method": "cross-encoder", "pairs": [(0, 1)]}, [[-2.5]]) == [-2.5]


def test_a_bi_encoders_many_to_many_pairs_are_each_its_own_cosine() -> None:
    pairs = [(0, 2), (1, 3)]
    assert pair_scores({"pairs": pairs}, [UNIT["a"], UNIT["b"], UNIT["b"], UNIT["ab"]]) == [
        pytest.approx(0.0),
        pytest.approx(0.8),
    ]


def test_a_failed_scoring_line_is_an_error_line_vllm_reads() -> None:
    with pytest.raises(RowInvalid) as caught:
        parse_score_row(line("/v1/rerank", {"query": "q", "documents": []}), 0, 1)
    error = caught.value
    record = error_record(RowError(1, error.row_id, error.type, error.message, error.openai))
    assert check_scoring_line(record) is None and record["custom_id"] == "c1"
