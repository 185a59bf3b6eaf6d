"""How an eval's scores are shown: the terminal table (:func:`print_eval`)
and the HTML report (:func:`write_eval_html`), from a saved ``OUT.eval.json``
(see :mod:`bulkinfer.jobs.eval` for its keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bulkinfer.engine.log import terminal
from bulkinfer.metrics import bars
from bulkinfer.metrics import text as evaluate
from bulkinfer.report.eval_model import EvalReport, EvalRowCounts, score_remarks

UNKNOWN = "unknown"


def row_set_warnings(ours: dict[str, Any] | None, previous: dict[str, Any]) -> list[str]:
    """Why comparing an eval that scored the rows ``ours`` (its ``row_set``)
    with ``previous`` (a saved ``.eval.json``) may mislead: the two scored
    different rows, or ``previous`` does not say which rows it scored. Empty
    when both scored the same ids."""
    theirs = previous.get("row_set")
    if not isinstance(theirs, dict):
        return ["the previous eval does not record which rows it scored: the changes may compare different rows"]
    if ours == theirs:
        return []
    if ours and ours.get("count") != theirs.get("count"):
        return [
            f"the two evals scored different rows ({ours['count']} here, {theirs.get('count')} before): "
            "the changes compare different row sets"
        ]
    return ["the two evals scored different rows (same count, different ids): the changes compare different row sets"]


def describe_generation(generation: dict[str, Any]) -> str:
    """The model and sampling settings that produced the predictions, in a line."""
    if generation.get("source") is None:
        return "unknown (no run report beside the predictions)"
    sampling = generation.get("sampling")
    shown = (
        ", ".join(f"{key} {sampling[key]}" for key in ("temperature", "top_p", "max_tokens") if key in sampling)
        if isinstance(sampling, dict)
        else f"sampling {UNKNOWN}"
    )
    own = generation.get("sampling_set_by_rows")
    if isinstance(own, dict) and own:
        shown += "; rows set their own " + ", ".join(f"{name} ({rows} rows)" for name, rows in own.items())
    return f"{generation.get('model')}, {shown} (from {generation['source']})"


def write_eval_html(
    report: dict[str, Any], run_report: dict[str, Any], records: list[dict[str, Any]], path: Path
) -> None:
    """HTML: the eval's scores and per-row distributions, after the run's charts
    when this eval generated. A failure to draw it never fails the eval.

    Raises:
        OSError: the page cannot be written, as any file of the eval.
    """
    from bulkinfer.report.html import eval_sections, run_sections, write_html

    try:
        sections = [
            *eval_sections(report, evaluate.METRICS, records),
            *(run_sections(run_report) if "seconds" in run_report else []),
        ]
    except Exception as exc:
        print(f"bulkinfer: warning: HTML report not drawn: {type(exc).__name__}: {exc}", file=terminal())
        return
    write_html(f"bulkinfer eval: {report['golden']}", sections, path)


def invalid_golden_line(invalid: list[dict[str, Any]]) -> str:
    """The terminal line for golden rows that cannot be scored (``row_counts.invalid_golden``)."""
    shown = "; ".join(f"line {row['line']} ({row['id']}): {row['error']}" for row in invalid[:5])
    more = f"; and {len(invalid) - 5} more" if len(invalid) > 5 else ""
    return f"{len(invalid)} invalid golden rows (not scored, listed in invalid_golden of OUT.eval.json): {shown}{more}"


def not_scored(counts: EvalRowCounts) -> list[str]:
    """The terminal lines for golden rows and prediction records not scored
    for their own shape (an eval's, and ``bulkinfer report`` of its ``.eval.json``)."""
    lines = [invalid_golden_line(counts.invalid_golden)] if counts.invalid_golden else []
    for count, what in (
        (counts.unusable_predictions, "without an id or a completion text"),
        (counts.duplicate_predictions, "of an id an earlier record has"),
    ):
        if count:
            lines.append(f"{count} prediction records {what} (not scored)")
    return lines


def print_eval(report: EvalReport | dict[str, Any], previous: dict[str, Any] | None, console: Any) -> None:
    """The corpus scores as a rich table, with 95% intervals when resampled and
    the change against ``previous`` (a saved ``.eval.json``) when given.

    Raises:
        InputFileError: ``report`` (a dict) is no eval report.
    """
    from rich.table import Table

    typed = report if isinstance(report, EvalReport) else EvalReport.from_dict(report)
    scores = typed.scores
    ci = scores.get("ci") or {}
    changes = {}
    if previous is not None:
        changes = {name: delta for name, _, _, delta in bars.compare(scores, previous.get("scores", previous))}
    title = f"bulkinfer eval: {typed.golden} ({typed.row_counts.scored} rows scored)"
    table = Table(title=title, min_width=min(len(title), console.width))  # the title on one line where it fits
    table.add_column("metric")
    table.add_column("score", justify="right")
    if ci:
        table.add_column("95% interval", justify="right")
    if previous is not None:
        table.add_column("change", justify="right")
    names = [*evaluate.METRICS, *(["perplexity"] if scores.get("perplexity") is not None else [])]
    for name in names:
        cells = [name, f"{scores[name]:.2f}"]
        if ci:
            low_high = ci.get(name)
            cells.append(f"{low_high[0]:.2f} - {low_high[1]:.2f}" if low_high else "")
        if previous is not None:
            delta = changes.get(name)
            cells.append(f"{delta:+.2f}" if delta is not None else "n/a")
        table.add_row(*cells)
    console.print(table)
    for name, signature in typed.signatures.items():
        console.print(f"{name} signature: {signature}", markup=False)
    for line in score_remarks(scores):
        console.print(line, markup=False)
    for ids, what in (
        (typed.row_counts.unmatched_golden, "golden rows without a prediction"),
        (typed.row_counts.unmatched_predictions, "predictions without a golden row"),
    ):
        if ids:
            console.print(f"{len(ids)} {what} (not scored): {', '.join(ids[:10])}", markup=False)
    for line in not_scored(typed.row_counts):
        console.print(line, markup=False)
    if typed.generation:
        console.print(f"predictions generated by: {describe_generation(typed.generation)}", markup=False)
    if previous is not None:
        for warning in row_set_warnings(typed.row_set, previous):
            console.print(f"warning: {warning}", markup=False)
