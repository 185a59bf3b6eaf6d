"""Where a first run's ETA point errs (``python -m bench.eta_range --split
T1,T2,...``): the completion tokens left against the seconds per token, and
how far the rate the estimator takes (the median of its recent steps'
seconds per unit of work) stands from the same steps' summed seconds over
their summed work.
"""

from __future__ import annotations

import math
from typing import Any


def split(tags: list[str], workloads: list[str], every_s: float = 10.0) -> dict[str, Any]:
    """Where each first run's point errs, from 25% of its time on (not the
    last :data:`~bench.eta_trace.LAST_LINE_S` seconds), replayed every
    ``every_s`` seconds: its completion tokens left (the futures' mean) over
    the true ones, less 1 (``tokens``), and its seconds per token left (point
    / tokens left) over the true ones (real time left / true tokens left),
    less 1 (``rate``): the lengths not known against the step model; each as
    [lowest, highest] over the run; and ``mix``: the rate the estimator took
    (:meth:`~bulkinfer.report.eta.WorkEstimate._rate` under the run's step
    model, the median of its recent steps' seconds per unit of work) over
    those steps' seconds summed over their work summed, less 1 (0 where the
    model prices every kind of step alike; where it misprices one kind, the
    median takes the commoner kind's rate and the summed figure the mix's).
    Each estimate's in ``points``: [share of the run's time, tokens, rate,
    point / real time left - 1, mix] ((1 + tokens) x (1 + rate) = 1 + the
    point's error)."""
    from bench.eta_range import _replay
    from bench.eta_trace import LAST_LINE_S

    runs = []
    for tag in tags:
        for k, workload in enumerate(workloads):
            name, recording, estimates = _replay(tag, workloads, k, True)
            events = recording["events"]
            start, end = events[0][1], events[-1][1]
            total = max(e[2] for e in events if e[0] == "t")
            points, last = [], -math.inf
            for now, progress in estimates:
                if now - last < every_s or now - start < 0.25 * (end - start) or end - now < LAST_LINE_S:
                    continue
                last, work = now, progress.work
                outlook = work.outlook(progress.total, progress._failed_unplanned)
                left = max(total - work.generated_tokens, 1)
                tokens = outlook.completion_tokens / left - 1
                rate = outlook.point / max(outlook.completion_tokens, 1) / ((end - now) / left) - 1
                point = outlook.point / (end - now) - 1
                points.append([(now - start) / (end - start), tokens, rate, point, _mix(work)])
            runs.append(
                {
                    "tag": tag,
                    "workload": workload,
                    "recording": name,
                    "estimates": len(points),
                    **{key: [min(p[i] for p in points), max(p[i] for p in points)] for i, key in _PARTS},
                    "points": points,  # [share of the run's time, tokens, rate, the point's error, mix] each
                }
            )
    return {"runs": runs}


_PARTS = ((1, "tokens"), (2, "rate"), (4, "mix"))


def _mix(work: Any) -> float:
    """The estimator's rate over its recent steps' summed seconds over their
    summed work (each step's work as the rate counts it), less 1."""
    steps = list(work.steps)
    rates = work.step_cost.step_rates(steps, work._most_rows())
    summed = sum(s.seconds for s in steps) / sum(s.seconds / r for s, r in zip(steps, rates, strict=True))
    return work._rate(work.step_cost) / summed - 1


def render_split(doc: dict[str, Any]) -> str:
    """The Markdown table of :func:`split`."""
    lines = [
        "# Where a first run's point errs: the tokens left against the seconds per token\n",
        f"Command: `{doc['command']}` (the committed recordings, replayed through the estimator as it is). "
        "From 25% of each first run's time on, every 10 s: its completion tokens left (the futures' mean) "
        "over the true ones, and its seconds per token left (point / tokens left) over the true ones; "
        "the lowest and highest of each, less 1. Mix: the rate the estimator took (the median of its recent "
        "steps' seconds per unit of work) over the same steps' seconds summed over their work summed, less 1.\n",
        "| round | job | estimates | tokens left | seconds per token | mix |",
        "| --- | --- | --: | --: | --: | --: |",
    ]
    for r in doc["runs"]:
        tokens, rate, mix = (f"{low:+.0%} to {high:+.0%}" for low, high in (r["tokens"], r["rate"], r["mix"]))
        lines.append(f"| {r['tag']} | {r['workload']} | {r['estimates']} | {tokens} | {rate} | {mix} |")
    return "\n".join(lines) + "\n"
