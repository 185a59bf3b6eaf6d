"""Paired bootstrap resampling of rows: 95% intervals for corpus metrics
(sacrebleu's method, on summed sufficient statistics) and row means."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any


def resample_indices(rows: int, bootstrap: int, seed: int) -> Iterator[Any]:
    """The row indices of each bootstrap resample: ``bootstrap`` int arrays of
    length ``rows``, drawn with replacement by ``numpy.random.default_rng(seed)``.
    The same ``rows``, ``bootstrap`` and ``seed`` give the same resamples."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for _ in range(bootstrap):
        yield rng.integers(0, rows, size=rows)


def bootstrap_ci(
    metrics: Sequence[str],
    preds: list[str],
    streams: list[list[str]],
    per_row: Mapping[str, Sequence[float]],
    bootstrap: int,
    seed: int,
) -> dict[str, tuple[float, float]]:
    """95% intervals of each of ``metrics`` over ``bootstrap`` resamples of the rows.

    BLEU and chrF are corpus statistics, not means: each resample sums the
    rows' sufficient statistics (n-gram matches, lengths) weighted by how often
    the row was drawn, and sacrebleu turns the sums into a score -- the method
    of sacrebleu's ``significance._bootstrap_resample``, on its
    ``_extract_corpus_statistics`` / ``_compute_score_from_stats`` (with exact
    integer sums where sacrebleu uses float32).
    """
    import numpy as np
    from sacrebleu.metrics import BLEU, CHRF

    rows = len(preds)
    corpus_metrics = {"bleu": BLEU(), "chrf": CHRF()}
    stats = {
        name: np.asarray(metric._extract_corpus_statistics(preds, streams), dtype=np.int64)
        for name, metric in corpus_metrics.items()
    }
    row_values = {name: np.asarray(values, dtype=np.float64) for name, values in per_row.items()}
    samples: dict[str, list[float]] = {name: [] for name in metrics}
    for idx in resample_indices(rows, bootstrap, seed):
        counts = np.bincount(idx, minlength=rows)
        for name, metric in corpus_metrics.items():
            summed = (counts @ stats[name]).tolist()
            samples[name].append(metric._compute_score_from_stats(summed).score)
        for name, values in row_values.items():
            samples[name].append(float(counts @ values) / rows)
    ci = {}
    for name in metrics:
        low, high = np.percentile(np.asarray(samples[name]), [2.5, 97.5])
        ci[name] = (float(low), float(high))
    return ci
