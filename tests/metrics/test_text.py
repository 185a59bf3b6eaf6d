"""Tests of bulkinfer.metrics.text: every score is checked against sacrebleu and
rouge-score called directly on the same completions and references."""

from __future__ import annotations

import itertools
import json
import math
import random
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from rouge_score import rouge_scorer

from bulkinfer.errors import ConfigError
from bulkinfer.metrics.bars import FailUnderError, check_fail_under, compare, parse_fail_under
from bulkinfer.metrics.bootstrap import resample_indices
from bulkinfer.metrics.text import (
    METRICS,
    ROUGE_TYPES,
    InvalidReference,
    metrics_versions,
    non_latin_share,
    reference_streams,
    references_of,
    row_scores,
    score,
    score_rows,
)

GOLDEN = Path(__file__).resolve().parents[2] / "sample_data" / "golden.jsonl"
TOL = 1e-9


def _golden_references(n: int = 30, max_chars: int = 700) -> list[str]:
    """The first n references of the sample golden set, cut at a space before
    max_chars (pure-Python ROUGE-L is quadratic in length; keep the tests fast)."""
    with open(GOLDEN, encoding="utf-8") as f:
        refs = [json.loads(line)["reference"] for line in itertools.islice(f, n)]
    return [ref if len(ref) <= max_chars else ref[: ref.rindex(" ", 0, max_chars)] for ref in refs]


def _perturb(ref: str, i: int) -> str:
    """A deterministic stand-in for a model's completion of row i."""
    words = ref.split(" ")
    kind = i % 5
    if kind == 0:
        return " ".join(words[: len(words) // 2])  # first half (keeps the newlines inside)
    if kind == 1:
        random.Random(i).shuffle(words)
        return " ".join(words)
    if kind == 2:
        return " ".join(w for j, w in enumerate(words) if j % 4 != 1)  # every fourth word dropped
    if kind == 3 and "\n" in ref.strip():
        return "\n".join(reversed(ref.split("\n")))  # the same lines, in reverse order
    if kind == 3:
        return " ".join(words[len(words) // 2 :])  # last half
    return ref if i % 10 == 4 else ""  # an exact copy, or an empty completion


REFS = _golden_references()
PREDS = [_perturb(ref, i) for i, ref in enumerate(REFS)]
SINGLE = [[ref] for ref in REFS]
# Rows with 1, 2 or 3 references: the golden one, a perturbed one, and the next
# row's -- or, for i % 6 == 2, the completion itself with extra whitespace.
MULTI = [
    [ref, _perturb(ref, i + 2), f" {PREDS[i]}\n" if i % 6 == 2 else REFS[(i + 1) % len(REFS)]][: 1 + i % 3]
    for i, ref in enumerate(REFS)
]
DIRECT_SCORER = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)


def _direct_streams(refs: list[list[str]]) -> list[list[str | None]]:
    width = max(len(r) for r in refs)
    return [[r[k] if k < len(r) else None for r in refs] for k in range(width)]


def _direct_rouge_rows(preds: list[str], refs: list[list[str]]) -> dict[str, list[float]]:
    """Per-row F1 x 100 of each ROUGE type, best reference by that type's F1."""
    rows: dict[str, list[float]] = {t: [] for t in ROUGE_TYPES}
    for pred, row_refs in zip(preds, refs, strict=True):
        per_ref = [DIRECT_SCORER.score(ref, pred) for ref in row_refs]
        for t in ROUGE_TYPES:
            rows[t].append(100 * max(s[t].fmeasure for s in per_ref))
    return rows


@pytest.fixture(scope="module")
def single():
    return score(PREDS, SINGLE)


@pytest.fixture(scope="module")
def multi():
    return score(PREDS, MULTI)


@pytest.fixture(scope="module")
def direct_rouge_single():
    return _direct_rouge_rows(PREDS, SINGLE)


# --- equality with sacrebleu and rouge-score called directly ---------------------------------------


def test_sample_set_is_realistic() -> None:
    assert len(REFS) == 30
    assert sum("\n" in ref for ref in REFS) > 10
    assert PREDS.count("") == 3
    assert sum(p == r for p, r in zip(PREDS, REFS, strict=True)) == 3


def test_bleu_and_chrf_equal_sacrebleu_single_reference(single) -> None:
    direct_bleu = sacrebleu.corpus_bleu(PREDS, [REFS])
    direct_chrf = sacrebleu.corpus_chrf(PREDS, [REFS])
    assert single.bleu == pytest.approx(direct_bleu.score, abs=TOL)
    assert single.chrf == pytest.approx(direct_chrf.score, abs=TOL)
    assert 5 < single.bleu < 95 and 5 < single.chrf < 95
    assert single.signatures["bleu"] == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{sacrebleu.__version__}"
    assert single.signatures["chrf"] == f"nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:{sacrebleu.__version__}"


def test_rouge_equals_rouge_score_single_reference(single, direct_rouge_single) -> None:
    for t in ROUGE_TYPES:
        expected = sum(direct_rouge_single[t]) / len(PREDS)
        assert getattr(single, t) == pytest.approx(expected, abs=TOL), t
    # The reversed-lines rows keep every line: ROUGE-Lsum (sentences split on
    # newlines) sees that, ROUGE-L over one token sequence does not.
    assert single.rougeLsum > single.rougeL


def test_rouge_lsum_splits_on_newlines() -> None:
    ref = "The cat sat on the mat.\nIt was a sunny day.\nBirds were singing."
    pred = "Birds were singing.\nIt was a sunny day.\nThe cat sat on the mat."
    row = score([pred], [[ref]])
    direct = DIRECT_SCORER.score(ref, pred)
    assert row.rougeLsum == pytest.approx(100 * direct["rougeLsum"].fmeasure, abs=TOL)
    assert row.rougeLsum == pytest.approx(100.0, abs=TOL)
    assert row.rougeL < 60
    flat = score([pred.replace("\n", " ")], [[ref.replace("\n", " ")]])
    assert flat.rougeLsum == pytest.approx(flat.rougeL, abs=TOL)


def test_multi_reference_equals_direct(multi) -> None:
    assert {len(r) for r in MULTI} == {1, 2, 3}
    streams = _direct_streams(MULTI)
    direct_bleu = sacrebleu.metrics.BLEU()
    assert multi.bleu == pytest.approx(direct_bleu.corpus_score(PREDS, streams).score, abs=TOL)
    direct_chrf = sacrebleu.metrics.CHRF()
    assert multi.chrf == pytest.approx(direct_chrf.corpus_score(PREDS, streams).score, abs=TOL)
    assert multi.signatures["bleu"] == direct_bleu.get_signature().format()
    assert multi.signatures["bleu"].startswith("nrefs:var|")
    assert multi.signatures["chrf"].startswith("nrefs:var|")
    rouge = _direct_rouge_rows(PREDS, MULTI)
    for t in ROUGE_TYPES:
        assert getattr(multi, t) == pytest.approx(sum(rouge[t]) / len(PREDS), abs=TOL), t
    assert multi.rows == 30
    assert multi.references == sum(len(r) for r in MULTI) == 60


def test_multi_reference_same_count_and_more_refs_score_higher(single) -> None:
    refs = [[ref, _perturb(ref, i + 1)] for i, ref in enumerate(REFS)]
    got = score(PREDS, refs)
    assert got.bleu == pytest.approx(sacrebleu.corpus_bleu(PREDS, [[r[0] for r in refs], [r[1] for r in refs]]).score)
    assert got.signatures["bleu"].startswith("nrefs:2|")
    # Best-of-references ROUGE can only go up when a reference is added.
    for t in ROUGE_TYPES:
        assert getattr(got, t) >= getattr(single, t) - TOL


def test_variable_references_are_padded_with_none_not_empty_string() -> None:
    # A 4-word completion, references of 8 words and (for the second stream) none.
    pred = ["a b c d", "e f g h"]
    refs = [["a b c d x y z w"], ["e f g h", "e f g h"]]
    assert reference_streams(refs) == [["a b c d x y z w", "e f g h"], [None, "e f g h"]]
    got = score(pred, refs)
    with_none = sacrebleu.corpus_bleu(pred, [["a b c d x y z w", "e f g h"], [None, "e f g h"]])
    with_empty = sacrebleu.corpus_bleu(pred, [["a b c d x y z w", "e f g h"], ["", "e f g h"]])
    assert got.bleu == pytest.approx(with_none.score, abs=TOL)
    # '' is a real empty reference: its length 0 ties as the closest one and
    # cancels the brevity penalty, which None does not.
    assert with_empty.score == pytest.approx(100.0)
    assert got.bleu < 80


def test_empty_predictions() -> None:
    preds = [""] * len(REFS)
    got = score(preds, SINGLE)
    assert got.bleu == pytest.approx(sacrebleu.corpus_bleu(preds, [REFS]).score, abs=TOL) == 0.0
    assert got.chrf == pytest.approx(sacrebleu.corpus_chrf(preds, [REFS]).score, abs=TOL) == 0.0
    for t in (*ROUGE_TYPES, "exact_match"):
        assert getattr(got, t) == 0.0
    multi = score(preds, MULTI)
    assert multi.bleu == multi.chrf == multi.rougeL == 0.0


def test_empty_prediction_and_empty_reference_match_exactly() -> None:
    got = score(["", "  hello\n"], [[""], ["hello"]])
    assert got.exact_match == 100.0
    assert row_scores("", [""])["exact_match"] == 100.0


def test_exact_match(single, multi) -> None:
    assert single.exact_match == pytest.approx(100 * 3 / 30)
    # Rows 2, 8, 20 and 26 match only their third reference (14 is a copy anyway).
    assert multi.exact_match == pytest.approx(100 * 7 / 30)
    got = score(["  Paris \n", "paris", "Lyon"], [["Paris"], ["Paris"], ["Nice", " Lyon"]])
    assert got.exact_match == pytest.approx(200 / 3)


# --- per-row scores --------------------------------------------------------------------------------


def test_row_scores_equal_direct() -> None:
    for i in range(0, 30, 3):
        got = row_scores(PREDS[i], MULTI[i])
        assert got["bleu"] == pytest.approx(sacrebleu.sentence_bleu(PREDS[i], MULTI[i]).score, abs=TOL)
        best = max(DIRECT_SCORER.score(ref, PREDS[i])["rougeL"].fmeasure for ref in MULTI[i])
        assert got["rougeL"] == pytest.approx(100 * best, abs=TOL)
        assert got["exact_match"] == (100.0 if PREDS[i] in MULTI[i] else 0.0)
    assert row_scores("", ["The dog bit the man."]) == {"bleu": 0.0, "rougeL": 0.0, "exact_match": 0.0}
    same = row_scores("The dog bit the man.", ["A cat.", " The dog bit the man. "])
    assert same == {"bleu": pytest.approx(100.0), "rougeL": pytest.approx(100.0), "exact_match": 100.0}


def test_the_corpus_scores_from_given_rows_equal_those_computed_anew(multi) -> None:
    rows = score_rows(PREDS, MULTI)
    assert score(PREDS, MULTI, rows=rows) == multi
    assert score(PREDS, MULTI, bootstrap=50, rows=rows) == score(PREDS, MULTI, bootstrap=50)
    assert [{k: r[k] for k in ("bleu", "rougeL", "exact_match")} for r in rows] == [
        row_scores(p, r) for p, r in zip(PREDS, MULTI, strict=True)
    ]
    assert math.fsum(r["rouge2"] for r in rows) / len(rows) == pytest.approx(multi.rouge2)
    with pytest.raises(ValueError, match="29 rows of scores for 30 predictions"):
        score(PREDS, MULTI, rows=rows[:-1])
    with pytest.raises(ValueError, match="30 predictions but 29 rows of references"):
        score_rows(PREDS, MULTI[:-1])


@pytest.mark.parametrize("refs", ["just a string", [], [1]])
def test_row_scores_rejects_bad_references(refs) -> None:
    with pytest.raises(ValueError):
        row_scores("x", refs)


# --- known answers ---------------------------------------------------------------------------------

# sacrebleu's README, "Using SacreBLEU from Python" (https://github.com/mjpost/sacrebleu#using-sacrebleu-from-python):
#   bleu.corpus_score(sys, refs)
#   -> BLEU = 48.53 82.4/50.0/45.5/37.5 (BP = 0.943 ratio = 0.944 hyp_len = 17 ref_len = 18)
#   chrf.corpus_score(sys, refs) -> chrF2 = 59.73
# and "Variable Number of References": without the first reference of the
# first sentence -> BLEU = 29.44 with signature nrefs:var.
README_SYS = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
README_REFS = [
    ["The dog bit the man.", "The dog had bit the man."],
    ["It was not unexpected.", "No one was surprised."],
    ["The man bit him first.", "The man had bitten the dog."],
]


def test_known_answer_sacrebleu_readme() -> None:
    got = score(README_SYS, README_REFS)
    assert round(got.bleu, 2) == 48.53
    assert round(got.chrf, 2) == 59.73
    assert got.signatures["bleu"].startswith("nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_known_answer_sacrebleu_readme_variable_references() -> None:
    got = score(README_SYS, [README_REFS[0][1:], *README_REFS[1:]])
    assert round(got.bleu, 2) == 29.44
    assert got.signatures["bleu"].startswith("nrefs:var|")


# --- bootstrap -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def boot():
    return score(PREDS, SINGLE, bootstrap=200, seed=7)


def test_bootstrap_ci_contains_point_estimate(boot, single) -> None:
    assert boot.ci is not None and set(boot.ci) == set(METRICS)
    for name in METRICS:
        low, high = boot.ci[name]
        point = getattr(boot, name)
        assert point == getattr(single, name)
        assert low <= point <= high, name
        assert high - low > 1, name  # 30 varied rows: a real interval, not a point
    d = boot.to_dict()
    assert d["bootstrap"] == {"samples": 200, "seed": 7, "confidence": 95}
    assert d["ci"]["bleu"] == list(boot.ci["bleu"])


def test_bootstrap_is_reproducible(boot) -> None:
    assert score(PREDS, SINGLE, bootstrap=200, seed=7).ci == boot.ci
    assert score(PREDS, SINGLE, bootstrap=200, seed=8).ci != boot.ci
    assert score(PREDS[:10], SINGLE[:10], bootstrap=50, seed=7).ci != boot.ci


def test_bootstrap_recomputes_each_metric_on_the_resample(direct_rouge_single) -> None:
    # Brute force: sacrebleu's public corpus functions on each resampled corpus,
    # and the mean of rouge-score's per-row F1 over the resampled rows.
    n, seed = 10, 3
    got = score(PREDS, SINGLE, bootstrap=n, seed=seed)
    samples: dict[str, list[float]] = {name: [] for name in METRICS}
    exact = [100.0 if p.strip() == r.strip() else 0.0 for p, r in zip(PREDS, REFS, strict=True)]
    for idx in resample_indices(len(PREDS), n, seed):
        preds = [PREDS[i] for i in idx]
        refs = [REFS[i] for i in idx]
        samples["bleu"].append(sacrebleu.corpus_bleu(preds, [refs]).score)
        samples["chrf"].append(sacrebleu.corpus_chrf(preds, [refs]).score)
        for t in ROUGE_TYPES:
            samples[t].append(sum(direct_rouge_single[t][i] for i in idx) / len(idx))
        samples["exact_match"].append(sum(exact[i] for i in idx) / len(idx))
    assert got.ci is not None
    for name in METRICS:
        low, high = np.percentile(samples[name], [2.5, 97.5])
        assert got.ci[name] == pytest.approx((low, high), abs=TOL), name


def test_resample_indices_are_with_replacement_and_seeded() -> None:
    first = list(resample_indices(10, 3, seed=1))
    assert len(first) == 3 and all(len(idx) == 10 and 0 <= idx.min() and idx.max() < 10 for idx in first)
    assert any(len(set(idx.tolist())) < 10 for idx in first)
    assert all((a == b).all() for a, b in zip(first, resample_indices(10, 3, seed=1), strict=True))


def test_no_bootstrap_no_ci(single) -> None:
    assert single.ci is None and single.seed is None
    assert "ci" not in single.to_dict() and "bootstrap" not in single.to_dict()


# --- warnings and notes ----------------------------------------------------------------------------

ZH = ["今天天气很好，我们去公园散步吧。", "机器翻译的质量在过去十年里有了很大的提高。"]
RU = ["Сегодня хорошая погода, пойдём гулять в парк.", "Качество машинного перевода сильно выросло."]
FR = ["Le château était très élégant, à côté de la forêt.", "Où êtes-vous allé l'été dernier ?"]


@pytest.mark.parametrize("refs", [ZH, RU], ids=["chinese", "russian"])
def test_non_latin_warning(refs) -> None:
    got = score(refs, [[r] for r in refs])
    assert len(got.warnings) == 1
    assert "not Latin" in got.warnings[0] and "ROUGE" in got.warnings[0]
    assert got.rougeL == 0.0 and got.chrf == pytest.approx(100.0)  # identical texts, yet ROUGE 0


@pytest.mark.parametrize("refs", [REFS[:5], FR], ids=["english", "french"])
def test_no_non_latin_warning_for_latin_script(refs) -> None:
    assert score(refs, [[r] for r in refs]).warnings == ()


def test_non_latin_share() -> None:
    assert non_latin_share(["abc"]) == 0.0
    assert non_latin_share(["", "123 !?"]) == 0.0
    assert non_latin_share(["ab", "жж"]) == 0.5
    assert non_latin_share(["élan"]) == 0.0


def test_tokenizer_note(single) -> None:
    assert any("ASCII letters and digits" in note for note in single.notes)
    assert single.to_dict()["notes"] == list(single.notes)


def test_to_dict_is_json_ready(multi) -> None:
    d = json.loads(json.dumps(multi.to_dict()))
    assert [k for k in d if k in METRICS] == list(METRICS)
    assert d["rows"] == 30 and d["references"] == 60
    assert d["signatures"]["bleu"].startswith("nrefs:var|")


# --- input validation ------------------------------------------------------------------------------


def test_references_of() -> None:
    assert references_of("a") == ["a"]
    assert references_of(["a", "b"]) == ["a", "b"]
    assert references_of(["", "b"]) == ["", "b"]


@pytest.mark.parametrize(
    ("value", "type_", "text"),
    [
        (None, "missing_field", "needs a 'reference'"),
        ([], "invalid_field", "non-empty list"),
        (42, "invalid_field", "got 42"),
        (["a", None], "invalid_field", "'reference[1]': expected a string, got None"),
        ({"text": "a"}, "invalid_field", "expected a string or a non-empty list of strings"),
    ],
)
def test_references_of_rejects(value, type_, text) -> None:
    with pytest.raises(InvalidReference) as info:
        references_of(value)
    assert isinstance(info.value, ValueError)
    assert info.value.type == type_
    assert text in str(info.value)


@pytest.mark.parametrize(
    ("preds", "refs", "text"),
    [
        ([], [], "no rows"),
        (["a"], [["a"], ["b"]], "1 predictions but 2 rows"),
        (["a"], ["a"], "row 0: references must be a list"),
        (["a", "b"], [["a"], []], "row 1: no references"),
        ([None], [["a"]], "row 0: prediction must be a string"),
    ],
)
def test_score_rejects(preds, refs, text) -> None:
    with pytest.raises(ValueError, match=text):
        score(preds, refs)


def test_score_rejects_negative_bootstrap() -> None:
    with pytest.raises(ValueError, match="bootstrap"):
        score(["a"], [["a"]], bootstrap=-1)


# --- --fail-under and --compare --------------------------------------------------------------------


def test_parse_fail_under() -> None:
    assert parse_fail_under("bleu=20,rougeL=30") == {"bleu": 20.0, "rougeL": 30.0}
    assert parse_fail_under(" chrf = 45.5 , exact_match=0 ") == {"chrf": 45.5, "exact_match": 0.0}


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ("", "expected METRIC=BAR"),
        ("bleu", "not METRIC=BAR"),
        ("rouge=20", "unknown metric 'rouge'"),
        ("ROUGEL=20", "unknown metric"),
        ("bleu=twenty", "not a number"),
        ("bleu=nan", "outside 0-100 "),
        ("bleu=120", "outside 0-100"),
        ("bleu=20,bleu=30", "given twice"),
    ],
)
def test_parse_fail_under_rejects(spec, text) -> None:
    with pytest.raises(FailUnderError, match=text) as info:
        parse_fail_under(spec)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)


def test_check_fail_under(single) -> None:
    scores = single.to_dict()
    assert check_fail_under(scores, {"bleu": 0.0, "rougeL": 1.0}) == []
    failures = check_fail_under(scores, {"bleu": 99.0, "chrf": 1.0, "rougeL": 99.5})
    assert failures == [f"bleu {scores['bleu']:.2f} < 99", f"rougeL {scores['rougeL']:.2f} < 99.5"]
    assert check_fail_under({"bleu": 20.0}, {"bleu": 20.0}) == []  # at the bar passes
    assert check_fail_under({"bleu": 19.999}, {"bleu": 20.0}) == ["bleu 19.999 < 20"]
    with pytest.raises(ValueError, match="no chrf score"):
        check_fail_under({"bleu": 20.0}, {"chrf": 10.0})


def test_compare(single, multi) -> None:
    changes = compare(multi.to_dict(), single.to_dict())
    assert [c[0] for c in changes] == list(METRICS)
    for name, prev, cur, delta in changes:
        assert prev == getattr(single, name) and cur == getattr(multi, name)
        assert delta == pytest.approx(cur - prev)
    assert compare({"bleu": 30.0, "chrf": 50.0}, {"bleu": 25.0}) == [
        ("bleu", 25.0, 30.0, 5.0),
        ("chrf", None, 50.0, None),
    ]
    assert compare({"bleu": 30.0, "perplexity": 3.7}, {"bleu": 30.0, "perplexity": 10.0})[-1] == pytest.approx(
        ("perplexity", 10.0, 3.7, -6.3)
    )
    with pytest.raises(ValueError, match="none of the metrics"):
        compare({"bleu": 30.0}, {"rows": 3})


def test_metrics_versions() -> None:
    assert metrics_versions() == {
        "sacrebleu": metadata.version("sacrebleu"),
        "rouge-score": metadata.version("rouge-score"),
        "numpy": metadata.version("numpy"),
    }
    assert metrics_versions()["sacrebleu"] == sacrebleu.__version__
