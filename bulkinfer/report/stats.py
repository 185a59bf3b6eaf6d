"""The run report: ``OUT.report.json`` and the summary table on the terminal.

Throughput is tokens (or requests) divided by ``seconds.generate``, the wall
time from the first request handed to the engine to the last result;
``throughput_end_to_end`` divides by ``seconds.total`` (model load included).
``seconds.plan`` and ``seconds.write`` are time the driver spent reading and
tokenizing, and writing; after the first window they overlap generation,
because the engine computes in its own process meanwhile.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table


def rate(amount: float, seconds: float) -> float:
    """amount / seconds, 0.0 for a zero interval."""
    return amount / seconds if seconds > 0 else 0.0


def throughput(requests: int, prompt_tokens: int, completion_tokens: int, seconds: float) -> dict[str, float]:
    """Requests/s and tokens/s over ``seconds``."""
    return {
        "requests_per_s": rate(requests, seconds),
        "prompt_tokens_per_s": rate(prompt_tokens, seconds),
        "completion_tokens_per_s": rate(completion_tokens, seconds),
        "total_tokens_per_s": rate(prompt_tokens + completion_tokens, seconds),
    }


def peak_rss_bytes() -> dict[str, int]:
    """Peak resident set size in bytes of this process and of its largest
    finished child (the engine's worker processes, once shut down)."""
    return {
        "bulkinfer": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write ``report`` as indented JSON, atomically (:func:`bulkinfer.io.files.atomic_write`).

    Raises:
        OSError: the file cannot be written (no temporary file is left).
    """
    from bulkinfer.io.files import atomic_write

    atomic_write(path, orjson.dumps(report, option=orjson.OPT_INDENT_2, default=str))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_summary(report: dict[str, Any], console: Console) -> None:
    """The report as rich tables: counts, time by phase, throughput, buckets."""
    counts = report["request_counts"]
    seconds = report["seconds"]
    tput = report["throughput"]
    summary = Table(title=f"bulkinfer run: {report['input']}", show_header=False)
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    summary.add_row("model", str(report["model"]))
    if "chat_template_applied" in report:
        summary.add_row("prompt rows", "through the chat template" if report["chat_template_applied"] else "sent raw")
    summary.add_row("rows", f"{counts['total']} ({counts['completed']} completed, {counts['failed']} failed)")
    summary.add_row("tokens", f"{report['tokens']['prompt']} prompt, {report['tokens']['completion']} completion")
    summary.add_row(
        "seconds",
        ", ".join(f"{k} {seconds[k]:.1f}" for k in ("load", "plan", "generate", "write", "total")),
    )
    summary.add_row(
        "throughput",
        f"{tput['requests_per_s']:.2f} req/s, {tput['completion_tokens_per_s']:.1f} completion tok/s, "
        f"{tput['total_tokens_per_s']:.1f} total tok/s",
    )
    pad = report["padding_efficiency"]
    summary.add_row(
        f"padding efficiency (static B={pad['batch_size']})",
        f"arrival {_pct(pad['arrival'])}, sorted {_pct(pad['sorted'])}",
    )
    summary.add_row("output", str(report["output"]))
    if counts["failed"]:
        summary.add_row("errors", str(report["errors"]))
    console.print(summary)
    buckets = Table(title="buckets (prompt tokens)")
    for name in ("range", "rows", "real tokens", "padded tokens", "padding efficiency"):
        buckets.add_column(name, justify="right")
    for b in report["buckets"]:
        buckets.add_row(
            b["range"], str(b["rows"]), str(b["real_tokens"]), str(b["padded_tokens"]), _pct(b["padding_efficiency"])
        )
    console.print(buckets)
