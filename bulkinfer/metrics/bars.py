"""Bars and changes: ``--fail-under`` (a metric below its bar fails a nightly
job, exit 8) and ``--compare`` (each metric's change against a saved
``.eval.json``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.errors import ConfigError
from bulkinfer.metrics.text import METRICS


class FailUnderError(ConfigError, ValueError):
    """A bad ``--fail-under`` value (unknown metric, bad number, bad syntax).

    A :class:`ValueError`, and a :class:`~bulkinfer.errors.ConfigError` so the
    CLI exits with the usage code.
    """


def parse_fail_under(spec: str) -> dict[str, float]:
    """``"bleu=20,rougeL=30"`` -> ``{"bleu": 20.0, "rougeL": 30.0}`` (0-100 bars).

    Raises:
        FailUnderError (a ValueError): empty spec, an item without ``=``, an
            unknown or repeated metric name, or a bar that is not a number
            between 0 and 100.
    """
    bars: dict[str, float] = {}
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise FailUnderError(f"--fail-under: expected METRIC=BAR[,METRIC=BAR...], got {spec!r}")
    for item in items:
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep:
            raise FailUnderError(f"--fail-under: {item!r} is not METRIC=BAR (e.g. bleu=20)")
        if name not in METRICS:
            raise FailUnderError(f"--fail-under: unknown metric {name!r}; metrics are {', '.join(METRICS)}")
        add_bar(bars, name, raw, 100.0)
    return bars


def add_bar(bars: dict[str, float], name: str, raw: str, top: float) -> None:
    """Add ``name``'s bar, the number ``raw`` in [0, ``top``] (the metric's
    scale: 100 for ``eval``'s text metrics, 1 for ``eval-rank``'s measures),
    to ``bars`` (``--fail-under`` of ``eval`` and ``eval-rank``).

    Raises:
        FailUnderError: ``raw`` is not a number in [0, ``top``], or ``name``
            (canonical: ``MRR@10`` is ``RR@10``) already has a bar.
    """
    try:
        bar = float(raw)
    except ValueError:
        raise FailUnderError(f"--fail-under: {name}={raw!r} is not a number") from None
    if not 0.0 <= bar <= top:
        raise FailUnderError(f"--fail-under: {name}={raw} is outside 0-{top:g} (the metric's scale)")
    if name in bars:
        raise FailUnderError(f"--fail-under: {name} is given twice")
    bars[name] = bar


def check_fail_under(scores: Mapping[str, Any], bars: Mapping[str, float]) -> list[str]:
    """The metrics of ``scores`` (an :meth:`EvalScores.to_dict`) strictly below
    their bar, as messages like ``"bleu 18.52 < 20"``; empty when all pass.

    Raises:
        ValueError: a barred metric is not a number in ``scores``.
    """
    failures = []
    for name, bar in bars.items():
        value = scores.get(name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"--fail-under: no {name} score to check")
        if value < bar:
            shown = f"{value:.2f}"
            if float(shown) >= bar:  # 19.999 would print as 20.00 < 20
                shown = repr(value)
            failures.append(f"{name} {shown} < {bar:g}")
    return failures


def compare(
    current: Mapping[str, Any], previous: Mapping[str, Any]
) -> list[tuple[str, float | None, float, float | None]]:
    """Each metric's change from a previous eval: ``(name, previous, current,
    current - previous)`` in :data:`METRICS` order, then perplexity, for every metric in
    ``current``; ``previous`` and the change are ``None`` when the previous
    eval lacks that metric. Both are :meth:`EvalScores.to_dict` dicts (0-100).

    Raises:
        ValueError: ``previous`` holds none of the metrics (not an eval result).
    """

    def number(scores: Mapping[str, Any], name: str) -> float | None:
        value = scores.get(name)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    if not any(number(previous, name) is not None for name in METRICS):
        raise ValueError(f"previous results hold none of the metrics {', '.join(METRICS)}; is it an eval result?")
    changes = []
    for name in (*METRICS, "perplexity"):
        cur = number(current, name)
        if cur is None:
            continue
        prev = number(previous, name)
        changes.append((name, prev, cur, None if prev is None else cur - prev))
    return changes
