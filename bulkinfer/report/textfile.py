"""A command's outcome as a Prometheus text file, for node_exporter's
textfile collector: a cron job's last run, watched like any other target.

Format: the Prometheus text exposition format
(https://prometheus.io/docs/instrumenting/exposition_formats/), written by
``prometheus_client.write_to_textfile`` (a temporary file beside it, then a
rename: the collector never reads half a file). The node_exporter reads
every ``*.prom`` file of its ``--collector.textfile.directory``
(https://github.com/prometheus/node_exporter#textfile-collector); the
Prometheus documentation on batch jobs asks for the time of the last
success (https://prometheus.io/docs/practices/instrumentation/#batch-jobs).

Every metric is a gauge labelled with the ``command`` (``run``, ``embed``,
``score``, ``eval``, ``eval-rank``), its ``input`` (the path as given,
absolute; ``-`` for standard input) and the ``textfile``'s own name, unique
in the collector's directory: two jobs' files never give it the same series
(which would fail its scrape), even two jobs on standard input. One file per
job: a file is replaced whole, and only its own job's complete time is
carried over.

- ``bulkinfer_last_run_exit_code``: 0 every row completed, 3 some failed,
  ... (``bulkinfer run --help``; 1 an unexpected error).
- ``bulkinfer_last_run_start_timestamp_seconds``,
  ``bulkinfer_last_run_end_timestamp_seconds``: Unix time.
- ``bulkinfer_last_run_complete_timestamp_seconds``: the end of the last
  command that gave every row its record (exit 0 or 3; ``eval`` also 8, a
  score under its bar), carried over from the file's earlier contents when
  this one did not; absent until one has. An alert on its age catches a job
  that failed, hung or never ran.
- From the report, when the command got that far: ``..._rows{state}``
  (completed, failed, skipped; ``eval``: scored), ``..._tokens{kind}``
  (prompt, completion), ``..._seconds{phase}`` (load, plan, generate,
  write, total), ``..._completion_tokens_per_second`` (over generation),
  ``..._eval_score{metric}`` (``eval``: BLEU, chrF, ROUGE, exact match,
  perplexity as the eval report has them; ``eval-rank``: its measures), and
  ``bulkinfer_last_run_info{model}`` = 1.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkinfer.metrics.text import METRICS

log = logging.getLogger(__name__)

PREFIX = "bulkinfer_last_run_"
COMPLETE = PREFIX + "complete_timestamp_seconds"
# Exit codes after which every row has its record (bulkinfer.errors: EXIT_OK, EXIT_PARTIAL, EXIT_BELOW_BAR).
COMPLETE_CODES = frozenset({0, 3, 8})
PHASES = ("load", "plan", "generate", "write", "total")


@dataclass(slots=True)
class Outcome:
    """What a command did: ``command`` and ``input`` (the labels), the
    ``exit_code``, its start and end (Unix time, seconds) and its ``report``
    (the report.json or eval.json contents; None when it stopped before one)."""

    command: str
    input: str
    started: float
    ended: float
    exit_code: int
    report: dict[str, Any] | None = None


def write_textfile(path: Path, outcome: Outcome) -> None:
    """Replace ``path`` with ``outcome``'s metrics (see the module).

    Raises:
        OSError: ``path`` cannot be written (its earlier contents are kept).
    """
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    labels = {"command": outcome.command, "input": outcome.input, "textfile": path.name}
    complete = outcome.ended if outcome.exit_code in COMPLETE_CODES else _earlier_complete(path, labels)
    samples = [
        ("exit_code", "Exit code of the command's last run (bulkinfer run --help)", outcome.exit_code, {}),
        ("start_timestamp_seconds", "When the command's last run started, Unix time", outcome.started, {}),
        ("end_timestamp_seconds", "When the command's last run ended, Unix time", outcome.ended, {}),
        *(
            [("complete_timestamp_seconds", "End of the last run that gave every row its record", complete, {})]
            if complete is not None
            else []
        ),
        *_from_report(outcome.report or {}),
    ]
    registry = CollectorRegistry(auto_describe=True)
    gauges: dict[str, Gauge] = {}
    for name, doc, value, extra in samples:
        if not math.isfinite(value):
            continue
        if name not in gauges:
            gauges[name] = Gauge(PREFIX + name, doc, [*labels, *extra], registry=registry)
        gauges[name].labels(**labels, **extra).set(value)
    write_to_textfile(str(path), registry)


def _from_report(report: dict[str, Any]) -> list[tuple[str, str, float, dict[str, str]]]:
    """(name, help, value, extra labels) of a run's or an eval's report."""
    out: list[tuple[str, str, float, dict[str, str]]] = []
    if isinstance(report.get("model"), str):
        out.append(("info", "The last run's model", 1, {"model": report["model"]}))
    counts = report.get("request_counts") or {}
    for state in ("completed", "failed", "skipped"):
        if isinstance(counts.get(state), int):
            out.append(("rows", "Rows of the last run's output and errors files", counts[state], {"state": state}))
    scored = (report.get("row_counts") or {}).get("scored")
    if isinstance(scored, int):
        out.append(("rows", "Rows of the last run's output and errors files", scored, {"state": "scored"}))
    tokens = report.get("tokens") or {}
    for kind in ("prompt", "completion"):
        if isinstance(tokens.get(kind), int):
            out.append(("tokens", "Tokens of the last run's completed rows", tokens[kind], {"kind": kind}))
    seconds = report.get("seconds")
    if isinstance(seconds, dict):
        for phase in PHASES:
            if isinstance(seconds.get(phase), int | float):
                out.append(("seconds", "Seconds the last run spent by phase", seconds[phase], {"phase": phase}))
    elif isinstance(seconds, int | float):
        out.append(("seconds", "Seconds the last run spent by phase", seconds, {"phase": "total"}))
    rate = (report.get("throughput") or {}).get("completion_tokens_per_s")
    if isinstance(rate, int | float):
        out.append(("completion_tokens_per_second", "Completion tokens per second of generation", rate, {}))
    scores = report.get("scores") or {}
    named = {name: scores.get(name) for name in (*METRICS, "perplexity")}
    for metric, value in {**named, **(report.get("measures") or {})}.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append(("eval_score", "The last eval's corpus scores", value, {"metric": metric}))
    return out


def _earlier_complete(path: Path, labels: dict[str, str]) -> float | None:
    """The complete time ``path`` held for these labels, or None (no file, another job's, unreadable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = path.read_text(encoding="utf-8")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == COMPLETE and sample.labels == labels:
                    return float(sample.value)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("bulkinfer: %s: its earlier complete time cannot be read (%s); written without it", path, exc)
    return None
