"""What the terminal shows at the end of a command: the run summary, the
plan, the eval scores (rich tables on the console given)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bulkinfer.report.model import PassthroughField, RunReport, as_run_report
from bulkinfer.report.plan_estimate import describe
from bulkinfer.report.units import format_bytes


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_summary(report: RunReport | dict[str, Any], console: Console) -> None:
    """The run, embed or score report (typed, or as a run builds it: see
    :func:`~bulkinfer.report.model.as_run_report`) as rich tables: counts,
    tokens, seconds by phase, throughput (rows/s, tokens/s), buckets.

    Raises:
        InputFileError: a dict that is no run report.
    """
    r = as_run_report(report)
    counts, seconds, tput, e2e = r.request_counts, r.seconds, r.throughput, r.throughput_end_to_end
    summary = Table(title=f"bulkinfer {r.job}: {r.input}", show_header=False)
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    summary.add_row("model", r.model)
    if r.chat_template_applied is not None:
        summary.add_row("text prompts", "through the chat template" if r.chat_template_applied else "sent raw")
    blank = f", {counts.skipped} blank lines skipped" if counts.skipped else ""
    summary.add_row("rows", f"{counts.total} ({counts.completed} completed, {counts.failed} failed{blank})")
    summary.add_row("tokens", f"{r.tokens.prompt} prompt, {r.tokens.completion} completion")
    summary.add_row(
        "seconds",
        f"load {seconds.load:.1f}, plan {seconds.plan:.1f}, generate {seconds.generate:.1f}, "
        f"write {seconds.write:.1f}, total {seconds.total:.1f}",
    )
    start = seconds.start
    if start.engine or start.first_token is not None:  # reports before 2026-11-25 have no start phases
        first = "none generated" if start.first_token is None else f"{start.first_token:.1f} s"
        summary.add_row(
            "start",
            f"tokenizer {start.tokenizer:.1f}, engine choice {start.engine_choice:.1f}, "
            f"engine {start.engine:.1f}; first token at {first}",
        )
    if r.scoring:
        how = (
            "each pair read at once, and cut by --truncate longest first"
            if r.scoring.method == "cross-encoder"
            else "each text embedded, and cut by --truncate, on its own"
        )
        summary.add_row("scoring", f"{r.scoring.method} ({how})")
    if r.encoder:
        encoder = r.encoder
        summary.add_row(
            "embedding",
            f"max_seq_length {encoder.max_seq_length}, normalize {encoder.normalize}, "
            f"{encoder.truncated_inputs} inputs truncated",
        )
        summary.add_row("throughput", f"{tput.requests_per_s:.2f} rows/s, {tput.prompt_tokens_per_s:.1f} prompt tok/s")
        if e2e:
            summary.add_row(
                "end to end (load included)",
                f"{e2e.requests_per_s:.2f} rows/s, {e2e.prompt_tokens_per_s:.1f} prompt tok/s",
            )
    else:
        summary.add_row(
            "throughput",
            f"{tput.requests_per_s:.2f} req/s, {tput.completion_tokens_per_s:.1f} completion tok/s, "
            f"{tput.total_tokens_per_s:.1f} total tok/s",
        )
        if e2e:
            summary.add_row(
                "end to end (load included)",
                f"{e2e.requests_per_s:.2f} req/s, {e2e.completion_tokens_per_s:.1f} completion tok/s",
            )
    if r.finish_reasons:
        summary.add_row("finish_reason", ", ".join(f"{reason} {n}" for reason, n in r.finish_reasons.items()))
    if r.structured_outputs:
        for kind, c in r.structured_outputs.by_kind.items():
            summary.add_row(
                f"structured ({kind}, {r.structured_outputs.backend})",
                f"{c.valid}/{c.completions - c.unchecked} valid, {c.cut_at_max_tokens} cut at max_tokens, "
                f"{c.invalid} invalid" + (f", {c.unchecked} not checked" if c.unchecked else ""),
            )
    _passthrough_row(summary, r.passthrough_fields)
    _sampling_rows_row(summary, r.sampling_set_by_rows)
    _replicas_row(summary, r)
    if r.engine_choice.dtype:
        summary.add_row("dtype", f"{r.engine_choice.dtype.dtype}: {r.engine_choice.dtype.why}")
    if r.engine_choice.compile:
        mode = "eager" if r.engine_choice.compile.enforce_eager else "compiled"
        summary.add_row("compilation", f"{mode}: {r.engine_choice.compile.why}")
    block = r.engine_choice.block_size
    if block and block.block_size:  # chosen or set; vLLM's own block is no news
        summary.add_row("KV blocks", _kv_blocks(block.block_size, block.why))
    preempted = r.engine.get("preemptions")
    if preempted:
        summary.add_row(
            "preemptions",
            f"{preempted}: the KV cache did not hold every running row, so vLLM stopped requests and computed their "
            "tokens again (a larger --kv-cache-memory-bytes or a smaller --max-num-seqs avoids it)",
        )
    if r.engine.get("speculative_config"):
        summary.add_row("speculative decoding", _speculation(r.engine))
    rss = r.peak_rss_bytes
    if rss.bulkinfer is not None:
        engine = f", engine {format_bytes(rss.children)}" if rss.children else ""
        summary.add_row("peak memory (RSS)", f"bulkinfer {format_bytes(rss.bulkinfer)}{engine}")
    cache = r.prefix_cache
    if cache and cache.prompt_tokens:
        fed = "prefix-aware feed" if r.plan.get("prefix_aware") else "plain feed"
        summary.add_row("prefix cache hits", f"{_pct(cache.hit_rate)} of prompt tokens ({cache.cached_tokens}; {fed})")
    pad = r.padding_efficiency
    summary.add_row(
        f"padding if batched statically (B={pad.batch_size})",
        f"arrival {_pct(pad.arrival)}, bucketed {_pct(pad.sorted)}; vLLM does not pad",
    )
    summary.add_row("output", r.output)
    if counts.failed:
        summary.add_row("errors", str(r.errors))
    if r.input_changed:
        summary.add_row("input changed", str(r.input_changed.get("message")))
    console.print(summary)
    buckets = Table(title="buckets (prompt tokens)")
    for name in ("range", "rows", "real tokens", "padded tokens", "padding efficiency"):
        buckets.add_column(name, justify="right")
    for b in r.buckets:
        buckets.add_row(b.range, str(b.rows), str(b.real_tokens), str(b.padded_tokens), _pct(b.padding_efficiency))
    console.print(buckets)


def _replicas_row(summary: Table, r: RunReport) -> None:
    """Rows and busy seconds per replica, the balance and deaths, when there were replicas."""
    if not r.replicas:
        return
    rows = "/".join(str(x.rows) for x in r.replicas)
    busy = "/".join(f"{x.busy_seconds:.1f}" for x in r.replicas)
    deaths = sum(x.deaths or 0 for x in r.replicas)
    moved = sum(x.requeued or 0 for x in r.replicas)
    summary.add_row(
        f"replicas ({len(r.replicas)})",
        f"rows {rows}, busy {busy} s"
        + (f", balance {r.replica_balance:.2f}" if r.replica_balance else "")
        + (f"; {deaths} died, {moved} requests moved" if deaths else ""),
    )


def _passthrough_row(summary: Any, fields: Sequence[PassthroughField]) -> None:
    """The pass-through fields of bulkinfer rows with their row counts; a near
    miss of a field bulkinfer reads (copied, not read) and a field the
    output's own replaces are flagged (:attr:`PassthroughField.note`)."""
    if not fields:
        return
    shown = [f"{f.name} {f.rows}" + (f" ({f.note})" if f.note else "") for f in fields[:12]]
    more = f", and {len(fields) - 12} more" if len(fields) > 12 else ""
    summary.add_row("pass-through fields (rows)", Text(", ".join(shown) + more))


def _sampling_rows_row(summary: Any, counts: dict[str, int]) -> None:
    """The request fields rows set themselves (field -> rows), over the defaults."""
    if counts:
        shown = ", ".join(f"{name} {rows}" for name, rows in counts.items())
        summary.add_row("sampling set by rows (rows)", f"{shown}; the others as configured")


def _kv_blocks(block_size: int, why: str) -> str:
    """The KV cache's block size and why (``engine_choice.block_size``), for a summary row."""
    size = f"{block_size} tokens"
    return f"{size}: {why.removeprefix(f'{size}: ')}"


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
    fields = plan.get("passthrough_fields") or []
    _passthrough_row(summary, [PassthroughField(**f) for f in fields])
    _sampling_rows_row(summary, plan.get("sampling_set_by_rows") or {})
    summary.add_row(
        "prompt tokens",
        f"min {tokens['min']}, median {tokens['median']}, p90 {tokens['p90']}, "
        f"p99 {tokens['p99']}, max {tokens['max']} (total {tokens['total']})",
    )
    summary.add_row("context", f"{plan['context']} tokens")
    scoring = plan.get("scoring")
    if scoring:
        summary.add_row(
            "scoring",
            f"{scoring['method']}, max_seq_length {scoring['max_seq_length']}, "
            f"truncate {scoring['truncate']} ({scoring['truncated_inputs']} inputs cut)",
        )
    else:
        templated = plan.get("chat_template_applied")
        summary.add_row("text prompts", "through the chat template" if templated else "sent raw")
    summary.add_row(
        f"padding efficiency (static B={pad['batch_size']})",
        f"arrival {100 * pad['arrival']:.1f}%, bucketed {100 * pad['bucketed']:.1f}%, "
        f"sorted {100 * pad['sorted']:.1f}%",
    )
    if not scoring:
        summary.add_row("completion tokens", f"at most {plan['max_completion_tokens']}")
    prefix = plan.get("prefix")
    if prefix:
        summary.add_row(
            f"shared prefixes ({prefix['block_tokens']}-token blocks)",
            f"{prefix['shareable_tokens']} prompt tokens ({_pct(prefix['shareable_share'])}) in "
            f"{prefix['groups']} groups of {prefix['rows_in_groups']} rows",
        )
    block = plan.get("block_size")
    if block and block["block_size"]:  # as the run's summary: vLLM's own block is no news
        summary.add_row("KV blocks", _kv_blocks(block["block_size"], block["why"]))
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


def _speculation(engine: Mapping[str, Any]) -> str:
    """The summary's line on vLLM's speculative decoding, from the report's
    ``engine``: its method, draft tokens a step, the largest batch it
    speculated in (``num_speculative_tokens_per_batch_size``), the draft
    tokens checked and accepted (``spec_decode_draft_tokens``,
    ``spec_decode_accepted_tokens``, where counted)."""
    config = engine["speculative_config"]
    line = f"{config.get('method', 'unknown method')}, {config.get('num_speculative_tokens')} draft tokens a step"
    schedule = config.get("num_speculative_tokens_per_batch_size") or ()
    largest = max((int(end) for _, end, drafts in schedule if drafts), default=None)
    if schedule:
        line += f", in steps of at most {largest} rows" if largest else ", in no step (every range has 0 drafts)"
    drafts, accepted = engine.get("spec_decode_draft_tokens"), engine.get("spec_decode_accepted_tokens")
    if drafts is None:
        return line
    line += f"; {drafts:,} draft tokens checked"
    if accepted is None:  # reports before 2026-12-04
        return line
    return line + f", {accepted:,} accepted" + (f" ({accepted / drafts:.0%})" if drafts else "")
