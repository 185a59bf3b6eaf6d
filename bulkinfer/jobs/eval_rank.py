"""``bulkinfer eval-rank``: rerank a golden set of queries (or take an
existing ``bulkinfer score`` output) and score the rankings against the
documents known to be relevant, with ``ir-measures`` (``pytrec_eval``, the
C implementation of ``trec_eval``, behind it; see :mod:`bulkinfer.metrics.ranking`).

Golden rows are ``bulkinfer score`` rerank rows (``id``, ``query``,
``documents``, optional ``top_n``) with ``relevant``: the 0-based indices
of the relevant documents (a list: relevance 1 each), or an object of index
-> graded relevance (an integer >= 0; nDCG uses the grades). A row without a
usable ``relevant`` is a row error in ``OUT.errors.jsonl`` and is not
scored by the model.

The run handed to ir-measures is each row's ``results`` in the output's
order (document ``index`` as the doc id, minus the position as its score),
so ties rank as the output lists them and a ``top_n`` cut leaves the
documents beyond it unretrieved. Measures are named in ir-measures'
notation (``nDCG@10``, ``RR@10`` (MRR: ``MRR@10`` is read as it), ``R@10``,
``P@5``, ``AP``, ...) and reported on ir-measures' 0-1 scale, the mean over
the scored queries; each scored output record gets its own values.

Files: ``OUT`` (the score output, or with ``--predictions`` the scored
records, each with its measures) and ``OUT.eval.json`` (``measures``, the
model and scoring method that produced the rankings, row counts, the
scored row set, ``fail_under``, library versions).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.errors import EXIT_BELOW_BAR, EXIT_OK, EXIT_PARTIAL, ConfigError, InputFileError, OutputExistsError
from bulkinfer.fields import is_int
from bulkinfer.io.output_files import RunPaths
from bulkinfer.io.predictions import check_apart, mis_shaped, read_predictions
from bulkinfer.io.readers import RawRow, open_reader
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.eval import EvalResult, eval_path, generation_of, row_set, scored_spool, without, write_records
from bulkinfer.jobs.run import RunReport
from bulkinfer.jobs.score import score
from bulkinfer.metrics.ranking import parse_measures, rank_measures, versions
from bulkinfer.prep.scores import SCORE_TEXT_COLUMNS, parse_score_row
from bulkinfer.report.stats import write_report
from bulkinfer.schema import RowInvalid

DEFAULT_MEASURES = ("nDCG@10", "RR@10", "R@10")


@dataclass(frozen=True, slots=True)
class RankEvalOptions:
    """What ``bulkinfer eval-rank`` does beyond scoring: ``predictions``
    (score this existing ``bulkinfer score`` output instead of running the
    model), ``measures`` (ir-measures names), ``fail_under`` (measure ->
    bar on the 0-1 scale: exit code 8 below it) and ``truncate`` (as
    ``bulkinfer score --truncate``)."""

    predictions: Path | None = None
    measures: Sequence[str] = DEFAULT_MEASURES
    fail_under: Mapping[str, float] | None = None
    truncate: bool = False


def relevance_of(data: Any, line: int) -> tuple[str, dict[int, int]]:
    """A golden row's id and its ``relevant`` documents as index -> grade.

    Raises:
        RowInvalid: the row is not a valid rerank row
            (:func:`bulkinfer.prep.scores.parse_score_row`; a pair row or
            an OpenAI line is not a ranking); ``relevant`` missing, empty,
            not a list of indices or an object of index -> grade, or an
            index outside ``documents``.
    """
    request = parse_score_row(data, 0, line)
    if request.openai_url is not None or (request.similarity or {}).get("shape") != "rerank":
        raise RowInvalid(
            "invalid_row",
            "eval-rank takes rerank rows (query, documents, relevant), not pairs or batch lines",
            request.id,
            request.openai_url is not None,
        )
    value = data.get("relevant")
    count = len(data["documents"])
    if value is None:
        raise RowInvalid(
            "missing_field", "field 'relevant' is required: the indices of the relevant documents", request.id
        )
    grades = _grades(value)
    if grades is None:
        raise RowInvalid(
            "invalid_field",
            "field 'relevant': expected a non-empty list of document indices, or an object of index -> "
            f"grade (an integer >= 0), got {value!r}"[:300],
            request.id,
        )
    outside = sorted(k for k in grades if not 0 <= k < count)
    if outside:
        raise RowInvalid(
            "invalid_field", f"field 'relevant': index {outside[0]} is outside documents (0-{count - 1})", request.id
        )
    return request.id, grades


def _grades(value: Any) -> dict[int, int] | None:
    """``relevant`` as document index -> grade: a non-empty list of integer
    indices (grade 1 each), or a non-empty object of index (ASCII digits, as
    JSON keys are strings) -> grade (an integer >= 0), or a Parquet map
    column's (index, grade) pairs; None for anything else."""
    if isinstance(value, list) and value and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        value = dict(value)  # a Parquet map<int, int>
    if isinstance(value, list):
        return dict.fromkeys(value, 1) if value and all(is_int(k) for k in value) else None
    if not isinstance(value, dict) or not value:
        return None
    grades = {}
    for key, grade in value.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit()  # not "²", which str.isdigit() accepts
        if not (digits or is_int(key)) or not is_int(grade) or grade < 0:
            return None
        grades[int(key)] = grade
    return grades


def relevance_error(raw: RawRow) -> RawRow:
    """``raw``, or an error row when it cannot be scored as a ranking (see
    :func:`relevance_of`): such a row is not sent to the model."""
    if raw.error is not None:
        return raw
    try:
        relevance_of(raw.data, raw.line)
    except RowInvalid as exc:
        return RawRow(raw.line, error=exc)
    return raw


@dataclass(frozen=True, slots=True)
class RankGolden:
    """A golden rerank set: ``relevant`` (id -> index -> grade, in file
    order), ``documents`` (id -> how many documents the row ranks) and
    ``invalid`` (the rows that cannot be scored, as ``{"line", "id", "error"}``)."""

    relevant: dict[str, dict[int, int]]
    documents: dict[str, int]
    invalid: list[dict[str, Any]]


def read_rank_golden(path: Path) -> RankGolden:
    """The :class:`RankGolden` of ``path`` (JSONL or Parquet). As ``score``
    fails them, the first usable row of an id is its row, later ones are
    invalid (``duplicate_id``).

    Raises:
        InputFileError: the file is missing or unreadable, or no row can be scored.
    """
    if not path.exists():
        raise InputFileError(f"golden file not found: {path}")
    golden = RankGolden({}, {}, [])
    for raw in open_reader(path, text_columns=SCORE_TEXT_COLUMNS):
        try:
            if raw.error is not None:
                raise raw.error
            row_id, grades = relevance_of(raw.data, raw.line)
            if row_id in golden.relevant:
                raise RowInvalid("duplicate_id", f"id '{row_id}' already appeared earlier in the file", row_id)
        except RowInvalid as exc:
            golden.invalid.append({"line": raw.line, "id": exc.row_id, "error": exc.message})
            continue
        golden.relevant[row_id], golden.documents[row_id] = grades, len(raw.data["documents"])
    if not golden.relevant:
        raise InputFileError(
            f"golden file {path}: no row is a rerank row with a usable 'relevant' field "
            f"({len(golden.invalid)} rows cannot be scored); see `bulkinfer eval-rank --help`"
        )
    return golden


def ranking_of(record: Mapping[str, Any]) -> tuple[str, list[int]] | None:
    """A score output record's id (an integer one as its decimal string)
    and ranked document indices: a rerank row's ``results``, or an
    OpenAI-style line's ``response.body.results``; None for any other record.

    Raises:
        ValueError: an entry of ``results`` is not an object with an integer ``index``.
    """
    results = record.get("results")
    row_id = record.get("id")
    response = record.get("response")
    if results is None and isinstance(response, Mapping) and isinstance(response.get("body"), Mapping):
        results, row_id = response["body"].get("results"), record.get("custom_id")
    if not isinstance(results, list) or not (isinstance(row_id, str) or is_int(row_id)):
        return None
    ranked: list[int] = []
    for k, entry in enumerate(results):
        index = entry.get("index") if isinstance(entry, Mapping) else None
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"results[{k}]: expected an object with an integer 'index', got {entry!r}"[:200])
        ranked.append(index)
    return str(row_id), ranked


def _rankings(golden: RankGolden, predictions: Path, records: list[dict[str, Any]]) -> dict[str, tuple[int, list[int]]]:
    """Golden id -> (index in ``records``, ranked document indices) of its first ranking.

    Raises:
        InputFileError: a ranking's ``results`` are mis-shaped, or one of a
            golden id ranks a document its golden row does not have (naming the line).
    """
    first: dict[str, tuple[int, list[int]]] = {}
    for index, record in enumerate(records):
        try:
            found = ranking_of(record)
        except ValueError as exc:
            raise mis_shaped(predictions, index, str(exc)) from None
        if found is None or found[0] not in golden.relevant or found[0] in first:
            continue
        count = golden.documents[found[0]]
        outside = [k for k in found[1] if not 0 <= k < count]
        if outside:
            what = f"index {outside[0]} is outside the documents (0-{count - 1}) of golden row {found[0]!r}"
            raise mis_shaped(predictions, index, what)
        first[found[0]] = index, found[1]
    return first


def run_eval_rank(
    golden: Path,
    out: Path,
    settings: Settings,
    context: RunContext | None = None,
    options: RankEvalOptions = RankEvalOptions(),
) -> EvalResult:
    """Rerank ``golden`` with ``bulkinfer score`` (unless
    ``options.predictions``), score the rankings, and write ``OUT`` and
    ``OUT.eval.json``. The exit code is :data:`EXIT_BELOW_BAR` when a measure
    is below its ``fail_under`` bar, else the score run's (0, or 3 when some
    rows failed; a query whose row failed is not scored, and is counted;
    with ``predictions``, 3 when some golden rows are invalid).

    Raises:
        InputFileError: before any model loads, when no golden row can be
            scored; a missing, unreadable or mis-shaped predictions file
            (naming the line; a ranking of a document its golden row lacks).
        ConfigError: a measure :func:`~bulkinfer.metrics.ranking.parse_measures`
            refuses; ``OUT`` or a file beside it is the predictions file; no
            ranking matches a golden id.
        OutputExistsError: ``predictions`` given and ``OUT`` exists without overwrite.
        the errors of :func:`bulkinfer.jobs.score.score`.
    """
    started = time.monotonic()
    context = context or RunContext()
    measures = parse_measures(options.measures)
    gold = read_rank_golden(golden)  # before any model loads
    paths = RunPaths.build(golden, out)
    check_apart(options.predictions, out, (eval_path(out), scored_spool(out)))
    scored: RunReport | None = None
    if options.predictions is None:
        scored = score(paths, settings, context, options.truncate, check_row=relevance_error)
    elif paths.output.exists() and not context.overwrite:
        raise OutputExistsError(f"output {paths.output} already exists; use --overwrite to replace it")
    predictions = options.predictions or out
    records = read_predictions(predictions)
    found = _rankings(gold, predictions, records)
    first = {row_id: index for row_id, (index, _) in found.items()}  # golden id -> index of its first ranking
    rankings = {row_id: ranked for row_id, (_, ranked) in found.items()}
    if not rankings:
        raise ConfigError(f"no ranking in {predictions} matches an id of {golden}")
    means, per_query = rank_measures(gold.relevant, rankings, measures)
    earlier = earlier_measures(eval_path(out)) | earlier_measures(eval_path(predictions))  # OUT's, or an eval's OUT
    records = without(records, earlier | set(means))
    for row_id, index in first.items():
        records[index] = {**records[index], **per_query[row_id]}
    if scored is None:  # OUT is what was scored; a score run's output keeps every row, for --resume
        records = [records[index] for index in sorted(first.values())]
    write_records(paths, records)
    below = [
        f"{name} {means[name]:.4f} < {bar:g}" for name, bar in (options.fail_under or {}).items() if means[name] < bar
    ]
    source = scored.report if scored is not None else None
    generation = (
        generation_of(predictions)
        if source is None
        else {"source": str(paths.report), **{k: source.get(k) for k in ("model", "model_path", "engine")}}
    )
    scoring = (source or {}).get("scoring") or _scoring_of(predictions)
    report = {
        "golden": str(golden),
        "predictions": str(predictions),
        "output": str(out),
        "model": generation.get("model"),
        "model_path": generation.get("model_path"),
        "generation": generation,
        "scoring": scoring,
        "measures": means,
        "measure_names": [str(m) for m in measures],
        "row_counts": {
            "golden": len(gold.relevant) + len(gold.invalid),
            "scored": len(rankings),
            "unmatched_golden": sorted(set(gold.relevant) - set(rankings)),
            "invalid_golden": gold.invalid,
        },
        "row_set": row_set(list(rankings)),
        "fail_under": {"bars": dict(options.fail_under or {}), "below": below},
        "metrics_version": versions(),
        "run_report": str(paths.report) if scored is not None else None,
        "seconds": time.monotonic() - started,
    }
    write_report(report, eval_path(out))
    run_code = scored.exit_code if scored is not None else EXIT_PARTIAL if gold.invalid else EXIT_OK
    return EvalResult(report, EXIT_BELOW_BAR if below else run_code, below)


def _scoring_of(predictions: Path) -> Any:
    """The ``scoring`` of the score report beside ``predictions`` ("unknown" without one)."""
    import orjson

    from bulkinfer.io import formats

    try:
        return orjson.loads(formats.sibling(predictions, ".report.json").read_bytes()).get("scoring", "unknown")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return "unknown"


def earlier_measures(saved: Path) -> set[str]:
    """The measures an earlier ``eval-rank`` wrote into the rows of its OUT
    (the ``measures`` of ``saved``, its ``OUT.eval.json``; none without
    one): gone from the rows scored again, with other measures."""
    import orjson

    try:
        measures = orjson.loads(saved.read_bytes()).get("measures")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return set()
    return set(measures) if isinstance(measures, dict) else set()
