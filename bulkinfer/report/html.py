"""A self-contained HTML report of a run or an eval: one file, charts embedded
as base64 PNG (matplotlib, Agg backend), no scripts or styles fetched from
anywhere, so it opens from a mail attachment or a cron job's artifact folder.

Charts: prompt-length buckets and completion-length histogram, padding
efficiency per bucket and overall (arrival vs sorted), completion tokens
delivered over the run (its slope is the throughput), time by phase. Tables:
request counts, throughput, engine settings; for an eval, the metric table and
the distribution of per-row scores.

matplotlib is imported only here, never on the CLI's start-up path.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bulkinfer.engine.log import terminal

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ccc; padding: .25em .6em; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; } img { border: 1px solid #eee; }
"""
# Sets data-images on <body> to the decoded sizes of the charts, so a headless
# browser can tell that every image decoded (tests/test_html_report.py).
_CHECK = """
window.addEventListener('load', () => {
  const sizes = Array.from(document.images).map(i => i.naturalWidth + 'x' + i.naturalHeight);
  document.body.setAttribute('data-images', sizes.join(','));
});
"""


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _bar_chart(title: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(labels))], values, width=width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend()
    return _png(fig)


def _line_chart(title: str, xs: Sequence[float], ys: Sequence[float], xlabel: str, ylabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(xs, ys, marker=".")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _png(fig)


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
            text = f"{value:,.2f}" if isinstance(value, float) else str(value)
            cells.append(f'<td class="{"n" if numeric else ""}">{html.escape(text)}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def run_sections(report: dict[str, Any]) -> list[str]:
    """HTML sections for a run report (the keys of ``OUT.report.json``)."""
    counts, seconds, tput = report["request_counts"], report["seconds"], report["throughput"]
    buckets = report.get("buckets", [])
    pad = report["padding_efficiency"]
    parts = ["<h2>Summary</h2>", _table([
        ["input", report["input"]], ["output", report["output"]], ["model", report["model"]],
        ["rows", counts["total"]], ["completed", counts["completed"]], ["failed", counts["failed"]],
        ["skipped (blank lines)", counts.get("skipped", 0)],
        ["prompt tokens", report["tokens"]["prompt"]], ["completion tokens", report["tokens"]["completion"]],
        ["requests/s", tput["requests_per_s"]], ["completion tokens/s", tput["completion_tokens_per_s"]],
        ["total tokens/s", tput["total_tokens_per_s"]],
    ])]  # fmt: skip
    charts = []
    if buckets:
        labels = [b["range"] for b in buckets]
        charts.append(
            _img(
                _bar_chart("prompt length (rows per bucket)", labels, {"rows": [b["rows"] for b in buckets]}, "rows"),
                "prompt lengths",
            )
        )
        charts.append(
            _img(
                _bar_chart(
                    f"padding efficiency per bucket (static B={pad['batch_size']})",
                    labels,
                    {"sorted": [100 * b["padding_efficiency"] for b in buckets]},
                    "%",
                ),
                "padding per bucket",
            )
        )
    charts.append(
        _img(
            _bar_chart(
                "padding efficiency overall",
                ["arrival", "sorted"],
                {"overall": [100 * pad["arrival"], 100 * pad["sorted"]]},
                "%",
            ),
            "padding overall",
        )
    )
    completions = report.get("completion_length_histogram") or []
    if completions:
        charts.append(
            _img(
                _bar_chart(
                    "completion length (tokens)",
                    [c["range"] for c in completions],
                    {"rows": [c["rows"] for c in completions]},
                    "rows",
                ),
                "completion lengths",
            )
        )
    timeline = report.get("timeline") or []
    if len(timeline) > 1:
        # vLLM hands a row back when it finishes, so a per-interval rate would be
        # spikes; the cumulative curve's slope is the throughput.
        xs, ys = [t for t, _ in timeline], [c for _, c in timeline]
        title = "completion tokens delivered over the run (slope = tokens/s)"
        charts.append(_img(_line_chart(title, xs, ys, "seconds since the first request", "tokens"), "throughput"))
    phases = ["load", "plan", "generate", "write"]
    charts.append(
        _img(
            _bar_chart(
                "time by phase (plan and write overlap generate)",
                phases,
                {"seconds": [seconds[p] for p in phases]},
                "seconds",
            ),
            "time by phase",
        )
    )
    parts.append('<h2>Charts</h2><div class="charts">' + "".join(charts) + "</div>")
    engine = report.get("engine", {})
    parts.append("<h2>Engine settings</h2>" + _table([[k, v] for k, v in engine.items()]))
    return parts


def eval_sections(report: dict[str, Any], metrics: Sequence[str], rows: Sequence[dict[str, Any]] = ()) -> list[str]:
    """HTML sections for an eval report (``OUT.eval.json``), its ``metrics``
    (names, in table order) and its scored rows."""
    scores = report["scores"]
    ci = scores.get("ci") or {}
    names = [*metrics, *(["perplexity"] if scores.get("perplexity") is not None else [])]
    table = _table(
        [[n, scores[n], " - ".join(f"{v:.2f}" for v in ci[n]) if n in ci else ""] for n in names],
        header=["metric", "score", "95% interval"],
    )
    parts = ["<h2>Scores</h2>", table, _table([[k, v] for k, v in scores["signatures"].items()], ["signature", ""])]
    charts = []
    for metric in ("bleu", "rougeL", "perplexity"):
        values = [r[metric] for r in rows if isinstance(r.get(metric), int | float)]
        if values:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.hist(values, bins=20)
            ax.set_title(f"per-row {metric} ({len(values)} rows)")
            ax.set_ylabel("rows")
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


def write_run_html(report: dict[str, Any], path: Path) -> None:
    """The self-contained HTML report beside the output. A failure to draw it
    is reported on stderr and never fails the run (the JSON report has it all)."""
    try:
        from bulkinfer.report.html import run_sections, write_html

        write_html(f"bulkinfer: {report['input']}", run_sections(report), path)
    except Exception as exc:  # matplotlib missing, a font problem, ...
        print(f"bulkinfer: warning: HTML report not written: {type(exc).__name__}: {exc}", file=terminal())
