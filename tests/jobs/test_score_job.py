"""The orchestration of ``bulkinfer score`` with a fake encoder engine (the
real tokenizer of the embedded all-MiniLM-L6-v2; vectors that count tokens,
so the same text has the same vector): one record per row, the cosine in
float64, rerank order with ties and top_n, the Parquet column types, resume
reading score records back, the method read from the model, the report. It never
stands in as proof that scoring works: tests/e2e/test_score_e2e.py runs vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import FakeBagEncoder

from bulkinfer.config import Settings
from bulkinfer.errors import ConfigError, Interrupted
from bulkinfer.io.output_files import RunPaths
from bulkinfer.io.records import cosines, parse_output
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.score import score, scoring_method
from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.report.model import RunReport
from bulkinfer.stop import StopToken

SCHEMA = Path(__file__).parents[2] / "bulkinfer" / "report" / "report.schema.json"
ROWS: list[Any] = [
    {"id": "p", "text_1": "The cat sat on the mat.", "text_2": "A cat sat on a mat.", "lang": "en"},
    {"id": "r", "query": "cat on a mat", "documents": ["dogs bark", "The cat sat on the mat.", "dogs bark"]},
    {"id": "top", "query": "cat on a mat", "documents": ["dogs bark", "a dog on a log", "mat on a rug"], "top_n": 2},
    {"id": "docs", "query": "cat", "documents": ["cat", "dog"], "return_documents": True},
    {"id": "empty", "query": "q", "documents": []},
    {"id": "long", "text_1": "x", "text_2": "word " * 300},
    {"custom_id": "c", "method": "POST", "url": "/v1/rerank", "body": {"query": "cat", "documents": ["dogs", "cat"]}},
    {
        "custom_id": "s",
        "method": "POST",
        "url": "/v1/score",
        "body": {"text_1": ["cat", "a dog"], "text_2": ["cat", "cat"]},
    },
    {"custom_id": "bad", "url": "/v1/score", "body": {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3}},
    {"id": "both", "text_1": "a", "text_2": "b", "query": "c"},
]


def write(path: Path, rows: list[Any] = ROWS) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def fake(resume: bool = False, stop: StopToken | None = None) -> RunContext:
    """A context whose engine is a FakeBagEncoder (``stop``: set after its second step)."""
    stop_at = (2, stop) if stop is not None else None
    return RunContext(
        resume=resume, stop=stop or StopToken(), engine_factory=lambda model, settings: FakeBagEncoder(stop_at=stop_at)
    )


def bag(text: str) -> list[float]:
    """FakeBagEncoder's vector of ``text``, from the same tokenizer."""
    tokenizer = load_tokenizer(resolve_model("all-minilm-l6-v2"))
    return FakeBagEncoder().vector(0, tokenizer(text)["input_ids"])


def reference_cosine(a: list[float], b: list[float]) -> float:
    a64, b64 = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def test_every_row_is_one_record_scored_by_the_cosine_of_its_vectors(tmp_path: Path) -> None:
    paths = RunPaths.build(write(tmp_path / "in.jsonl"), None, ".scores.jsonl")
    assert paths.output == tmp_path / "in.scores.jsonl"
    result = score(paths, Settings(), fake())
    assert (result.exit_code, result.completed, result.failed) == (3, 6, 4)
    out = {r.get("custom_id") or r["id"]: r for r in map(orjson.loads, paths.output.read_bytes().splitlines())}
    assert list(out) == ["p", "r", "top", "docs", "c", "s"]  # input order
    pair = out["p"]
    assert list(pair) == ["lang", "id", "score", "prompt_tokens"]
    expected = reference_cosine(bag(ROWS[0]["text_1"]), bag(ROWS[0]["text_2"]))
    assert pair["score"] == pytest.approx(expected, abs=1e-12) and 0 < pair["score"] < 1
    assert pair["prompt_tokens"] == 9 + 9
    query = bag("cat on a mat")
    ranked = out["r"]["results"]
    assert [r["index"] for r in ranked] == [1, 0, 2]  # the two equal documents tie: document order kept
    assert ranked[1]["relevance_score"] == ranked[2]["relevance_score"]
    assert ranked[0]["relevance_score"] == pytest.approx(reference_cosine(query, bag(ROWS[1]["documents"][1])))
    assert set(ranked[0]) == {"index", "relevance_score"}
    scores = [reference_cosine(query, bag(d)) for d in ROWS[2]["documents"]]
    best = sorted(range(3), key=lambda k: -scores[k])[:2]
    assert len(set(scores)) == 3 and [r["index"] for r in out["top"]["results"]] == best == [2, 1]  # cut to top_n
    first = out["docs"]["results"][0]
    assert (first["index"], first["document"]) == (0, {"text": "cat"})
    assert first["relevance_score"] == pytest.approx(1.0, abs=1e-12)
    errors = {r.get("custom_id") or r["id"]: r for r in map(orjson.loads, paths.errors.read_bytes().splitlines())}
    assert {k: (e.get("error") or {}).get("type", e["error"].get("code")) for k, e in errors.items()} == {
        "empty": "invalid_field",
        "long": "context_length_exceeded",
        "bad": "unsupported_field",
        "both": "invalid_row",
    }
    assert "text_2 is 302 tokens" in errors["long"]["error"]["message"]
    assert "'body.truncate_prompt_tokens' is not supported" in errors["bad"]["error"]["message"]
    assert errors["bad"]["response"] is None
    rerank = out["c"]["response"]["body"]  # vLLM's RerankResponse: checked against its type in tests/e2e
    assert [(r["index"], r["document"]) for r in rerank["results"]] == [
        (1, {"text": "cat", "multi_modal": None}),
        (0, {"text": "dogs", "multi_modal": None}),
    ]
    assert rerank["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-12)
    assert rerank["usage"] == {"prompt_tokens": 3 + 3 + 3, "total_tokens": 9} and rerank["model"] == "all-minilm-l6-v2"
    scored = out["s"]["response"]["body"]  # vLLM's ScoreResponse; N:N: cat-cat, a dog-cat
    assert [d["index"] for d in scored["data"]] == [0, 1] and scored["data"][0]["score"] == pytest.approx(1.0)
    assert scored["data"][1]["score"] == pytest.approx(reference_cosine(bag("a dog"), bag("cat")), abs=1e-12)
    assert scored["object"] == "list" and scored["usage"]["completion_tokens"] == 0
    report = result.report
    assert report["job"] == "score" and report["model"] == "all-minilm-l6-v2"
    assert report["scoring"] == {
        "method": "bi-encoder cosine",
        "max_seq_length": 256,
        "normalize": True,
        "truncate": False,
        "truncated_inputs": 0,
    }
    assert not set(report) & {"sampling", "finish_reasons", "embedding", "completion_length_histogram"}
    saved = orjson.loads(paths.report.read_bytes())
    jsonschema.Draft202012Validator(orjson.loads(SCHEMA.read_bytes())).validate(saved)
    typed = RunReport.from_dict(saved)
    assert typed.scoring is not None and typed.encoder == typed.scoring
    assert "<h2>Scoring</h2>" in paths.html.read_text()


def test_the_schema_wants_scoring_in_a_score_report(tmp_path: Path) -> None:
    paths = RunPaths(write(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "out.jsonl")
    report = orjson.loads(orjson.dumps(score(paths, Settings(), fake()).report))
    validator = jsonschema.Draft202012Validator(orjson.loads(SCHEMA.read_bytes()))
    del report["scoring"]
    assert list(validator.iter_errors(report))


def test_parquet_output_types_score_double_and_results_a_list_of_structs(tmp_path: Path) -> None:
    paths = RunPaths(write(tmp_path / "in.jsonl", ROWS[:3]), tmp_path / "out.parquet")
    score(paths, Settings(), fake())
    table = pq.read_table(paths.output)
    assert table.schema.field("score").type == pa.float64()
    result = pa.struct([("index", pa.int64()), ("relevance_score", pa.float64())])
    assert table.schema.field("results").type == pa.list_(result)
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["p", "r", "top"]
    assert rows[0]["results"] is None and rows[1]["score"] is None
    assert [r["index"] for r in rows[1]["results"]] == [1, 0, 2]


def test_an_inputs_score_or_results_field_is_replaced_in_either_shape(tmp_path: Path) -> None:
    """The report says an input's ``score`` and ``results`` are not copied: a
    pair row writes its own ``score`` and no ``results``, a rerank row the reverse."""
    rows = [{**ROWS[0], "results": "old", "score": "high"}, {**ROWS[1], "score": 0.1, "results": "old"}]
    paths = RunPaths(write(tmp_path / "in.jsonl", rows), tmp_path / "out.parquet")
    score(paths, Settings(), fake())
    table = pq.read_table(paths.output)
    assert table.schema.field("score").type == pa.float64()
    assert pa.types.is_list(table.schema.field("results").type)
    pair, rerank = table.to_pylist()
    assert pair["results"] is None and isinstance(pair["score"], float) and pair["lang"] == "en"
    assert rerank["score"] is None and [r["index"] for r in rerank["results"]] == [1, 0, 2]


def test_a_parquet_input_with_pair_and_rerank_columns(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    names = dict.fromkeys(key for row in ROWS[:2] for key in row)
    pq.write_table(pa.table({name: [row.get(name) for row in ROWS[:2]] for name in names}), src)
    paths = RunPaths(src, tmp_path / "out.jsonl")
    result = score(paths, Settings(), fake())
    assert (result.completed, result.failed) == (2, 0)


def test_resume_reads_score_records_back_and_refuses_another_truncate(tmp_path: Path) -> None:
    rows = [{"id": f"p{i}", "text_1": f"text {i}", "text_2": f"other {i}"} for i in range(10)]
    rows += [{"id": f"r{i}", "query": f"q {i}", "documents": ["a", f"b {i}"]} for i in range(10)]
    paths = RunPaths(write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl")
    with pytest.raises(Interrupted):
        score(paths, Settings(), fake(stop=StopToken()))
    with pytest.raises(ConfigError, match=r"score\.truncate: false -> true"):
        score(paths, Settings(), fake(resume=True), truncate=True)
    result = score(paths, Settings(), fake(resume=True))
    assert 0 < result.report["resumed"]["completed"] < 20
    assert (result.completed, result.failed) == (20, 0)
    ids = [r["id"] for r in map(orjson.loads, paths.output.read_bytes().splitlines())]
    assert ids == [r["id"] for r in rows]  # every id once, in input order


def test_parse_output_reads_score_records_back() -> None:
    pair = parse_output({"id": "p", "score": 0.5, "prompt_tokens": 12})
    rerank = parse_output({"id": "r", "results": [{"index": 0, "relevance_score": 0.1}], "prompt_tokens": 7})
    assert pair is not None and (pair.id, pair.completion, pair.prompt_tokens) == ("p", "", 12)
    assert rerank is not None and (rerank.id, rerank.prompt_tokens) == ("r", 7)
    run_row = parse_output({"id": "g", "completion": "hi", "score": "a pass-through field"})
    assert run_row is not None and run_row.completion == "hi"


def test_the_cosine_is_the_true_one_in_float64_normalized_or_not() -> None:
    assert cosines([3.0, 4.0], [[6.0, 8.0], [-3.0, -4.0], [4.0, -3.0], [0.0, 0.0]]) == [1.0, -1.0, 0.0, 0.0]
    a, b = [0.1, 0.2, 0.3], [0.3, 0.1, -0.2]
    assert cosines(a, [b])[0] == pytest.approx(reference_cosine(a, b), abs=1e-15)


def test_a_classifier_of_two_labels_is_refused_before_any_file_is_written(tmp_path: Path) -> None:
    model = tmp_path / "reranker"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')  # num_labels 2
    (model / "model.safetensors").write_bytes(b"")
    paths = RunPaths(write(tmp_path / "in.jsonl"), tmp_path / "out.jsonl")
    with pytest.raises(ConfigError, match="a classifier with 2 labels .* needs a cross-encoder with one label"):
        score(paths, Settings(model=str(model)), fake())
    assert not paths.output.exists() and not paths.errors.exists()


def test_the_method_is_read_from_the_model_config(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    for config, method in [
        ({"architectures": ["BertForSequenceClassification"], "num_labels": 1}, "cross-encoder"),
        ({"architectures": ["XLMRobertaForSequenceClassification"], "id2label": {"0": "LABEL_0"}}, "cross-encoder"),
        ({"architectures": ["BertModel"]}, "bi-encoder cosine"),
    ]:
        (model / "config.json").write_text(orjson.dumps(config).decode())
        assert scoring_method(str(model)) == method
