"""Ranking measures for ``bulkinfer eval-rank``: measure names checked up
front, bars on the 0-1 scale, and the values from ``ir-measures``.

Only ir-measures' providers that compute in this process are used
(``pytrec_eval``, the C implementation of ``trec_eval``, for most measures;
``msmarco`` for ``RR@k``). A provider that runs a program outside Python
(ir-measures' ``gdeval``: a perl script that needs numeric query ids) is
left out, so a measure only it computes (``ERR@k``) is refused before any
model loads, as is a cutoff below 1 (``pytrec_eval`` aborts the process on
``P@0``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bulkinfer.errors import ConfigError
from bulkinfer.metrics.bars import add_bar

EXAMPLES = "e.g. nDCG@10, RR@10, R@10"


def _in_process(provider: Any) -> bool:
    """Whether an ir-measures provider computes in this process: what its
    install instructions ask for is a pip package or nothing, not a program
    (gdeval's: "Install perl")."""
    instructions = provider.install_instructions()
    return not instructions or str(instructions).startswith("pip ")


def provider() -> Any:
    """ir-measures' default pipeline without the providers that run an
    external program: an ``ir_measures.providers.FallbackProvider`` that
    picks, for each measure, the first available provider that supports it."""
    import ir_measures
    from ir_measures.providers import FallbackProvider

    return FallbackProvider([p for p in ir_measures.DefaultPipeline.providers if _in_process(p)])


def parse_measures(names: Sequence[str]) -> list[Any]:
    """ir-measures' measure objects for ``names`` (``"nDCG@10"``, ``"MRR@10"``, ...),
    each one that :func:`provider` can compute.

    Raises:
        ConfigError: none given; a name ir-measures does not parse (its
            message); a cutoff below 1; a measure no in-process provider
            computes (naming the providers that would, as ir-measures does).
    """
    import ir_measures

    if not names:
        raise ConfigError(f"--measure: give at least one measure, {EXAMPLES}")
    computes = provider()
    measures = []
    for name in names:
        try:
            measure = ir_measures.parse_measure(name)
            measure.validate_params()
        except (ValueError, NameError, TypeError, SyntaxError, AssertionError) as exc:
            raise ConfigError(f"--measure: {name!r} is not an ir-measures measure ({exc}); {EXAMPLES}") from None
        cutoff = measure.params.get("cutoff")
        if isinstance(cutoff, int | float) and cutoff < 1:
            raise ConfigError(f"--measure: {name!r}: the cutoff must be 1 or more (the documents ranked first)")
        if not computes.supports(measure):
            others = [
                f"{p.NAME}: runs an external program, which bulkinfer does not"
                if p.is_available()
                else f"{p.NAME}: not installed ({p.install_instructions()})"
                for p in ir_measures.DefaultPipeline.providers
                if p.supports(measure)
            ]
            needs = f" (only {'; '.join(others)})" if others else ""
            raise ConfigError(f"--measure: {name!r}: no ir-measures provider here computes it{needs}; {EXAMPLES}")
        measures.append(measure)
    return measures


def parse_rank_bars(spec: str, measures: Sequence[Any]) -> dict[str, float]:
    """``"nDCG@10=0.5,RR@10=0.6"`` -> ``{"nDCG@10": 0.5, "RR@10": 0.6}``
    (bars on the 0-1 scale, each a measure of ``measures``, by its canonical name).

    Raises:
        ConfigError: bad syntax, a measure not among ``measures``, a measure
            given twice (``MRR@10`` is ``RR@10``), or a bar outside 0-1.
    """
    known = {str(m): str(m) for m in measures}
    bars: dict[str, float] = {}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        name, sep, raw = (part.strip() for part in item.partition("="))
        canonical = known.get(str(parse_measures([name])[0])) if sep and name else None
        if canonical is None:
            raise ConfigError(
                f"--fail-under: {item!r} is not MEASURE=BAR with a measure of --measure ({', '.join(known)})"
            )
        add_bar(bars, canonical, raw, 1.0)  # a FailUnderError is a ConfigError
    if not bars:
        raise ConfigError(f"--fail-under: expected MEASURE=BAR[,...], got {spec!r}")
    return bars


def rank_measures(
    golden: Mapping[str, Mapping[int, int]], rankings: Mapping[str, list[int]], measures: Sequence[Any]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The mean of each measure over the ids of ``rankings`` (all in
    ``golden``), and each id's own values, by measure name, from
    :func:`provider` (qrels: ``golden``'s grades; run: each ranking in order,
    minus the position as the score)."""
    import ir_measures

    qrels = [ir_measures.Qrel(qid, str(k), grade) for qid in rankings for k, grade in golden[qid].items()]
    run = [
        ir_measures.ScoredDoc(qid, str(k), -float(pos))
        for qid, ranked in rankings.items()
        for pos, k in enumerate(ranked)
    ]
    per_query: dict[str, dict[str, float]] = {qid: {} for qid in rankings}
    for metric in provider().iter_calc(measures, qrels, run):
        per_query[metric.query_id][str(metric.measure)] = float(metric.value)
    means = {str(m): sum(values.get(str(m), 0.0) for values in per_query.values()) / len(per_query) for m in measures}
    return means, per_query


def versions() -> dict[str, str]:
    """The versions of the libraries that computed the measures."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("ir-measures", "pytrec-eval-terrier"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found
