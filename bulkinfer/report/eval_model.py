"""The eval reports as types: ``OUT.eval.json`` of ``bulkinfer eval``
(:class:`EvalReport`) and of ``bulkinfer eval-rank`` (:class:`RankEvalReport`),
read as :mod:`bulkinfer.report.model` reads run reports (one ``report_version``,
defaults for keys an older bulkinfer did not write).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bulkinfer.metrics.text import METRICS
from bulkinfer.report.model import REPORT_VERSION, typed_report
from bulkinfer.report.typed_json import Where


@dataclass(frozen=True, slots=True)
class EvalRowCounts:
    """Golden rows (``golden``, invalid ones included), predictions with an id,
    and ``scored`` (both); the ids of the unmatched ones; the golden rows
    that cannot be scored (``invalid_golden``: ``line``, ``id``, ``error``
    each) and the prediction records not scored for their own shape
    (``unusable_predictions``: no id or no completion text;
    ``duplicate_predictions``: an id of an earlier record)."""

    scored: int
    golden: int | None = None
    predictions: int | None = None
    unmatched_golden: list[str] = field(default_factory=list)
    unmatched_predictions: list[str] = field(default_factory=list)
    invalid_golden: list[dict[str, Any]] = field(default_factory=list)
    unusable_predictions: int = 0
    duplicate_predictions: int = 0


@dataclass(frozen=True, slots=True)
class EvalReport:
    """``OUT.eval.json`` of ``bulkinfer eval``: corpus ``scores`` (each metric
    at top level, 0-100 except perplexity; ``signatures``; ``ci`` when
    resampled), row counts, what generated the predictions (``generation``)
    and where its run report (``run_report``) and scored rows (``output``)
    were written. ``seconds``: the eval's wall time."""

    golden: str
    output: str
    scores: dict[str, Any]
    signatures: dict[str, str] = field(metadata={"key": "scores.signatures"})
    row_counts: EvalRowCounts
    version: int = field(default=1, metadata={"key": "report_version"})
    predictions: str | None = None
    model: str | None = None
    model_path: str | None = None
    generation: dict[str, Any] | None = None
    run_report: str | None = None
    seconds: float | None = None
    row_set: dict[str, Any] | None = None  # count and ids_sha256 of the scored rows; None before they were recorded

    @classmethod
    def from_dict(cls, data: Any, source: str = "the eval report") -> EvalReport:
        """An eval report from its JSON object, version 1 or 2.

        Raises:
            InputFileError: as :meth:`RunReport.from_dict`; a metric of
                ``scores`` that is not a number, an interval of ``scores.ci``
                that is not two.
        """
        report = typed_report(cls, data, source, "OUT.eval.json")
        where = Where(source, "OUT.eval.json", "scores")
        for name in (*METRICS, "perplexity"):
            value = report.scores.get(name)
            if not (_number(value) or (value is None and name == "perplexity")):
                raise where.at(name).error("is missing" if name not in report.scores else f"is {value!r}, not a number")
        for name, interval in (report.scores.get("ci") or {}).items():
            if not (isinstance(interval, list) and len(interval) == 2 and all(map(_number, interval))):
                raise where.at(f"ci.{name}").error(f"is {interval!r}, not [low, high]")
        return report


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class RankEvalReport:
    """``OUT.eval.json`` of ``bulkinfer eval-rank``: ``measures`` (each
    ir-measures measure's mean over the scored queries, 0-1, by its name in
    ir-measures' notation), the scoring that produced the rankings
    (``scoring``: the score report's, or "unknown"), row counts and the
    library versions. ``seconds``: the eval's wall time."""

    golden: str
    output: str
    measures: dict[str, float]
    measure_names: list[str]
    row_counts: EvalRowCounts
    version: int = field(default=REPORT_VERSION, metadata={"key": "report_version"})
    predictions: str | None = None
    model: str | None = None
    model_path: str | None = None
    scoring: Any = None
    run_report: str | None = None
    seconds: float | None = None
    row_set: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any, source: str = "the ranking eval report") -> RankEvalReport:
        """A ranking eval report from its JSON object.

        Raises:
            InputFileError: as :meth:`RunReport.from_dict`.
        """
        return typed_report(cls, data, source, "OUT.eval.json of eval-rank")


def score_remarks(scores: dict[str, Any]) -> list[str]:
    """What an eval's ``scores`` say besides the numbers, one line each, for
    the terminal and the page: its warnings (``warning: ...``), notes
    (``note: ...``) and the rows whose perplexity could not be scored."""
    lines = [f"warning: {line}" for line in scores.get("warnings", [])]
    lines += [f"note: {line}" for line in scores.get("notes", [])]
    failed = scores.get("perplexity_failed")
    if failed:
        lines.append(f"perplexity: {failed} rows not scored (each record's perplexity_error says why)")
    return lines
