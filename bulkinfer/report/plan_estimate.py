"""The time a run would take, as ``bulkinfer plan`` estimates it from the
calibration store (:mod:`bulkinfer.report.calibration`): a range of seconds,
never a single figure (see :func:`estimate`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bulkinfer.report.calibration import (
    MIN_COMPLETION_TOKENS,
    MIN_ROWS,
    RATE_SETTINGS,
    adequate,
    measured_here,
    speed_ratio,
)

# How many of the stored measurements (the newest) an estimate uses.
USE_NEWEST = 5


# The range widens the measured rates by this share both ways: repeated
# runs of one workload on one 2-core machine took 164 to 204 s (issue 17,
# sharegpt 300 rows) and measured 109 to 174 completion tokens/s
# (bench/results/eta.md against bench/results/sharegpt300-demo.report.json)
# when other processes shared the cores.
RATE_MARGIN = 0.25


ASSUMES = "every row generates its max_tokens; rows that stop early take less"


def describe(entry: dict[str, Any]) -> str:
    """One measurement in a line: what, when, how big, how fast."""
    what = "bulkinfer calibrate" if entry.get("source") == "calibrate" else f"run of {entry.get('output')}"
    return (
        f"{what}, {entry.get('measured_at')}: {entry.get('rows')} rows, "
        f"{entry.get('completion_tokens')} completion tokens, {entry.get('completion_tokens_per_s', 0):.1f} tok/s"
    )


def estimate(
    entries: list[dict[str, Any]],
    model_path: str,
    model: str,
    machine: dict[str, Any],
    completion_tokens: int,
    engine: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """The time a run of ``completion_tokens`` (the sum of its rows'
    ``max_tokens``) would take with model ``model_path`` on ``machine``
    with the engine settings ``engine`` (``dtype``, ``enforce_eager``;
    None or absent: not known before the run, as the compile choice made
    per job).

    Only ``entries`` of this model on this machine (same CPU model name,
    family and model, and core count) and of adequate size count; each one's completion tokens/s
    is taken at ``engine``'s known settings (divided by :func:`speed_ratio`
    where its own differ: on a Zen 5 bfloat16 generated 2.47x float32) and
    left out where that ratio was not measured here; the newest
    :data:`USE_NEWEST` of them are used. Generation, in seconds, is
    ``completion_tokens / rate`` with the rate taken from the spread of
    those rates widened by :data:`RATE_MARGIN`: low = tokens / (fastest x
    (1 + margin)), high = tokens / (slowest x (1 - margin)). Load is the
    range of their measured load seconds. Neither end is a bound: a busier
    machine is slower, and rows that stop before ``max_tokens`` finish sooner.

    Returns ``(estimate, why)``: the estimate (``generate_seconds`` and
    ``load_seconds`` as ``{"low", "high"}``, ``completion_tokens``,
    ``assumes``, ``derivation``, ``machine``, ``engine`` (the settings
    assumed), ``calibrations`` used and their ``rates`` at those settings
    (tokens/s, in the same order), ``ignored`` measurements of this model
    and machine that were too small, ``other_settings`` ones that could not
    be rescaled) and a sentence saying where it comes from; or
    ``(None, why)`` with why there is none.
    """
    engine = {k: (engine or {}).get(k) for k in RATE_SETTINGS}
    here = [e for e in entries if measured_here(e, model_path, machine)]
    small = [e for e in here if not adequate(e)]
    placed = [
        (e, _rate_at(e, engine, model_path, machine))
        for e in here
        if adequate(e) and e.get("completion_tokens_per_s", 0) > 0
    ]
    other = [e for e, rate in placed if rate is None]
    used = [(e, rate) for e, rate in placed if rate is not None][-USE_NEWEST:]
    cpu = ", ".join(str(part) for part in (machine.get("cpu"), machine.get("cpu_id")) if part)
    where = f"{model} on this machine ({cpu}, {machine.get('cores')} cores)"
    assumed = ", ".join(f"{k} {v}" for k, v in engine.items() if v is not None)
    at = f" at {assumed}" if assumed else ""
    unplaced = f"{len(other)} at other engine settings left out (no speed ratio between them measured here)"
    if not used:
        why = f"no estimate: no calibration of {where}{at}"
        if small:
            why += f" of at least {MIN_ROWS} rows and {MIN_COMPLETION_TOKENS} completion tokens (smaller runs ignored)"
        if other:
            why += f"; {unplaced}"
        return None, why + "; run `bulkinfer calibrate` to measure it"
    rates = [rate for _, rate in used]
    loads = [e.get("load_seconds", 0.0) for e, _ in used]
    rescaled = sum(rate != e["completion_tokens_per_s"] for e, rate in used)
    result = {
        "generate_seconds": {
            "low": completion_tokens / (max(rates) * (1 + RATE_MARGIN)),
            "high": completion_tokens / (min(rates) * (1 - RATE_MARGIN)),
        },
        "load_seconds": {"low": min(loads), "high": max(loads)},
        "completion_tokens": completion_tokens,
        "assumes": ASSUMES,
        "derivation": (
            f"{completion_tokens} completion tokens at {min(rates):.1f}-{max(rates):.1f} tok/s "
            f"(the measured rates{f', {rescaled} rescaled to {assumed}' if rescaled else ''}) "
            f"widened by {RATE_MARGIN:.0%} either way"
        ),
        "machine": machine,
        "engine": engine,
        "calibrations": [e for e, _ in used],
        "rates": rates,
        "ignored": small,
        "other_settings": other,
    }
    plural = "s" if len(used) > 1 else ""
    why = f"from {len(used)} calibration{plural} of {where}{at}"
    if small:
        why += f"; {len(small)} smaller run{'s' if len(small) > 1 else ''} ignored"
    if other:
        why += f"; {unplaced}"
    return result, why


def _rate_at(
    entry: dict[str, Any], engine: Mapping[str, Any], model_path: str, machine: dict[str, Any]
) -> float | None:
    """``entry``'s completion tokens/s at ``engine``'s settings where known
    (its own where not): None where they differ and no ratio was measured."""
    target = {k: entry.get(k) if engine.get(k) is None else engine[k] for k in RATE_SETTINGS}
    ratio = speed_ratio(entry, target, model_path, machine)
    return entry["completion_tokens_per_s"] / ratio if ratio else None
