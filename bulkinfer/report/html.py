"""A self-contained HTML report of a run or an eval: one file, charts embedded
as base64 PNG (matplotlib, Agg backend), no scripts or styles fetched from
anywhere, so it opens from a mail attachment or a cron job's artifact folder.

Tables: request counts, tokens, wall time, throughput over generation and end
to end, sampling and engine settings (bytes in KiB/MiB/GiB). Charts: tokens
over generation time from the engine's live counts (the progress line's source;
its slope is the throughput), prompt- and completion-length histograms, time by
phase (each bar labelled with its value), and, under a note that vLLM does not
pad, the padding a static batcher would waste per bucket and overall (arrival
vs sorted). For an eval: the metric table, row counts and the distribution of
per-row scores on labelled axes.

matplotlib is imported only here, never on the CLI's start-up path.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bulkinfer.engine.log import terminal
from bulkinfer.report.eval_model import score_remarks
from bulkinfer.report.model import Bucket, LengthBin, RunReport, TokenSeries, as_run_report
from bulkinfer.report.units import format_bytes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ccc; padding: .25em .6em; }
td { overflow-wrap: anywhere; } td:first-child { overflow-wrap: normal; }  /* a long value (glibc_tunables) wraps */
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.charts, .tables { display: flex; flex-wrap: wrap; gap: 1em 2em; } img { border: 1px solid #eee; }
p.note { max-width: 60em; color: #444; }
p.warning { max-width: 60em; color: #8a1c00; }
"""
# Sets data-images on <body> to the decoded sizes of the charts, and data-overflow
# to the pixels the page is wider than the window, so a headless browser can tell
# that every image decoded and nothing runs off the page (tests/report/test_html_report.py).
_CHECK = """
window.addEventListener('load', () => {
  const sizes = Array.from(document.images).map(i => i.naturalWidth + 'x' + i.naturalHeight);
  document.body.setAttribute('data-images', sizes.join(','));
  document.body.setAttribute('data-overflow', document.documentElement.scrollWidth - window.innerWidth);
});
"""


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.2))


def _integer_ticks(axis: Any) -> None:
    """Ticks at whole numbers only (an axis that counts rows)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _bar_chart(
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    value_label: Callable[[float], str],
    xlabel: str = "",
) -> str:
    """Bars with their value written above each (``value_label`` formats it),
    so a bar too short to see still reads; a y axis of ``rows`` ticks at whole
    numbers."""
    fig, ax = _figure()
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        bars = ax.bar([i + k * width for i in range(len(labels))], values, width=width, label=name)
        ax.bar_label(bars, labels=[value_label(v) for v in values], padding=2, fontsize=8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.margins(y=0.15)  # room for the labels above the tallest bar
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel == "rows":
        _integer_ticks(ax.yaxis)
    if len(series) > 1:
        ax.legend()
    return _png(fig)


def _rows(value: float) -> str:
    return f"{value:,.0f}"


def _percent(value: float) -> str:
    return f"{value:.0f}%"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:,.0f} s"


def duration(seconds: float) -> str:
    """``235.9`` -> ``"3 min 56 s (235.9 s)"``; under a minute, ``"42.0 s"``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    shown = f"{hours} h {minutes} min {rest} s" if hours else f"{minutes} min {rest} s"
    return f"{shown} ({seconds:,.1f} s)"


def _img(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = []
        for value in row:
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            text = f"{value:,.2f}" if isinstance(value, float) else f"{value:,}" if numeric else str(value)
            cells.append(('<td class="n">' if numeric else "<td>") + f"{html.escape(text)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _setting(name: str, value: Any) -> Any:
    """A setting as the report shows it: byte counts in KiB/MiB/GiB, unset as ``-``."""
    if value is None:
        return "-"
    if name.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        return f"{format_bytes(value)} ({value:,} bytes)"
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value)) or "-"
    return value


# The note beside the padding charts: the figures are a counterfactual.
PADDING_NOTE = (
    "vLLM does not pad: continuous batching with paged attention stores and computes each request's own "
    "tokens only, so this run wasted none of these positions. The figures are what a static batcher "
    "(Hugging Face generate, a hand-written batch loop) would waste, padding every batch of B={batch_size} "
    "prompts to its longest: real prompt tokens / padded prompt tokens, with the file cut in arrival order "
    "vs in length-sorted order."
)


def _summary(r: RunReport) -> list[str]:
    counts, seconds, tokens = r.request_counts, r.seconds, r.tokens
    rows: list[list[Any]] = [
        ["input", r.input], ["output", r.output], ["model", r.model],
        ["rows", counts.total], ["completed", counts.completed], ["failed", counts.failed],
        ["skipped (blank lines)", counts.skipped],
    ]  # fmt: skip
    if r.resumed.completed or r.resumed.failed:
        rows.append(["resumed (finished by an earlier attempt)", r.resumed.completed + r.resumed.failed])
    if r.chat_template_applied is not None:
        rows.append(["text prompts", "through the chat template" if r.chat_template_applied else "sent raw"])
    rows += [
        ["prompt tokens", tokens.prompt], ["completion tokens", tokens.completion],
        ["wall time (model load included)", duration(seconds.total)],
        ["generation time (first request in to last result out)", duration(seconds.generate)],
    ]  # fmt: skip
    if r.peak_rss_bytes.bulkinfer is not None:
        rows.append(["peak memory of bulkinfer (RSS)", format_bytes(r.peak_rss_bytes.bulkinfer)])
    if r.peak_rss_bytes.children:
        rows.append(["peak memory of the largest engine process (RSS)", format_bytes(r.peak_rss_bytes.children)])
    parts = ['<div class="tables"><div><h2>Summary</h2>', _table(rows), "</div>"]
    if r.input_changed:  # rows written after the reader passed them have no record: said first
        changed = html.escape(str(r.input_changed.get("message")))
        parts.insert(0, f'<p class="warning"><strong>Input changed while read:</strong> {changed}</p>')
    if r.encoder:
        settings = _table([[k, _setting(k, v)] for k, v in dataclasses.asdict(r.encoder).items()])
        parts.append(f"<div><h2>{'Scoring' if r.scoring else 'Embedding'}</h2>{settings}</div>")
    if r.sampling:
        settings = _table([[k, _setting(k, v)] for k, v in r.sampling.items()])
        own = ", ".join(f"{name} ({rows})" for name, rows in r.sampling_set_by_rows.items())
        own = f'<p class="note">Rows that set their own (rows): {html.escape(own)}.</p>' if own else ""
        parts.append(f"<div><h2>Sampling settings</h2>{settings}{own}</div>")
    parts.append("</div>")

    tput, e2e = r.throughput, r.throughput_end_to_end
    names = [
        ("requests/s", "requests_per_s"), ("prompt tokens/s", "prompt_tokens_per_s"),
        ("completion tokens/s", "completion_tokens_per_s"), ("total tokens/s", "total_tokens_per_s"),
    ]  # fmt: skip
    header = ["", f"over generation ({seconds.generate:,.1f} s)"]
    if e2e:
        header.append(f"end to end ({seconds.total:,.1f} s, model load included)")
    table = [[label, getattr(tput, key), *([getattr(e2e, key)] if e2e else [])] for label, key in names]
    parts += ["<h2>Throughput</h2>", _table(table, header)]
    if r.resumed.completed:
        parts.append("<p>Throughput counts the rows this attempt ran, not the resumed ones.</p>")
    return parts + _outcomes(r)


def _outcomes(r: RunReport) -> list[str]:
    """How the completions ended (``finish_reason``), how the structured ones
    checked against their constraints, and the pass-through fields."""
    parts = []
    if r.finish_reasons:
        parts += [
            "<h2>Completions by finish_reason</h2>",
            _table(list(r.finish_reasons.items()), ["finish_reason", "completions"]),
        ]
    structured = r.structured_outputs
    if structured:
        header = ["constraint", "completions", "valid", "cut at max_tokens", "invalid", "not checked"]
        rows = [[kind, *dataclasses.astuple(c)] for kind, c in structured.by_kind.items()]
        note = html.escape(f"Grammar backend: {structured.backend}. " + STRUCTURED_NOTE)
        parts += ["<h2>Structured output</h2>", _table(rows, header), f'<p class="note">{note}</p>']
    if r.passthrough_fields:
        notes = any(f.note for f in r.passthrough_fields)  # the third column only when it says something
        rows = [[f.name, f.rows, *([f.note] * notes)] for f in r.passthrough_fields]
        parts += ["<h2>Pass-through fields</h2>", _table(rows, ["field", "rows", *([""] * notes)])]
    return parts


# Beside the structured-output table: what "valid" means.
STRUCTURED_NOTE = (
    "Each completion checked against its row's constraint: JSON parsed and validated against its schema, "
    "a choice among the choices, a regex matched whole. vLLM's grammar guarantees a completion that ran to "
    "its end; one cut at max_tokens may stop before the JSON closes."
)


def _tokens_chart(series: TokenSeries) -> str:
    """Cumulative completion and prompt tokens over generation time, from the
    engine's live counts (the report's ``tokens_over_time``)."""
    xs = series.seconds
    fig, ax = _figure()
    end = xs[-1] if xs else 0.0
    lines = (
        (series.completion_tokens, "completion tokens generated"),
        (series.prompt_tokens, "prompt tokens processed"),
    )
    for ys, label in lines:
        if len(ys) == len(xs):
            mean = f"{ys[-1] / end:,.1f} tok/s on average" if end > 0 else ""
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=f"{label} ({mean})" if mean else label)
    ax.set_title("tokens over generation time (engine's live counts; slope = tokens/s)")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("tokens (cumulative)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)  # below: off the lines
    return _png(fig)


def _rows_chart(title: str, bins: Sequence[Bucket | LengthBin], xlabel: str, alt: str) -> str:
    """A histogram already binned: rows per token ``range``."""
    chart = _bar_chart(title, [b.range for b in bins], {"rows": [b.rows for b in bins]}, "rows", _rows, xlabel)
    return _img(chart, alt)


def run_sections(report: RunReport | dict[str, Any]) -> list[str]:
    """HTML sections for a run, embed or score report (typed, or the dict of
    ``OUT.report.json``: :func:`~bulkinfer.report.model.as_run_report`; a
    report of an older bulkinfer, without ``tokens_over_time``, sampling or
    end-to-end throughput, renders without them).

    Raises:
        InputFileError: a dict that is no run report.
    """
    r = as_run_report(report)
    seconds, buckets, pad = r.seconds, r.buckets, r.padding_efficiency
    parts = _summary(r)
    charts = []
    series = r.tokens_over_time
    if series and len(series.seconds) > 1:
        charts.append(_img(_tokens_chart(series), "tokens over time"))
    if buckets:
        charts.append(_rows_chart("prompt length (rows per bucket)", buckets, "prompt tokens", "prompt lengths"))
    completions = r.completion_length_histogram if r.encoder is None else []  # embed, score: no completions
    if completions:
        charts.append(
            _rows_chart("completion length (rows per bin)", completions, "completion tokens", "completion lengths")
        )
    phases = ["load", "plan", "generate", "write"]
    charts.append(
        _img(
            _bar_chart(
                "time by phase (plan and write overlap generate)",
                phases,
                {"seconds": [getattr(seconds, p) for p in phases]},
                "seconds",
                _seconds,
            ),
            "time by phase",
        )
    )
    parts.append('<h2>Charts</h2><div class="charts">' + "".join(charts) + "</div>")
    if not series:
        parts.append(
            "<p>This report has no token series (written by a bulkinfer before it recorded the engine's "
            "live counts): no tokens-over-time chart.</p>"
        )

    padding = []
    if buckets:
        padding.append(
            _img(
                _bar_chart(
                    f"padding efficiency per bucket if batched statically (B={pad.batch_size})",
                    [b.range for b in buckets],
                    {"sorted": [100 * b.padding_efficiency for b in buckets]},
                    "% of padded positions that are real",
                    _percent,
                    xlabel="prompt tokens",
                ),
                "padding per bucket",
            )
        )
    padding.append(
        _img(
            _bar_chart(
                f"padding efficiency overall if batched statically (B={pad.batch_size})",
                ["arrival order", "bucketed (as fed)"],
                {"overall": [100 * pad.arrival, 100 * pad.sorted]},
                "% of padded positions that are real",
                _percent,
            ),
            "padding overall",
        )
    )
    note = html.escape(PADDING_NOTE.format(batch_size=pad.batch_size))
    parts.append(
        f'<h2>Padding: what static batching would waste</h2><p class="note">{note}</p>'
        f'<div class="charts">{"".join(padding)}</div>'
    )
    if r.replicas:
        keys = ["rows", "prompt_tokens", "completion_tokens", "busy_seconds", "completion_tokens_per_s"]
        keys += [k for k in ("deaths", "requeued", "node") if any(getattr(x, k) is not None for x in r.replicas)]
        header = ["replica", *(k.replace("_", " ").replace("seconds", "s").replace("per s", "/s") for k in keys)]
        rows = [[i, *(getattr(x, k) for k in keys)] for i, x in enumerate(r.replicas)]
        balance = r.replica_balance
        note = f"Balance (slowest / fastest busy time): {balance:.2f}." if balance else ""
        parts += ["<h2>Replicas</h2>", _table(rows, header), f"<p>{html.escape(note)}</p>"]
    shown = [[k, _setting(k, v)] for k, v in r.engine_settings.items()]
    parts.append("<h2>Engine settings</h2>" + _table(shown))
    chosen = r.engine_choice
    if chosen.dtype:
        why = f"dtype {chosen.dtype.dtype}: {chosen.dtype.why}"
        parts.append(f'<p class="note">{html.escape(why)}</p>')
    if chosen.compile:
        mode = "eager" if chosen.compile.enforce_eager else "compiled"
        parts.append(f'<p class="note">{html.escape(f"{mode}: {chosen.compile.why}")}</p>')
    if chosen.scheduler:
        tuned = ", ".join(f"{k} = {v}" for k, v in chosen.scheduler.settings.items())
        parts.append(f'<p class="note">{html.escape(f"measured by bulkinfer calibrate --tune: {tuned}")}</p>')
    return parts


# How each per-row score is named on its chart's axis.
_SCORE_AXES = {
    "bleu": "sentence BLEU (0-100, higher is better)",
    "rougeL": "ROUGE-L F1 (0-100, higher is better)",
    "perplexity": "perplexity of the reference (lower is better)",
}


def eval_sections(report: dict[str, Any], metrics: Sequence[str], rows: Sequence[dict[str, Any]] = ()) -> list[str]:
    """HTML sections for an eval report (``OUT.eval.json``), its ``metrics``
    (names, in table order) and its scored rows."""
    scores = report["scores"]
    ci = scores.get("ci") or {}
    names = [*metrics, *(["perplexity"] if scores.get("perplexity") is not None else [])]
    interval = [" - ".join(f"{v:.2f}" for v in ci.get(n, [])) for n in names] if ci else None  # --bootstrap
    table_rows = [[n, scores[n], *([interval[k]] if interval else [])] for k, n in enumerate(names)]
    table = _table(table_rows, header=["metric", "score", *(["95% interval"] if interval else [])])
    parts = ["<h2>Scores</h2>", table, _table([[k, v] for k, v in scores["signatures"].items()], ["signature", ""])]
    parts += [f"<p>{html.escape(line)}</p>" for line in score_remarks(scores)]
    counts = report.get("row_counts") or {}
    if counts:
        # lists of ids as their counts; `unmatched` ({golden, predictions}) repeats the two lists' counts
        shown = [[k.replace("_", " "), len(v) if isinstance(v, list) else v] for k, v in counts.items()]
        parts += ["<h2>Rows</h2>", _table([row for row in shown if not isinstance(row[1], dict)])]
    charts = []
    for metric, axis in _SCORE_AXES.items():
        values = [r[metric] for r in rows if isinstance(r.get(metric), int | float)]
        if values:
            fig, ax = _figure()
            bounded = metric != "perplexity"
            ax.hist(values, bins=20, range=(0, 100) if bounded else None, edgecolor="white")
            if bounded:
                ax.set_xlim(0, 100)
            ax.set_title(f"per-row {metric} ({len(values)} rows)")
            ax.set_xlabel(axis)
            ax.set_ylabel("rows")
            _integer_ticks(ax.yaxis)
            charts.append(_img(_png(fig), f"per-row {metric}"))
    if charts:
        parts.append('<h2>Per-row scores</h2><div class="charts">' + "".join(charts) + "</div>")
    return parts


def write_html(title: str, sections: Sequence[str], path: Path) -> None:
    """Write a self-contained HTML page atomically (temp file + ``os.replace``)."""
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style><script>{_CHECK}</script></head>"
        f"<body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>"
    )
    from bulkinfer.io.files import atomic_write

    atomic_write(path, page.encode("utf-8"))


def write_run_html(report: RunReport | dict[str, Any], path: Path) -> None:
    """The self-contained HTML report of a run, embed or score report (typed, or the
    dict a run builds) at ``path``. A failure to draw it (a dict that is no
    report included) is reported on stderr and never fails the run (the JSON
    report has it all).

    Raises:
        OSError: the page cannot be written (a full disk, a directory in the
            way), as any file of the run.
    """
    try:
        r = as_run_report(report)
        sections = run_sections(r)
    except Exception as exc:  # matplotlib missing, a font problem, ...
        print(f"bulkinfer: warning: HTML report not drawn: {type(exc).__name__}: {exc}", file=terminal())
        return
    write_html(f"bulkinfer: {r.input}", sections, path)
