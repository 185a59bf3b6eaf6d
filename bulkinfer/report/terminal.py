"""What the terminal shows at the end of a command: the run summary, the
plan, the eval scores (rich tables on the console given)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bulkinfer.report.calibration import describe
from bulkinfer.report.units import format_bytes


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_summary(report: dict[str, Any], console: Console) -> None:
    """The report as rich tables: counts, time by phase, throughput, buckets."""
    counts = report["request_counts"]
    seconds = report["seconds"]
    tput = report["throughput"]
    summary = Table(title=f"bulkinfer {report.get('job', 'run')}: {report['input']}", show_header=False)
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
    embedding = report.get("embedding")
    if embedding:
        summary.add_row(
            "embedding",
            f"max_seq_length {embedding['max_seq_length']}, normalize {embedding['normalize']}, "
            f"{embedding['truncated_inputs']} inputs truncated",
        )
        summary.add_row(
            "throughput", f"{tput['requests_per_s']:.2f} rows/s, {tput['prompt_tokens_per_s']:.1f} prompt tok/s"
        )
    else:
        summary.add_row(
            "throughput",
            f"{tput['requests_per_s']:.2f} req/s, {tput['completion_tokens_per_s']:.1f} completion tok/s, "
            f"{tput['total_tokens_per_s']:.1f} total tok/s",
        )
    e2e = report.get("throughput_end_to_end")
    if e2e and embedding:
        summary.add_row(
            "end to end (load included)",
            f"{e2e['requests_per_s']:.2f} rows/s, {e2e['prompt_tokens_per_s']:.1f} prompt tok/s",
        )
    elif e2e:
        summary.add_row(
            "end to end (load included)",
            f"{e2e['requests_per_s']:.2f} req/s, {e2e['completion_tokens_per_s']:.1f} completion tok/s",
        )
    reasons = report.get("finish_reasons")
    if reasons:
        summary.add_row("finish_reason", ", ".join(f"{reason} {n}" for reason, n in reasons.items()))
    structured = report.get("structured_outputs")
    if structured:
        for kind, c in structured["by_kind"].items():
            checked = c["completions"] - c["unchecked"]
            summary.add_row(
                f"structured ({kind}, {structured['backend']})",
                f"{c['valid']}/{checked} valid, {c['cut_at_max_tokens']} cut at max_tokens, {c['invalid']} invalid"
                + (f", {c['unchecked']} not checked" if c["unchecked"] else ""),
            )
    _passthrough_row(summary, report.get("passthrough_fields"))
    engine = report.get("engine") or {}
    if engine.get("replicas"):
        rows = "/".join(str(r["rows"]) for r in engine["replicas"])
        busy = "/".join(f"{r['busy_seconds']:.1f}" for r in engine["replicas"])
        balance = engine.get("replica_balance")
        deaths = sum(r.get("deaths", 0) for r in engine["replicas"])
        moved = sum(r.get("requeued", 0) for r in engine["replicas"])
        summary.add_row(
            f"replicas ({len(engine['replicas'])})",
            f"rows {rows}, busy {busy} s"
            + (f", balance {balance:.2f}" if balance else "")
            + (f"; {deaths} died, {moved} requests moved" if deaths else ""),
        )
    chosen = (report.get("engine_choice") or {}).get("dtype")
    if chosen:
        summary.add_row("dtype", f"{chosen['dtype']}: {chosen['why']}")
    rss = report.get("peak_rss_bytes") or {}
    if "bulkinfer" in rss:
        engine = f", engine {format_bytes(rss['children'])}" if rss.get("children") else ""
        summary.add_row("peak memory (RSS)", f"bulkinfer {format_bytes(rss['bulkinfer'])}{engine}")
    cache = report.get("prefix_cache")
    if cache and cache["prompt_tokens"]:
        fed = "prefix-aware feed" if (report.get("plan") or {}).get("prefix_aware") else "plain feed"
        summary.add_row(
            "prefix cache hits",
            f"{_pct(cache['hit_rate'])} of prompt tokens ({cache['cached_tokens']}; {fed})",
        )
    pad = report["padding_efficiency"]
    summary.add_row(
        f"padding if batched statically (B={pad['batch_size']})",
        f"arrival {_pct(pad['arrival'])}, sorted {_pct(pad['sorted'])}; vLLM does not pad",
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


def _passthrough_row(summary: Any, fields: list[dict[str, Any]] | None) -> None:
    """The pass-through fields of bulkinfer rows with their row counts; a
    near miss of a field bulkinfer reads is flagged (it is copied, not read)."""
    if not fields:
        return
    shown = [
        f"{f['name']} {f['rows']}"
        + (f" (did you mean {f['did_you_mean']}? copied, not read)" if f["did_you_mean"] else "")
        for f in fields[:12]
    ]
    more = f", and {len(fields) - 12} more" if len(fields) > 12 else ""
    summary.add_row("pass-through fields (rows)", Text(", ".join(shown) + more))


def print_plan(plan: dict[str, Any], console: Any) -> None:
    """The plan as rich tables."""
    from rich.table import Table

    rows, tokens, pad = plan["rows"], plan["prompt_tokens"], plan["padding_efficiency"]
    summary = Table(title=f"bulkinfer plan: {plan['input']}", show_header=False)
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    summary.add_row(
        "rows", f"{rows['total']} ({rows['valid']} valid, {rows['failed']} would fail, {rows['skipped']} blank skipped)"
    )
    for error_type, count in sorted(plan["errors"].items()):
        summary.add_row(f"  {error_type}", str(count))
    _passthrough_row(summary, plan.get("passthrough_fields"))
    summary.add_row(
        "prompt tokens",
        f"min {tokens['min']}, median {tokens['median']}, p90 {tokens['p90']}, "
        f"p99 {tokens['p99']}, max {tokens['max']} (total {tokens['total']})",
    )
    summary.add_row("context", f"{plan['context']} tokens")
    summary.add_row("prompt rows", "through the chat template" if plan.get("chat_template_applied") else "sent raw")
    summary.add_row(
        f"padding efficiency (static B={pad['batch_size']})",
        f"arrival {100 * pad['arrival']:.1f}%, bucketed {100 * pad['bucketed']:.1f}%, "
        f"sorted {100 * pad['sorted']:.1f}%",
    )
    summary.add_row("completion tokens", f"at most {plan['max_completion_tokens']}")
    prefix = plan.get("prefix")
    if prefix:
        summary.add_row(
            f"shared prefixes ({prefix['block_tokens']}-token blocks)",
            f"{prefix['shareable_tokens']} prompt tokens ({_pct(prefix['shareable_share'])}) in "
            f"{prefix['groups']} groups of {prefix['rows_in_groups']} rows",
        )
    estimate = plan["estimate"]
    if estimate:
        gen, load = estimate["generate_seconds"], estimate["load_seconds"]
        summary.add_row(
            "estimate",
            f"generation {gen['low']:.0f}-{gen['high']:.0f} s + load {load['low']:.0f}-{load['high']:.0f} s (below)",
        )
    else:
        summary.add_row("estimate", "none (below)")
    summary.add_row("planned in", f"{plan['seconds']:.1f} s")
    console.print(summary)
    buckets = Table(title="buckets (prompt tokens)")
    for name in ("range", "rows", "histogram", "real tokens", "padded tokens", "padding efficiency"):
        if name == "histogram":
            buckets.add_column(name, no_wrap=True, min_width=20)
        else:
            buckets.add_column(name, justify="right")
    most = max((b["rows"] for b in plan["buckets"]), default=1)
    for b in plan["buckets"]:
        bar = "#" * max(1, round(20 * b["rows"] / most))
        buckets.add_row(
            b["range"],
            str(b["rows"]),
            bar,
            str(b["real_tokens"]),
            str(b["padded_tokens"]),
            f"{100 * b['padding_efficiency']:.1f}%",
        )
    console.print(buckets)
    if estimate:
        lines = [
            f"estimate: generation {gen['low']:.0f}-{gen['high']:.0f} s + load {load['low']:.0f}-{load['high']:.0f} s,"
            f" if {estimate['assumes']}",
            f"  {estimate['derivation']}",
            f"  {plan['estimate_source']}:",
            *(f"    {describe(entry)}" for entry in estimate["calibrations"]),
        ]
    else:
        lines = [plan["estimate_source"]]  # "no estimate: ..."
    for line in lines:
        console.print(line, markup=False, highlight=False)
    for example in plan["error_examples"][:5]:
        console.print(f"line {example['line']}: {example['type']}: {example['message']}", markup=False)
