"""``bulkinfer eval``: run a golden set through the model (or take existing
predictions) and score the completions against the references.

Golden rows are ordinary input rows with a ``reference`` (a string or a list
of strings). Generation goes through :func:`bulkinfer.jobs.run.run`, so resume,
per-row errors, the lock and the run report behave exactly as for ``run``.
Scoring reads the predictions and references into memory (golden sets are
thousands of rows, not millions).

Files: ``OUT`` (the predictions with per-row ``bleu``, ``rougeL``,
``exact_match`` and, with ``--perplexity``, ``perplexity``; with
``--predictions``, only the scored ones) and ``OUT.eval.json`` (corpus
scores, signatures, the model and settings that produced the predictions,
row counts, the scored row set, library versions).

The settings recorded are those that really produced the predictions: this
eval's own generation, or the ``PRED.report.json`` beside ``--predictions``
when it exists; otherwise they are recorded as unknown, never as today's
defaults.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.base import KeptEngine
from bulkinfer.engine.log import EngineLog
from bulkinfer.errors import (
    EXIT_BELOW_BAR,
    EXIT_OK,
    EXIT_PARTIAL,
    ConfigError,
    EngineError,
    InputFileError,
    ModelError,
    OutputExistsError,
    write_error,
)
from bulkinfer.fields import is_int
from bulkinfer.io import formats
from bulkinfer.io.files import JsonlAppender, publish
from bulkinfer.io.output_files import OutputFiles, RunPaths
from bulkinfer.io.predictions import Predictions, check_apart, first_predictions, read_predictions
from bulkinfer.io.readers import RawRow, open_reader
from bulkinfer.io.records import read_json_file
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.perplexity import ReferenceNLL, reference_nll
from bulkinfer.jobs.run import RunReport, make_output_dir, run
from bulkinfer.metrics import bars
from bulkinfer.metrics import text as evaluate
from bulkinfer.models import resolve_model
from bulkinfer.prep.rows import parse_row, to_request
from bulkinfer.report.eval_view import UNKNOWN, write_eval_html
from bulkinfer.report.stats import write_report
from bulkinfer.schema import Request, RowInvalid


@dataclass(slots=True)
class GoldenRow:
    """One golden row: its id, line, references and (for perplexity) its request."""

    id: str
    line: int
    references: list[str]
    request: Request


@dataclass(frozen=True, slots=True)
class EvalResult:
    report: dict[str, Any]
    exit_code: int
    below_bar: list[str]


def eval_path(out: Path) -> Path:
    """``res/out.jsonl`` -> ``res/out.eval.json``."""
    return formats.sibling(out, ".eval.json")


def read_golden(path: Path, settings: Settings) -> tuple[list[GoldenRow], list[dict[str, Any]]]:
    """Golden rows in file order, and the rows that cannot be scored (bad
    row, missing or invalid ``reference``, an id of an earlier row) as
    ``{"line", "id", "error"}``. As ``run`` fails them: the first row of an
    id (a row with bad fields included) is its row, later ones are
    duplicates, so the first wins everywhere.

    Raises:
        InputFileError: the file cannot be read.
    """
    rows: list[GoldenRow] = []
    invalid: list[dict[str, Any]] = []
    seen: set[str] = set()
    for seq, raw in enumerate(open_reader(path)):
        try:
            if raw.error is not None:
                raise raw.error
            request = to_request(raw.data, seq, raw.line, settings)
            if request.id in seen:
                raise RowInvalid("duplicate_id", f"id '{request.id}' already appeared earlier in the file", request.id)
            references = evaluate.references_of(raw.data.get("reference"))
            seen.add(request.id)  # a row without a usable reference claims no id: run fails it before its id is seen
        except RowInvalid as exc:
            if raw.error is None and exc.row_id is not None and exc.type != "duplicate_id":
                seen.add(exc.row_id)
            invalid.append({"line": raw.line, "id": exc.row_id, "error": exc.message})
            continue
        except evaluate.InvalidReference as exc:
            invalid.append({"line": raw.line, "id": request.id, "error": str(exc)})
            continue
        rows.append(GoldenRow(request.id, raw.line, references, request))
    return rows, invalid


def reference_error(raw: RawRow, settings: Settings) -> RawRow:
    """``raw``, or an error row (``missing_field`` / ``invalid_field``, with
    the row's id) when it is a valid input row without a usable ``reference``:
    such a row is not generated, it is a row error in ``OUT.errors.jsonl``."""
    if raw.error is not None:
        return raw
    try:
        request = parse_row(raw.data, 0, raw.line, settings.sampling)
    except RowInvalid:
        return raw  # the run reports what is wrong with the row itself
    try:
        evaluate.references_of(raw.data.get("reference"))
    except evaluate.InvalidReference as exc:
        return RawRow(raw.line, error=RowInvalid(exc.type, exc.message, request.id, request.openai_url is not None))
    return raw


def check_golden(golden: Path, settings: Settings) -> None:
    """Check, before any model loads, that some row of ``golden`` can be scored.

    Raises:
        InputFileError: the file is missing or unreadable (as
            :func:`bulkinfer.io.readers.open_reader`), has no rows, no row it
            can read (the first row's error quoted), or no row with a usable ``reference``.
    """
    if not golden.exists() and not golden.is_symlink():
        raise InputFileError(f"golden file not found: {golden}")
    rows = 0
    unread: list[str] = []  # the rows that are not even rows (not JSON, ...)
    for raw in open_reader(golden):
        rows += 1
        if raw.error is not None:
            unread.append(raw.error.message)
        elif reference_error(raw, settings) is raw:
            return
    if not rows:
        raise InputFileError(f"golden file {golden} has no rows: nothing to score")
    if len(unread) == rows:
        raise InputFileError(
            f"golden file {golden}: none of its {rows} rows can be read ({unread[0]}), so nothing can be scored"
        )
    raise InputFileError(
        f"golden file {golden}: none of its {rows} rows has a usable 'reference' field (a string, or a list "
        "of strings), so nothing can be scored; add one to each row, or use `bulkinfer run` to only generate"
    )


def generation_of(predictions: Path) -> dict[str, Any]:
    """What produced an existing predictions file, from the run report beside
    it (``PRED.report.json``, as ``run`` writes it): ``{"source": that
    report's path, "model", "model_path", "sampling", "sampling_set_by_rows",
    "engine", "chat_template_applied"}``. Without a readable report every value is
    ``"unknown"`` and ``source`` is None."""
    path = formats.sibling(predictions, ".report.json")
    try:
        report = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        report = None
    if not isinstance(report, dict):
        return {"source": None, **dict.fromkeys(GENERATION_KEYS, UNKNOWN)}
    return {"source": str(path), **{key: report.get(key, UNKNOWN) for key in GENERATION_KEYS}}


# the fields eval writes into each scored record (metrics.text.ROW_FIELDS, jobs.perplexity.ReferenceNLL.row_fields)
ROW_SCORE_FIELDS = frozenset({*evaluate.ROW_FIELDS, "perplexity", "perplexity_error"})
GENERATION_KEYS = ("model", "model_path", "sampling", "sampling_set_by_rows", "engine", "chat_template_applied")


def row_set(ids: list[str]) -> dict[str, Any]:
    """Which rows an eval scored, small enough to store: their ``count`` and
    ``ids_sha256``, the SHA-256 of the sorted ids joined by newlines."""
    digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()
    return {"count": len(ids), "ids_sha256": digest}


@dataclass(frozen=True, slots=True)
class EvalOptions:
    """What ``bulkinfer eval`` does beyond generating: ``predictions`` (score
    this existing output instead of generating), ``perplexity`` (also each
    reference's perplexity given its prompt), ``bootstrap`` (paired
    resamples for 95% intervals; 0: none) and ``fail_under`` (metric ->
    bar: exit code 8 below it)."""

    predictions: Path | None = None
    perplexity: bool = False
    bootstrap: int = 0
    fail_under: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        """Raises: ConfigError: ``bootstrap`` is not an integer >= 0."""
        if self.predictions is not None:  # a str from a caller of bulkinfer.evaluate
            object.__setattr__(self, "predictions", Path(self.predictions))
        if not is_int(self.bootstrap) or self.bootstrap < 0:
            raise ConfigError(
                f"--bootstrap: expected 0 (no intervals) or a number of resamples, got {self.bootstrap!r}"
            )


def run_eval(
    golden: Path,
    out: Path,
    settings: Settings,
    context: RunContext | None = None,
    options: EvalOptions = EvalOptions(),
) -> EvalResult:
    """Generate (unless ``options.predictions`` is given), score, and write
    ``OUT`` and ``OUT.eval.json``. The exit code is :data:`EXIT_BELOW_BAR`
    when a metric is below its ``fail_under`` bar, else the generation's (0,
    or 3 when some rows failed; failed rows are listed as unmatched and not
    scored; with ``predictions``, 3 when some golden rows are invalid). The
    engine's log is appended to ``OUT.log`` unless ``context.verbose`` (see
    :mod:`bulkinfer.engine.log`).

    Golden rows without a usable ``reference`` are row errors in
    ``OUT.errors.jsonl`` and are not generated; the others are scored.

    With ``predictions``, ``OUT`` holds only the scored records (the first
    record of each golden id, in the predictions' order); predictions
    without a golden row, golden rows without a prediction, and records
    without an id or completion or of an id already seen are counted in
    ``row_counts`` and not scored. The report's ``generation`` is what
    produced the predictions (:func:`generation_of`); ``settings`` is None then.

    Raises:
        the errors of :func:`bulkinfer.jobs.run.run`; InputFileError, before
        any file is written or model loaded, when no golden row has a
        ``reference``, and for a missing, unreadable or mis-shaped
        predictions file (naming the line); ConfigError when ``OUT`` or a
        file beside it is the predictions file, when no prediction
        matches a golden id, and for ``--resume`` with ``predictions``.
    """
    started = time.monotonic()
    context = context or RunContext()
    paths = RunPaths.build(golden, out)
    check_apart(options.predictions, out, (eval_path(out), scored_spool(out)))
    if options.predictions is not None and context.resume:
        raise ConfigError(
            "--resume continues a generation; --predictions generates nothing: to score again, --overwrite"
        )
    check_golden(golden, settings)  # before any file is written or model loaded
    model_path = resolve_model(settings.model)  # likewise: a model that cannot be found fails here
    engines = KeptEngine(context.engine_factory)  # the perplexity pass reuses the generation's engine
    if options.perplexity and not context.engine_outlives_run:  # a shared engine is reused as it is
        context = context.replace(engine_factory=engines)
    make_output_dir(out, eval_path(out), paths.html)  # OUT's directory, for the log opened next
    # appended to: opened before the generation checks that it may write OUT
    quiet = context.verbose or context.engine_outlives_run
    with EngineLog(OutputFiles(out).log, quiet, append=True) as log:
        try:
            generated = _generate(paths, settings, context, options.predictions)
            tokenizer = context.tokenizer_factory(model_path, settings.engine.trust_remote_code)
            settings = settings.resolve_chat_template(tokenizer)  # as the generation decided
            rows, invalid = read_golden(golden, settings)
            predictions = options.predictions or out
            records = read_predictions(predictions)
            found = first_predictions(predictions, records)
            by_id = found.by_id
            matched = [row for row in rows if row.id in by_id]
            if not matched:
                raise ConfigError(f"no prediction in {predictions} matches an id of {golden}")
            texts = [by_id[row.id][1] for row in matched]
            references = [row.references for row in matched]
            scored = evaluate.score_rows(texts, references)  # ROUGE once per row, for the records and the corpus
            scores = evaluate.score(texts, references, bootstrap=options.bootstrap, rows=scored)
            per_row = {row.id: {k: s[k] for k in evaluate.ROW_FIELDS} for row, s in zip(matched, scored, strict=True)}
            nll = ReferenceNLL()
            if options.perplexity:
                pairs = [(row.request, row.references[0]) for row in matched]
                engine = engines.get(model_path, settings)
                nll = reference_nll(pairs, tokenizer, engine, settings, context.progress_plain, context.stop)
            scored_index = {index: row_id for row_id, (index, _) in by_id.items() if row_id in per_row}
            records = without(records, ROW_SCORE_FIELDS)  # an earlier scoring's: the rows scored now get theirs
            for index, row_id in scored_index.items():  # the first record of each id gets the scores
                records[index] = {**records[index], **per_row[row_id], **nll.row_fields(row_id)}
            if generated is None:  # OUT is what was scored; a run's output keeps every row, for --resume
                records = [records[index] for index in sorted(scored_index)]
            write_records(paths, records)

            corpus = {**scores.to_dict(), **(nll.corpus_fields() if options.perplexity else {})}
            below = bars.check_fail_under(corpus, options.fail_under) if options.fail_under else []
            if generated is not None:
                generation = {"source": str(paths.report), **{k: generated.report.get(k) for k in GENERATION_KEYS}}
            else:
                generation = generation_of(predictions)
            golden_ids = {row.id for row in rows} | {row["id"] for row in invalid}  # invalid: not unmatched
            unmatched_golden = [row.id for row in rows if row.id not in by_id]
            report = {
                "golden": str(golden),
                "predictions": str(predictions),
                "output": str(out),
                "model": generation["model"] if generated is None else settings.model or DEFAULT_MODEL,
                "model_path": generation["model_path"] if generated is None else model_path,
                "generation": generation,
                "scores": corpus,
                "row_counts": {
                    "golden": len(rows) + len(invalid),
                    "predictions": len(by_id),
                    "scored": len(matched),
                    "unmatched": {"golden": len(unmatched_golden), "predictions": len(set(by_id) - golden_ids)},
                    "unmatched_golden": unmatched_golden,
                    "unmatched_predictions": sorted(set(by_id) - golden_ids),
                    "invalid_golden": invalid,
                    **_dropped(found),
                },
                "row_set": row_set([row.id for row in matched]),
                "fail_under": {"bars": dict(options.fail_under or {}), "below": below},
                # the settings of this eval's generation; with --predictions, see "generation"
                "settings": settings.to_dict() if generated is not None else None,
                "perplexity_model_path": model_path if options.perplexity else None,
                "metrics_version": evaluate.metrics_versions(),
                "run_report": str(paths.report) if generated is not None and generated.report else None,
                "seconds": time.monotonic() - started,
            }
            write_report(report, eval_path(out))
            write_eval_html(report, generated.report if generated is not None else {}, records, paths.html)
            # a metric below its bar is what a nightly job must see first; then failed rows
            run_code = generated.exit_code if generated is not None else EXIT_PARTIAL if invalid else EXIT_OK
            return EvalResult(report, EXIT_BELOW_BAR if below else run_code, below)
        except (EngineError, ModelError) as exc:
            raise log.explain(exc) from exc
        except OSError as exc:  # the scored rows, OUT.eval.json or the page cannot be written
            raise write_error(exc) from exc
        finally:
            engines.close()


def _generate(paths: RunPaths, settings: Settings, context: RunContext, predictions: Path | None) -> RunReport | None:
    """The eval's generation (:func:`bulkinfer.jobs.run.run`, golden rows
    without a reference failed as row errors); None when ``predictions`` are
    given (then ``OUT`` must not exist, unless ``context.overwrite``).

    Raises:
        OutputExistsError: ``predictions`` given and ``OUT`` exists without overwrite.
        the errors of :func:`bulkinfer.jobs.run.run`.
    """
    if predictions is None:
        return run(paths, settings, context, check_row=lambda raw: reference_error(raw, settings))
    if paths.output.exists() and not context.overwrite:
        raise OutputExistsError(f"output {paths.output} already exists; use --overwrite to replace it")
    return None


def _dropped(found: Predictions) -> dict[str, int]:
    """The row counts of prediction records not scored for their own shape:
    ``unusable_predictions`` (no id or no completion text) and
    ``duplicate_predictions`` (an id of an earlier record)."""
    return {"unusable_predictions": found.unusable, "duplicate_predictions": found.duplicates}


def scored_spool(out: Path) -> Path:
    """Where :func:`write_records` writes ``out`` before publishing it."""
    return out.with_name(f".{out.name}.scored.jsonl")


def without(records: list[dict[str, Any]], fields: Collection[str]) -> list[dict[str, Any]]:
    """``records`` without ``fields`` (an earlier scoring's per-row scores,
    gone when OUT is scored again with other metrics or measures)."""
    return [{k: v for k, v in record.items() if k not in fields} for record in records]


def write_records(paths: RunPaths, records: list[dict[str, Any]]) -> None:
    """Replace ``paths.output`` with ``records`` atomically, under its lock."""
    files = OutputFiles(paths.output)
    with files.locked():
        spool = JsonlAppender(scored_spool(paths.output))
        for record in records:
            spool.write(record)
        spool.close()
        publish(spool.path, paths.output)


def load_eval(path: Path) -> dict[str, Any]:
    """A saved ``.eval.json`` (for ``--compare``).

    Raises:
        InputFileError: missing, unreadable, not JSON, or without scores.
    """
    data = read_json_file(path, "eval file")
    try:
        bars.compare({}, data.get("scores", data))
    except (ValueError, AttributeError, TypeError) as exc:
        raise InputFileError(f"{path}: not a saved OUT.eval.json ({exc}); give one to --compare") from None
    return data
