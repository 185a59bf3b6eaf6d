"""``bulkinfer eval-rank``: golden rerank rows with ``relevant``, the
rankings scored by ir-measures (values checked by hand on small rankings),
the output order as the run (ties as listed, top_n cutting), rows without a
usable ``relevant`` as row errors, ``--predictions``, the bars and the CLI.
The rerank run uses a fake encoder (token-bag vectors): tests/e2e scores
real rankings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from fakes import FakeBagEncoder
from typer.testing import CliRunner

from bulkinfer.cli import app
from bulkinfer.config import Settings
from bulkinfer.errors import EXIT_BELOW_BAR, ConfigError, InputFileError
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.eval_rank import RankEvalOptions, ranking_of, read_rank_golden, run_eval_rank
from bulkinfer.metrics.ranking import parse_measures, parse_rank_bars, rank_measures
from bulkinfer.report.eval_model import RankEvalReport
from bulkinfer.report.saved import load_report

SCHEMA = Path(__file__).parents[2] / "bulkinfer" / "report" / "report.schema.json"

GOLDEN: list[Any] = [
    # the query's own words first: a token bag puts "the cat sat" above the others
    {
        "id": "q1",
        "query": "the cat sat",
        "documents": ["dogs bark loudly", "the cat sat", "birds sing"],
        "relevant": [1],
    },
    {
        "id": "q2",
        "query": "birds sing",
        "documents": ["dogs bark", "a cat", "birds sing"],
        "relevant": {"0": 2, "2": 1},
    },
    {"id": "q3", "query": "x", "documents": ["a", "b"], "relevant": []},
    {"id": "q4", "query": "x", "documents": ["a", "b"], "relevant": [2]},
    {"id": "q5", "text_1": "a", "text_2": "b", "relevant": [0]},
    {"id": "q6", "query": "x", "documents": ["a"]},
]


def write(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def fake() -> RunContext:
    return RunContext(engine_factory=lambda model, settings: FakeBagEncoder())


def test_ndcg_rr_and_recall_are_ir_measures_values_on_the_output_order() -> None:
    golden = {"a": {1: 1}, "b": {0: 2, 2: 1}}
    rankings = {"a": [1, 0, 2], "b": [2, 1, 0]}
    means, per_query = rank_measures(golden, rankings, parse_measures(["nDCG@10", "MRR@10", "R@1"]))
    ideal_b = 2 / math.log2(2) + 1 / math.log2(3)  # trec_eval's nDCG: the gain is the grade itself
    dcg_b = 1 / math.log2(2) + 2 / math.log2(4)
    assert per_query["a"] == {"nDCG@10": 1.0, "RR@10": 1.0, "R@1": 1.0}
    assert per_query["b"]["nDCG@10"] == pytest.approx(dcg_b / ideal_b)
    assert (per_query["b"]["RR@10"], per_query["b"]["R@1"]) == (1.0, 0.5)
    assert means["R@1"] == pytest.approx(0.75) and list(means) == ["nDCG@10", "RR@10", "R@1"]
    tied = rank_measures({"t": {1: 1}}, {"t": [0, 1]}, parse_measures(["RR@10"]))[1]
    assert tied["t"]["RR@10"] == 0.5  # the second listed is second, whatever the scores were
    cut = rank_measures({"c": {2: 1}}, {"c": [0, 1]}, parse_measures(["R@10", "RR@10"]))[1]
    assert cut["c"] == {"R@10": 0.0, "RR@10": 0.0}  # cut by top_n: not retrieved


def test_golden_rows_without_a_usable_relevant_are_listed_with_the_reason(tmp_path: Path) -> None:
    golden = read_rank_golden(write(tmp_path / "g.jsonl", GOLDEN))
    assert golden.relevant == {"q1": {1: 1}, "q2": {0: 2, 2: 1}} and golden.documents == {"q1": 3, "q2": 3}
    reasons = {row["id"]: row["error"] for row in golden.invalid}
    assert "field 'relevant': expected a non-empty list" in reasons["q3"]
    assert "index 2 is outside documents (0-1)" in reasons["q4"]
    assert "eval-rank takes rerank rows" in reasons["q5"]
    assert "field 'relevant' is required" in reasons["q6"]
    with pytest.raises(InputFileError, match="no row is a rerank row with a usable 'relevant'"):
        read_rank_golden(write(tmp_path / "none.jsonl", GOLDEN[2:]))


def test_a_rerank_run_is_scored_and_each_row_carries_its_measures(tmp_path: Path) -> None:
    src = write(tmp_path / "g.jsonl", GOLDEN)
    out = tmp_path / "g.scores.jsonl"
    result = run_eval_rank(src, out, Settings(), fake())
    assert result.exit_code == 3  # q3-q6 are row errors of the score run
    records = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert [r["index"] for r in records["q1"]["results"]][0] == 1 and records["q1"]["nDCG@10"] == 1.0
    assert records["q1"]["relevant"] == [1]  # passed through
    errors = [orjson.loads(line) for line in (tmp_path / "g.scores.errors.jsonl").read_bytes().splitlines()]
    assert sorted(e["id"] for e in errors) == ["q3", "q4", "q5", "q6"]
    saved = orjson.loads((tmp_path / "g.scores.eval.json").read_bytes())
    assert saved["measure_names"] == ["nDCG@10", "RR@10", "R@10"] and saved["row_counts"]["scored"] == 2
    assert saved["scoring"]["method"] == "bi-encoder cosine" and saved["model"] == "all-minilm-l6-v2"
    assert saved["measures"]["RR@10"] == pytest.approx((1.0 + records["q2"]["RR@10"]) / 2)
    assert set(saved["metrics_version"]) == {"ir-measures", "pytrec-eval-terrier"}
    jsonschema.Draft202012Validator(orjson.loads(SCHEMA.read_bytes())).validate(saved)
    typed = RankEvalReport.from_dict(saved)
    assert typed.measures == saved["measures"] and typed.row_counts.scored == 2
    with pytest.raises(InputFileError, match="OUT.eval.json of `bulkinfer eval-rank`"):
        load_report(tmp_path / "g.scores.eval.json")


def test_predictions_are_scored_without_a_model_and_bars_fail_with_exit_8(tmp_path: Path) -> None:
    src = write(tmp_path / "g.jsonl", GOLDEN[:2])
    ranked = [
        {"id": "q2", "results": [{"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.1}]},
        {"id": "other", "results": []},
        {"custom_id": "q1", "response": {"body": {"results": [{"index": 1, "relevance_score": 0.5}]}}},
    ]
    predictions = write(tmp_path / "ranked.jsonl", ranked)
    measures = parse_measures(["RR@10"])
    options = RankEvalOptions(
        predictions=predictions, measures=["RR@10"], fail_under=parse_rank_bars("MRR@10=0.9", measures)
    )
    result = run_eval_rank(src, tmp_path / "out.jsonl", Settings(), RunContext(), options)
    assert result.exit_code == EXIT_BELOW_BAR and result.below_bar == ["RR@10 0.7500 < 0.9"]
    assert result.report["measures"] == {"RR@10": 0.75} and result.report["scoring"] == "unknown"
    assert [
        r.get("id") or r.get("custom_id") for r in map(orjson.loads, (tmp_path / "out.jsonl").read_bytes().splitlines())
    ] == ["q2", "q1"]
    assert ranking_of(ranked[2]) == ("q1", [1]) and ranking_of({"id": "p", "score": 0.3}) is None


def test_bad_measures_and_bars_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="'nDCG@ten' is not an ir-measures measure"):
        parse_measures(["nDCG@ten"])
    measures = parse_measures(["nDCG@10"])
    with pytest.raises(ConfigError, match="outside 0-1 "):
        parse_rank_bars("nDCG@10=60", measures)
    with pytest.raises(ConfigError, match="a measure of --measure"):
        parse_rank_bars("R@10=0.5", measures)


def test_the_cli_prints_the_measures_and_exits_8_below_a_bar(tmp_path: Path) -> None:
    src = write(tmp_path / "g.jsonl", GOLDEN[:1])
    predictions = write(
        tmp_path / "p.jsonl",
        [{"id": "q1", "results": [{"index": 0, "relevance_score": 1.0}, {"index": 1, "relevance_score": 0.5}]}],
    )
    result = CliRunner().invoke(
        app,
        [
            "eval-rank",
            str(src),
            "--predictions",
            str(predictions),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--measure",
            "RR@10",
            "--fail-under",
            "RR@10=0.6",
        ],
    )
    assert result.exit_code == 8, result.output
    assert "RR@10        0.5000" in result.output and "below the bar: RR@10 0.5000 < 0.6" in result.output
    bad = CliRunner().invoke(app, ["eval-rank", str(src), "--measure", "bogus@@"])
    assert bad.exit_code == 2 and "not an ir-measures measure" in bad.output


def _rank_cli(*args: str) -> Any:
    result = CliRunner().invoke(app, ["eval-rank", *args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_a_relevant_key_that_is_not_ascii_digits_is_the_rows_invalid_field(tmp_path: Path) -> None:
    rows = [GOLDEN[0], {"id": "q6", "query": "x", "documents": ["a", "b"], "relevant": {"²": 1}}]
    golden = read_rank_golden(write(tmp_path / "g.jsonl", rows))
    assert list(golden.relevant) == ["q1"]
    assert [(r["line"], r["id"]) for r in golden.invalid] == [(2, "q6")]
    assert "field 'relevant': expected a non-empty list of document indices" in golden.invalid[0]["error"]


def test_a_duplicate_golden_id_is_invalid_and_the_first_row_wins(tmp_path: Path) -> None:
    rows = [GOLDEN[0], {**GOLDEN[0], "relevant": [0]}]
    golden = read_rank_golden(write(tmp_path / "g.jsonl", rows))
    assert golden.relevant == {"q1": {1: 1}}
    assert golden.invalid == [{"line": 2, "id": "q1", "error": "id 'q1' already appeared earlier in the file"}]


@pytest.mark.parametrize(
    ("measure", "message"),
    [
        ("P@0", "'P@0': the cutoff must be 1 or more"),
        ("nDCG@0", "'nDCG@0': the cutoff must be 1 or more"),
        ("ERR@10", "only gdeval: runs an external program, which bulkinfer does not"),
        ("nDCG@10.5", "is not an ir-measures measure"),
    ],
)
def test_measures_that_cannot_be_computed_here_exit_2_before_any_model_loads(
    tmp_path: Path, measure: str, message: str
) -> None:
    """pytrec_eval aborts the process on a cutoff of 0; ERR's one provider runs perl (gdeval)."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_measures([measure])
    src = write(tmp_path / "g.jsonl", GOLDEN[:1])
    result = _rank_cli(str(src), "--measure", measure, "--model", "no/such-model")
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl"]


def test_a_measure_given_twice_in_fail_under_exits_2_as_for_eval(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="RR@10 is given twice"):
        parse_rank_bars("MRR@10=0.5,RR@10=0.9", parse_measures(["RR@10"]))
    result = _rank_cli(str(write(tmp_path / "g.jsonl", GOLDEN[:1])), "--fail-under", "nDCG@10=0.5,nDCG@10=0.9")
    assert result.exit_code == 2 and "--fail-under: nDCG@10 is given twice" in result.output


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"[1,2]", "line 2: a JSON list, not an output record"),
        (b'{"id":"q1","results":[{"index":"0"}]}', "line 2: results[0]: expected an object with an integer 'index'"),
        (b'{"id":"q1","results":[{"index":3}]}', "line 2: index 3 is outside the documents (0-2) of golden row 'q1'"),
    ],
)
def test_a_mis_shaped_ranking_exits_4_naming_the_file_and_line(tmp_path: Path, line: bytes, message: str) -> None:
    predictions = tmp_path / "p.jsonl"
    predictions.write_bytes(b'{"id":"other","results":[]}\n' + line + b"\n")
    result = _rank_cli(str(write(tmp_path / "g.jsonl", GOLDEN[:1])), "--predictions", str(predictions))
    assert result.exit_code == 4 and f"predictions file {predictions}: {message}" in " ".join(result.output.split())


def test_predictions_scored_beside_invalid_golden_rows_exit_3_and_list_them(tmp_path: Path) -> None:
    src = write(tmp_path / "g.jsonl", [*GOLDEN[:1], GOLDEN[3]])
    ranked = write(tmp_path / "p.jsonl", [{"id": "q1", "results": [{"index": 1}]}])
    result = _rank_cli(str(src), "--predictions", str(ranked), "-o", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 3, result.output  # as when eval-rank runs the model and a row fails
    assert "1 invalid golden rows (not scored, listed in invalid_golden of OUT.eval.json): line 2 (q4)" in " ".join(
        result.output.split()
    )


def test_an_output_that_would_overwrite_the_predictions_exits_2(tmp_path: Path) -> None:
    ranked = write(tmp_path / "p.jsonl", [{"id": "q1", "results": [{"index": 1}]}])
    before = ranked.read_bytes()
    src = write(tmp_path / "g.jsonl", GOLDEN[:1])
    result = _rank_cli(str(src), "--predictions", str(ranked), "-o", str(ranked), "--overwrite")
    assert result.exit_code == 2 and "output would overwrite the predictions" in result.output
    assert ranked.read_bytes() == before


def test_a_parquet_golden_file_is_read_with_lists_and_maps_of_relevance(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": ["q1", "q2"],
            "query": ["a", "b"],
            "documents": [["x", "y"], ["x", "y"]],
            "relevant": pa.array([[(0, 1)], [(1, 2)]], type=pa.map_(pa.int32(), pa.int32())),
        }
    )
    pq.write_table(table, tmp_path / "g.parquet")
    pq.write_table(table.set_column(3, "relevant", pa.array([[0], [1]])), tmp_path / "l.parquet")
    assert read_rank_golden(tmp_path / "g.parquet").relevant == {"q1": {0: 1}, "q2": {1: 2}}
    assert read_rank_golden(tmp_path / "l.parquet").relevant == {"q1": {0: 1}, "q2": {1: 1}}


def test_scoring_an_output_again_with_other_measures_drops_the_earlier_ones(tmp_path: Path) -> None:
    src = write(tmp_path / "g.jsonl", GOLDEN[:2])
    ranked = [{"id": "q2", "results": [{"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.1}]}]
    predictions = write(tmp_path / "ranked.jsonl", ranked)
    scored = [tmp_path / "out.jsonl", tmp_path / "again.jsonl", tmp_path / "out.jsonl"]
    for measure, out, given in zip(("nDCG@10", "P@1", "R@10"), scored, (predictions, *scored[:2]), strict=True):
        options = RankEvalOptions(predictions=given, measures=[measure])  # then an eval-rank's OUT, scored again
        run_eval_rank(src, out, Settings(), RunContext(overwrite=True), options)
        (record,) = map(orjson.loads, out.read_bytes().splitlines())
        assert [k for k in record if "@" in k] == [measure]
