"""``bulkinfer eval-rank``: rerank a golden set of queries (or take an
existing ``bulkinfer score`` output) and score the rankings against the
documents known to be relevant, with ``ir-measures`` (``pytrec_eval``, the
C implementation of ``trec_eval``, behind it).

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
from bulkinfer.errors import EXIT_BELOW_BAR, EXIT_OK, ConfigError, InputFileError, OutputExistsError
from bulkinfer.fields import is_int
from bulkinfer.io.output_files import RunPaths
from bulkinfer.io.readers import RawRow, open_reader
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.eval import EvalResult, eval_path, generation_of, read_predictions, row_set, write_records
from bulkinfer.jobs.run import RunReport
from bulkinfer.jobs.score import score
from bulkinfer.prep.scores import parse_score_row
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


def parse_measures(names: Sequence[str]) -> list[Any]:
    """ir-measures' measure objects for ``names`` (``"nDCG@10"``, ``"MRR@10"``, ...).

    Raises:
        ConfigError: a name ir-measures does not parse (its message), or none given.
    """
    import ir_measures

    if not names:
        raise ConfigError("--measure: give at least one measure, e.g. nDCG@10")
    measures = []
    for name in names:
        try:
            measures.append(ir_measures.parse_measure(name))
        except (ValueError, NameError, TypeError, SyntaxError) as exc:
            raise ConfigError(
                f"--measure: {name!r} is not an ir-measures measure ({exc}); e.g. nDCG@10, RR@10, R@10"
            ) from None
    return measures


def parse_rank_bars(spec: str, measures: Sequence[Any]) -> dict[str, float]:
    """``"nDCG@10=0.5,RR@10=0.6"`` -> ``{"nDCG@10": 0.5, "RR@10": 0.6}``
    (bars on the 0-1 scale, each a measure of ``measures``, by its canonical name).

    Raises:
        ConfigError: bad syntax, a measure not among ``measures``, or a bar outside 0-1.
    """
    known = {str(m): str(m) for m in measures}
    bars: dict[str, float] = {}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        name, sep, raw = (part.strip() for part in item.partition("="))
        canonical = known.get(str(parse_measures([name])[0])) if sep and name else None
        if canonical is None:
            raise ConfigError(
                f"--fail-under: {item!r} is not MEASURE=BAR with a measure of --measure ({', '.join(known)})"
            )
        try:
            bar = float(raw)
        except ValueError:
            raise ConfigError(f"--fail-under: {item!r}: {raw!r} is not a number") from None
        if not 0.0 <= bar <= 1.0:
            raise ConfigError(f"--fail-under: {item!r}: ranking measures are on a 0-1 scale")
        bars[canonical] = bar
    if not bars:
        raise ConfigError(f"--fail-under: expected MEASURE=BAR[,...], got {spec!r}")
    return bars


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
    if isinstance(value, list) and value and all(is_int(k) for k in value):
        grades = dict.fromkeys(value, 1)
    elif isinstance(value, dict) and value and all(str(k).isdigit() and is_int(g) and g >= 0 for k, g in value.items()):
        grades = {int(k): int(g) for k, g in value.items()}
    else:
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


def read_rank_golden(path: Path) -> tuple[dict[str, dict[int, int]], list[dict[str, Any]]]:
    """Golden id -> relevant documents (index -> grade), in file order, and
    the rows that cannot be scored as ``{"line", "id", "error"}``.

    Raises:
        InputFileError: the file is missing or unreadable, or no row can be scored.
    """
    if not path.exists():
        raise InputFileError(f"golden file not found: {path}")
    golden: dict[str, dict[int, int]] = {}
    invalid: list[dict[str, Any]] = []
    for raw in open_reader(path):
        try:
            if raw.error is not None:
                raise raw.error
            row_id, grades = relevance_of(raw.data, raw.line)
        except RowInvalid as exc:
            invalid.append({"line": raw.line, "id": exc.row_id, "error": exc.message})
            continue
        golden.setdefault(row_id, grades)
    if not golden:
        raise InputFileError(
            f"golden file {path}: no row is a rerank row with a usable 'relevant' field "
            f"({len(invalid)} rows cannot be scored); see `bulkinfer eval-rank --help`"
        )
    return golden, invalid


def ranking_of(record: Mapping[str, Any]) -> tuple[str, list[int]] | None:
    """A score output record's id and ranked document indices: a rerank
    row's ``results``, or an OpenAI-style line's ``response.body.results``;
    None for any other record."""
    results = record.get("results")
    row_id = record.get("id")
    response = record.get("response")
    if results is None and isinstance(response, Mapping) and isinstance(response.get("body"), Mapping):
        results, row_id = response["body"].get("results"), record.get("custom_id")
    if not isinstance(results, list) or row_id is None:
        return None
    return str(row_id), [int(r["index"]) for r in results if isinstance(r, Mapping) and is_int(r.get("index"))]


def rank_measures(
    golden: Mapping[str, Mapping[int, int]], rankings: Mapping[str, list[int]], measures: Sequence[Any]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The mean of each measure over the ids of ``rankings`` (all in
    ``golden``), and each id's own values, by measure name, from
    ``ir_measures`` (qrels: ``golden``'s grades; run: each ranking in order,
    minus the position as the score)."""
    import ir_measures

    qrels = [ir_measures.Qrel(qid, str(k), grade) for qid in rankings for k, grade in golden[qid].items()]
    run = [
        ir_measures.ScoredDoc(qid, str(k), -float(pos))
        for qid, ranked in rankings.items()
        for pos, k in enumerate(ranked)
    ]
    per_query: dict[str, dict[str, float]] = {qid: {} for qid in rankings}
    for metric in ir_measures.iter_calc(measures, qrels, run):
        per_query[metric.query_id][str(metric.measure)] = float(metric.value)
    means = {str(m): sum(values.get(str(m), 0.0) for values in per_query.values()) / len(per_query) for m in measures}
    return means, per_query


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
    rows failed; a query whose row failed is not scored, and is counted).

    Raises:
        InputFileError: before any model loads, when no golden row can be
            scored; a missing or unreadable predictions file.
        ConfigError: a measure ir-measures does not know; no ranking matches a golden id.
        OutputExistsError: ``predictions`` given and ``OUT`` exists without overwrite.
        the errors of :func:`bulkinfer.jobs.score.score`.
    """
    started = time.monotonic()
    context = context or RunContext()
    measures = parse_measures(options.measures)
    relevant, invalid = read_rank_golden(golden)  # before any model loads
    paths = RunPaths.build(golden, out)
    scored: RunReport | None = None
    if options.predictions is None:
        scored = score(paths, settings, context, options.truncate, check_row=relevance_error)
    elif paths.output.exists() and not context.overwrite:
        raise OutputExistsError(f"output {paths.output} already exists; use --overwrite to replace it")
    predictions = options.predictions or out
    records = read_predictions(predictions)
    first: dict[str, int] = {}  # golden id -> index of its first ranking in records
    rankings: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        found = ranking_of(record)
        if found is not None and found[0] in relevant and found[0] not in first:
            first[found[0]], rankings[found[0]] = index, found[1]
    if not rankings:
        raise ConfigError(f"no ranking in {predictions} matches an id of {golden}")
    means, per_query = rank_measures(relevant, rankings, measures)
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
            "golden": len(relevant) + len(invalid),
            "scored": len(rankings),
            "unmatched_golden": sorted(set(relevant) - set(rankings)),
            "invalid_golden": invalid,
        },
        "row_set": row_set(list(rankings)),
        "fail_under": {"bars": dict(options.fail_under or {}), "below": below},
        "metrics_version": _versions(),
        "run_report": str(paths.report) if scored is not None else None,
        "seconds": time.monotonic() - started,
    }
    write_report(report, eval_path(out))
    run_code = scored.exit_code if scored is not None else EXIT_OK
    return EvalResult(report, EXIT_BELOW_BAR if below else run_code, below)


def _scoring_of(predictions: Path) -> Any:
    """The ``scoring`` of the score report beside ``predictions`` ("unknown" without one)."""
    import orjson

    from bulkinfer.io import formats

    try:
        return orjson.loads(formats.sibling(predictions, ".report.json").read_bytes()).get("scoring", "unknown")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return "unknown"


def _versions() -> dict[str, str]:
    """The versions of the libraries that computed the measures."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("ir-measures", "pytrec-eval-terrier"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found
