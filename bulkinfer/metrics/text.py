"""Completions + references -> BLEU, chrF, ROUGE and exact match, on a 0-100 scale.

The scoring core of ``bulkinfer eval``: pure functions over strings, no files,
no engine. Golden rows are ordinary bulkinfer input rows with a ``reference``
field (a string, or a list of strings when a row has several references).

Where each number comes from:

- ``bleu``: corpus BLEU, ``sacrebleu.metrics.BLEU()`` with its defaults
  (``tok:13a``, ``smooth:exp``, mixed case) -- the same as
  ``sacrebleu.corpus_bleu``. Per row: ``sacrebleu.sentence_bleu`` (effective
  order on, as sacrebleu recommends for sentences).
- ``chrf``: corpus chrF2, ``sacrebleu.metrics.CHRF()`` with its defaults -- the
  same as ``sacrebleu.corpus_chrf``.
- ``rouge1``, ``rouge2``, ``rougeL``, ``rougeLsum``: F1 from Google's
  ``rouge-score`` package (``RougeScorer(..., use_stemmer=True)``, Porter
  stemming), best reference per row (``RougeScorer.score_multi``: highest F1
  per ROUGE type), mean over rows, times 100. ``rougeLsum`` splits both texts
  into sentences on ``"\\n"`` (the package's ``split_summaries=False``
  behaviour); the texts are passed unchanged, so a completion without newlines
  is a single sentence and its ROUGE-Lsum equals its ROUGE-L.
- ``exact_match``: 100 when the completion equals any reference after
  ``str.strip()``, else 0; mean over rows.
- ``ci``: 95% confidence intervals by bootstrap resampling over rows (Koehn
  2004, "Statistical Significance Tests for Machine Translation Evaluation"):
  the same resampled row indices serve every metric, so the intervals are
  paired across metrics, and across runs with the same seed and row count.

The rouge-score tokenizer lowercases and keeps only ASCII letters and digits
(``[a-z0-9]+``); every other character is a token boundary and is dropped. On
Chinese, Russian, Arabic... references ROUGE is therefore close to 0 whatever
the completions are: :func:`score` says so in ``notes`` and warns in
``warnings`` when most reference letters are not Latin.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Any, cast

from bulkinfer.metrics.bootstrap import bootstrap_ci

#: The corpus metrics, in report order; all on a 0-100 scale.
METRICS = ("bleu", "chrf", "rouge1", "rouge2", "rougeL", "rougeLsum", "exact_match")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
#: The per-row scores ``bulkinfer eval`` writes into each scored record (:func:`score_rows`).
ROW_FIELDS = ("bleu", "rougeL", "exact_match")
#: Default bootstrap seed: sacrebleu's own default (``SACREBLEU_SEED=12345``).
DEFAULT_SEED = 12345
#: ``warnings`` gets the non-Latin warning when more than this share of the
#: references' letters are not Latin letters.
NON_LATIN_WARN_SHARE = 0.5

ROUGE_TOKENIZER_NOTE = (
    "ROUGE (rouge-score): the tokenizer lowercases and keeps only ASCII letters and digits [a-z0-9]; "
    "accented and non-Latin letters, CJK characters and punctuation are dropped as token boundaries; "
    "Porter stemming on; ROUGE-Lsum splits sentences on newlines; "
    "F1 of the best reference per row, mean over rows."
)


class InvalidReference(ValueError):
    """A golden row's ``reference`` is missing or not a string / non-empty list of strings.

    ``type`` is the row error type (``missing_field`` or ``invalid_field``), as
    in :class:`bulkinfer.prep.rows.RowError`.
    """

    def __init__(self, type_: str, message: str):
        super().__init__(message)
        self.type = type_
        self.message = message


@dataclass(frozen=True, slots=True)
class EvalScores:
    """Corpus scores of one set of completions against their references.

    All metric values are on a 0-100 scale. ``signatures`` holds sacrebleu's
    signature strings (``nrefs``, case, tokenizer, smoothing, version) for
    ``bleu`` and ``chrf``; ``nrefs:var`` means rows have different numbers of
    references. ``rows`` is the number of rows scored, ``references`` the number
    of reference strings. ``ci`` maps each metric to its 95% interval
    ``[low, high]`` when ``bootstrap`` resamples were drawn (with ``seed``),
    else it is ``None``. ``warnings`` are things the reader must know to trust
    the numbers; ``notes`` describe how they were computed.
    """

    bleu: float
    chrf: float
    rouge1: float
    rouge2: float
    rougeL: float
    rougeLsum: float
    exact_match: float
    signatures: Mapping[str, str]
    rows: int
    references: int
    bootstrap: int = 0
    seed: int | None = None
    ci: Mapping[str, tuple[float, float]] | None = None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(ROUGE_TOKENIZER_NOTE,))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the metrics at top level (as :func:`check_fail_under`
        and :func:`compare` read them), then ``signatures``, ``rows``,
        ``references``, ``bootstrap`` {``samples``, ``seed``, ``confidence``}
        and ``ci`` when resampled, ``warnings`` and ``notes``."""
        out: dict[str, Any] = {name: getattr(self, name) for name in METRICS}
        out["signatures"] = dict(self.signatures)
        out["rows"] = self.rows
        out["references"] = self.references
        if self.ci is not None:
            out["bootstrap"] = {"samples": self.bootstrap, "seed": self.seed, "confidence": 95}
            out["ci"] = {name: [low, high] for name, (low, high) in self.ci.items()}
        out["warnings"] = list(self.warnings)
        out["notes"] = list(self.notes)
        return out


def references_of(value: Any) -> list[str]:
    """A golden row's ``reference`` field as a list of reference strings.

    Accepts a string (one reference) or a non-empty list of strings (several
    references; an empty string is kept as a genuinely empty reference).

    Raises:
        InvalidReference: the field is missing (``None``), or is not a string
            or a non-empty list of strings.
    """
    if value is None:
        raise InvalidReference(
            "missing_field", "row needs a 'reference' field (a string, or a list of strings for several references)"
        )
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        if not value:
            raise InvalidReference("invalid_field", "field 'reference': expected a string or a non-empty list, got []")
        for i, ref in enumerate(value):
            if not isinstance(ref, str):
                raise InvalidReference("invalid_field", f"field 'reference[{i}]': expected a string, got {_shown(ref)}")
        return list(value)
    raise InvalidReference(
        "invalid_field", f"field 'reference': expected a string or a non-empty list of strings, got {_shown(value)}"
    )


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def reference_streams(references: Sequence[Sequence[str]]) -> list[list[str | None]]:
    """Per-row references -> sacrebleu's reference *streams*.

    ``references[i]`` are the references of row ``i``; the result has one
    stream per reference position, ``max(len(refs))`` streams of ``len(references)``
    entries each, where stream ``k`` holds every row's ``k``-th reference or
    ``None`` when the row has fewer than ``k + 1``.

    ``None`` is sacrebleu's placeholder for "no reference here"
    (``Metric._cache_references`` in sacrebleu/metrics/base.py drops it:
    ``lines = [x for x in refs if x is not None]``, and the signature then
    reads ``nrefs:var``). The README's "Variable Number of References" section
    also mentions ``''``, but sacrebleu 2.x keeps ``''`` as a real, empty
    reference: it can become BLEU's closest reference length (brevity penalty
    1) and the signature stays ``nrefs:N``. So padding is ``None``, never ``''``.
    """
    width = max((len(refs) for refs in references), default=0)
    return [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]


@lru_cache(maxsize=1)
def _rouge_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True, split_summaries=False)


def _rouge_f1(prediction: str, references: Sequence[str]) -> dict[str, float]:
    """ROUGE F1 (0-1) per type, each from the reference with the highest F1 of that type."""
    best = _rouge_scorer().score_multi(list(references), prediction)
    return {name: best[name].fmeasure for name in ROUGE_TYPES}


def _exact_match(prediction: str, references: Sequence[str]) -> float:
    stripped = prediction.strip()
    return 100.0 if any(stripped == ref.strip() for ref in references) else 0.0


def _rouge_rows(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[dict[str, float]]:
    """Per row (checked references): the four ROUGE F1 and exact match, 0-100."""
    return [
        {**{name: 100.0 * f1 for name, f1 in _rouge_f1(p, r).items()}, "exact_match": _exact_match(p, r)}
        for p, r in zip(predictions, references, strict=True)
    ]


def score_rows(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[dict[str, float]]:
    """Each row's scores against its references, 0-100: ``bleu``
    (``sacrebleu.sentence_bleu``: 13a tokens, exp smoothing, effective
    order), ``rouge1``, ``rouge2``, ``rougeL`` and ``rougeLsum`` (rouge-score
    F1 with Porter stemming, best reference) and ``exact_match`` (100 when the
    stripped completion equals a stripped reference, else 0). Given to
    :func:`score` as its ``rows``, ROUGE is computed once per row (the
    costliest metric: a pass over 200 ShareGPT answers took 6-7 s on a 2-core
    AMD EPYC Zen 3, of 21-26 s for ``bulkinfer eval --predictions``).

    Raises:
        ValueError: ``predictions`` and ``references`` differ in length, a
            row's references are empty or a bare string, or a value is not a
            string.
    """
    import sacrebleu

    _check_lengths(predictions, references)
    refs = [_check_row(p, r, f"row {i}") for i, (p, r) in enumerate(zip(predictions, references, strict=True))]
    rows = _rouge_rows(predictions, refs)
    for row, p, r in zip(rows, predictions, refs, strict=True):
        row["bleu"] = sacrebleu.sentence_bleu(p, r).score
    return rows


def row_scores(prediction: str, references: Sequence[str]) -> dict[str, float]:
    """One completion's :data:`ROW_FIELDS` of :func:`score_rows`, 0-100.

    Raises:
        ValueError: ``references`` is empty or is a bare string.
    """
    row = score_rows([prediction], [references])[0]
    return {name: row[name] for name in ROW_FIELDS}


def _check_lengths(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} rows of references")


def _check_row(prediction: Any, references: Any, where: str) -> list[str]:
    if not isinstance(prediction, str):
        raise ValueError(f"{where}: prediction must be a string, got {_shown(prediction)}")
    if isinstance(references, str) or not isinstance(references, Sequence):
        raise ValueError(f"{where}: references must be a list of strings, got {_shown(references)}")
    if not references:
        raise ValueError(f"{where}: no references")
    if not all(isinstance(ref, str) for ref in references):
        raise ValueError(f"{where}: references must be strings, got {_shown(references)}")
    return list(references)


def score(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    bootstrap: int = 0,
    seed: int = DEFAULT_SEED,
    rows: Sequence[Mapping[str, float]] | None = None,
) -> EvalScores:
    """Corpus BLEU, chrF, ROUGE and exact match of ``predictions`` (0-100).

    Args:
        predictions: one completion per row (``""`` for an empty one).
        references: ``references[i]`` is the non-empty list of references of
            row ``i``; rows may have different numbers of references (padded
            with ``None`` into sacrebleu's streams, see :func:`reference_streams`).
        bootstrap: number of bootstrap resamples for 95% confidence intervals
            (0: none; 1000 is usual). Each resample draws ``len(predictions)``
            row indices with replacement (:func:`bulkinfer.metrics.bootstrap.resample_indices`) and
            recomputes every corpus metric on it -- BLEU and chrF from their
            summed sacrebleu sufficient statistics, as sacrebleu's own
            bootstrap does, ROUGE and exact match as the mean of the resampled
            rows' scores; the interval is the 2.5th and 97.5th percentile.
        seed: seed of ``numpy.random.default_rng`` for the resampling.
        rows: :func:`score_rows` of the same predictions and references,
            whose ROUGE and exact match are used instead of computing them
            again; None: computed here.

    Raises:
        ValueError: no rows, ``predictions`` and ``references`` differ in
            length, a row has no references, a value is not a string,
            ``bootstrap`` is negative, or ``rows`` are not one per prediction.
    """
    from sacrebleu.metrics import BLEU, CHRF

    _check_lengths(predictions, references)
    if not predictions:
        raise ValueError("nothing to score: no rows")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be 0 (off) or a number of resamples, got {bootstrap}")
    preds = list(predictions)
    refs = [_check_row(p, r, f"row {i}") for i, (p, r) in enumerate(zip(preds, references, strict=True))]
    # sacrebleu's type hints omit the None placeholder its docs and code accept.
    streams = cast("list[list[str]]", reference_streams(refs))

    bleu, chrf = BLEU(), CHRF()
    bleu_score = bleu.corpus_score(preds, streams).score
    chrf_score = chrf.corpus_score(preds, streams).score
    signatures = {"bleu": bleu.get_signature().format(), "chrf": chrf.get_signature().format()}

    if rows is not None and len(rows) != len(preds):
        raise ValueError(f"{len(rows)} rows of scores for {len(preds)} predictions")
    scored = _rouge_rows(preds, refs) if rows is None else rows
    per_row = {name: [row[name] for row in scored] for name in (*ROUGE_TYPES, "exact_match")}
    means = {name: math.fsum(values) / len(values) for name, values in per_row.items()}

    ci = None
    if bootstrap:
        ci = bootstrap_ci(METRICS, preds, streams, per_row, bootstrap, seed)

    warnings = []
    share = non_latin_share(ref for row in refs for ref in row)
    if share > NON_LATIN_WARN_SHARE:
        warnings.append(
            f"{100 * share:.0f}% of the reference letters are not Latin: rouge-score's tokenizer keeps only "
            "ASCII letters and digits, so ROUGE is near 0 and meaningless here; use chrF instead (BLEU's 13a "
            "tokenizer splits only at spaces and punctuation: CJK text, which has no spaces, scores near 0 too)"
        )
    return EvalScores(
        bleu=bleu_score,
        chrf=chrf_score,
        rouge1=means["rouge1"],
        rouge2=means["rouge2"],
        rougeL=means["rougeL"],
        rougeLsum=means["rougeLsum"],
        exact_match=means["exact_match"],
        signatures=signatures,
        rows=len(preds),
        references=sum(len(r) for r in refs),
        bootstrap=bootstrap,
        seed=seed if bootstrap else None,
        ci=ci,
        warnings=tuple(warnings),
    )


def non_latin_share(texts: Iterable[str]) -> float:
    """The share (0-1) of letters in ``texts`` that are not Latin letters
    (Unicode name not starting with ``LATIN``): CJK, Cyrillic, Arabic... 0.0
    when there are no letters."""
    letters = non_latin = 0
    for text in texts:
        for ch in text:
            if ch.isalpha():
                letters += 1
                if not ch.isascii() and not unicodedata.name(ch, "").startswith("LATIN"):
                    non_latin += 1
    return non_latin / letters if letters else 0.0


def metrics_versions() -> dict[str, str]:
    """The installed versions of the packages the scores depend on:
    ``{"sacrebleu": ..., "rouge-score": ..., "numpy": ...}`` (``"not installed"``
    when one is missing)."""
    versions = {}
    for package in ("sacrebleu", "rouge-score", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions
