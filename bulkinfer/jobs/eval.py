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
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.base import EngineFactory, KeptEngine
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.engine.log import EngineLog, terminal
from bulkinfer.errors import (
    EXIT_BELOW_BAR,
    EXIT_OK,
    ConfigError,
    EngineError,
    InputFileError,
    ModelError,
    OutputExistsError,
)
from bulkinfer.io import formats
from bulkinfer.io.files import JsonlAppender, publish
from bulkinfer.io.readers import RawRow, open_reader
from bulkinfer.io.records import parse_output, read_json_file, read_records
from bulkinfer.jobs.output_files import OutputFiles, RunPaths
from bulkinfer.jobs.run import check_resume_overwrite, make_output_dir, run
from bulkinfer.metrics import bars
from bulkinfer.metrics import text as evaluate
from bulkinfer.metrics.perplexity import ReferenceNLL, reference_nll
from bulkinfer.models import TokenizerFactory, load_tokenizer, resolve_model
from bulkinfer.prep.rows import parse_row, to_request
from bulkinfer.report.stats import write_report
from bulkinfer.schema import Request, RowInvalid
from bulkinfer.stop import StopToken


@dataclass(slots=True)
class GoldenRow:
    """One golden row: its id, line, references and (for perplexity) its request."""

    id: str
    line: int
    references: list[str]
    request: Request


UNKNOWN = "unknown"


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
    row, missing or invalid ``reference``) as ``{"line", "id", "error"}``.

    Raises:
        InputFileError: the file cannot be read.
    """
    rows: list[GoldenRow] = []
    invalid: list[dict[str, Any]] = []
    for seq, raw in enumerate(open_reader(path)):
        try:
            if raw.error is not None:
                raise raw.error
            request = to_request(raw.data, seq, raw.line, settings)
            references = evaluate.references_of(raw.data.get("reference"))
        except RowInvalid as exc:
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
            :func:`bulkinfer.io.readers.open_reader`), has no rows, or no row
            has a usable ``reference``.
    """
    if not golden.exists() and not golden.is_symlink():
        raise InputFileError(f"golden file not found: {golden}")
    rows = 0
    for raw in open_reader(golden):
        rows += 1
        if reference_error(raw, settings) is raw and raw.error is None:
            return
    if not rows:
        raise InputFileError(f"golden file {golden} has no rows: nothing to score")
    raise InputFileError(
        f"golden file {golden}: none of its {rows} rows has a usable 'reference' field (a string, or a list "
        "of strings), so nothing can be scored; add one to each row, or use `bulkinfer run` to only generate"
    )


def read_predictions(path: Path) -> list[dict[str, Any]]:
    """Every record of a predictions file (JSONL or Parquet output of ``run``).

    Raises:
        InputFileError: the file is missing or unreadable.
    """
    if not path.is_file():
        raise InputFileError(f"predictions file not found: {path}")
    try:
        return list(read_records(path))
    except OSError as exc:
        raise InputFileError(f"cannot read the predictions file {path}: {exc.strerror or exc}") from None


def generation_of(predictions: Path) -> dict[str, Any]:
    """What produced an existing predictions file, from the run report beside
    it (``PRED.report.json``, as ``run`` writes it): ``{"source": that
    report's path, "model", "model_path", "sampling", "engine",
    "chat_template_applied"}``. Without a readable report every value is
    ``"unknown"`` and ``source`` is None."""
    path = formats.sibling(predictions, ".report.json")
    try:
        report = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        report = None
    if not isinstance(report, dict):
        return {"source": None, **dict.fromkeys(GENERATION_KEYS, UNKNOWN)}
    return {"source": str(path), **{key: report.get(key, UNKNOWN) for key in GENERATION_KEYS}}


GENERATION_KEYS = ("model", "model_path", "sampling", "engine", "chat_template_applied")


def row_set(ids: list[str]) -> dict[str, Any]:
    """Which rows an eval scored, small enough to store: their ``count`` and
    ``ids_sha256``, the SHA-256 of the sorted ids joined by newlines."""
    digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()
    return {"count": len(ids), "ids_sha256": digest}


def row_set_warnings(report: dict[str, Any], previous: dict[str, Any]) -> list[str]:
    """Why comparing ``report`` with ``previous`` (a saved ``.eval.json``)
    may mislead: the two scored different rows, or ``previous`` does not say
    which rows it scored. Empty when both scored the same ids."""
    ours, theirs = report.get("row_set"), previous.get("row_set")
    if not isinstance(theirs, dict):
        return ["the previous eval does not record which rows it scored: the changes may compare different rows"]
    if ours == theirs:
        return []
    if ours and ours.get("count") != theirs.get("count"):
        return [
            f"the two evals scored different rows ({ours['count']} here, {theirs.get('count')} before): "
            "the changes compare different row sets"
        ]
    return ["the two evals scored different rows (same count, different ids): the changes compare different row sets"]


def describe_generation(generation: dict[str, Any]) -> str:
    """The model and sampling settings that produced the predictions, in a line."""
    if generation.get("source") is None:
        return "unknown (no run report beside the predictions)"
    sampling = generation.get("sampling")
    shown = (
        ", ".join(f"{key} {sampling[key]}" for key in ("temperature", "top_p", "max_tokens") if key in sampling)
        if isinstance(sampling, dict)
        else f"sampling {UNKNOWN}"
    )
    return f"{generation.get('model')}, {shown} (from {generation['source']})"


def run_eval(
    golden: Path,
    out: Path,
    settings: Settings,
    *,
    predictions: Path | None = None,
    perplexity: bool = False,
    bootstrap: int = 0,
    fail_under: dict[str, float] | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress_plain: bool = False,
    engine_factory: EngineFactory = vllm_engine,
    tokenizer_factory: TokenizerFactory = load_tokenizer,
    verbose: bool = False,
    stop: StopToken | None = None,
) -> EvalResult:
    """Generate (unless ``predictions`` is given), score, and write ``OUT`` and
    ``OUT.eval.json``. The exit code is :data:`EXIT_BELOW_BAR` when a metric is
    below its ``fail_under`` bar, else the generation's (0, or 3 when some rows
    failed; failed rows are listed as unmatched and not scored). The engine's
    log is appended to ``OUT.log`` unless ``verbose`` (see :mod:`bulkinfer.engine.log`).

    Golden rows without a usable ``reference`` are row errors in
    ``OUT.errors.jsonl`` and are not generated; the others are scored.

    With ``predictions``, ``OUT`` holds only the scored records (the first
    record of each golden id, in the predictions' order); predictions
    without a golden row and golden rows without a prediction are counted in
    ``row_counts`` and not scored. The report's ``generation`` is what
    produced the predictions (:func:`generation_of`); ``settings`` is None then.

    Raises:
        the errors of :func:`bulkinfer.jobs.run.run`; ConfigError for both
        ``resume`` and ``overwrite``; InputFileError, before any file is
        written or model loaded, when no golden row has a ``reference``, and
        for a missing or unreadable predictions file; ConfigError when no
        prediction matches a golden id.
    """
    started = time.monotonic()
    check_resume_overwrite(resume, overwrite)
    paths = RunPaths.build(golden, out)
    check_golden(golden, settings)  # before any file is written or model loaded
    model_path = resolve_model(settings.model)  # likewise: a model that cannot be found fails here
    engines = KeptEngine(engine_factory)  # the perplexity pass reuses the generation's engine
    if perplexity and not getattr(engine_factory, "outlives_run", False):  # a shared engine is reused as it is
        engine_factory = engines
    make_output_dir(out)  # OUT's directory, for the log opened next
    # appended to: opened before the generation checks that it may write OUT
    with EngineLog(OutputFiles(out).log, verbose, append=True) as log:
        try:
            run_report: dict[str, Any] = {}
            run_code = EXIT_OK
            generated_here = predictions is None
            if predictions is None:
                generated = run(
                    paths,
                    settings,
                    overwrite=overwrite,
                    resume=resume,
                    engine_factory=engine_factory,
                    tokenizer_factory=tokenizer_factory,
                    progress_plain=progress_plain,
                    verbose=verbose,
                    stop=stop,
                    check_row=lambda raw: reference_error(raw, settings),
                )
                run_report, run_code = generated.report, generated.exit_code
                predictions = out
            elif out.exists() and not overwrite:
                raise OutputExistsError(f"output {out} already exists; use --overwrite to replace it")
            tokenizer = tokenizer_factory(model_path, settings.engine.trust_remote_code)
            settings = settings.resolve_chat_template(tokenizer)  # as the generation decided
            rows, invalid = read_golden(golden, settings)
            records = read_predictions(predictions)
            by_id: dict[str, tuple[int, str]] = {}
            for index, record in enumerate(records):
                found = parse_output(record)
                if found is not None and found.id not in by_id:
                    by_id[found.id] = (index, found.completion)
            matched = [row for row in rows if row.id in by_id]
            if not matched:
                raise ConfigError(f"no prediction in {predictions} matches an id of {golden}")
            texts = [by_id[row.id][1] for row in matched]
            scores = evaluate.score(texts, [row.references for row in matched], bootstrap=bootstrap)
            per_row = {row.id: evaluate.row_scores(by_id[row.id][1], row.references) for row in matched}

            nll = ReferenceNLL()
            if perplexity:
                pairs = [(row.request, row.references[0]) for row in matched]
                engine = engines.get(model_path, settings)
                nll = reference_nll(pairs, tokenizer, engine, settings, progress_plain, stop)

            golden_ids = {row.id for row in rows}
            scored_index = {index: row_id for row_id, (index, _) in by_id.items() if row_id in per_row}
            for index, row_id in scored_index.items():  # the first record of each id gets the scores
                records[index] = {**records[index], **per_row[row_id]}
                if row_id in nll.scored:
                    total, count = nll.scored[row_id]
                    records[index]["perplexity"] = math.exp(total / count)
                elif row_id in nll.failed:
                    records[index]["perplexity_error"] = nll.failed[row_id]
            if not generated_here:  # OUT is what was scored; a run's output keeps every row, for --resume
                records = [records[index] for index in sorted(scored_index)]
            _write_records(paths, records)

            corpus = scores.to_dict()
            if perplexity:
                total_nll = sum(v[0] for v in nll.scored.values())
                total_tokens = sum(v[1] for v in nll.scored.values())
                corpus["perplexity"] = math.exp(total_nll / total_tokens) if total_tokens else None
                corpus["perplexity_rows"] = len(nll.scored)
                corpus["perplexity_tokens"] = total_tokens
                corpus["perplexity_failed"] = len(nll.failed)
            below = bars.check_fail_under(corpus, fail_under) if fail_under else []
            if generated_here:
                generation = {"source": str(paths.report), **{key: run_report.get(key) for key in GENERATION_KEYS}}
            else:
                generation = generation_of(predictions)
            unmatched_golden = [row.id for row in rows if row.id not in by_id]
            unmatched_predictions = sorted(set(by_id) - golden_ids)
            report = {
                "golden": str(golden),
                "predictions": str(predictions),
                "output": str(out),
                "model": generation["model"] if not generated_here else settings.model or DEFAULT_MODEL,
                "model_path": generation["model_path"] if not generated_here else model_path,
                "generation": generation,
                "scores": corpus,
                "row_counts": {
                    "golden": len(rows) + len(invalid),
                    "predictions": len(by_id),
                    "scored": len(matched),
                    "unmatched": {"golden": len(unmatched_golden), "predictions": len(unmatched_predictions)},
                    "unmatched_golden": unmatched_golden,
                    "unmatched_predictions": unmatched_predictions,
                    "invalid_golden": invalid,
                },
                "row_set": row_set([row.id for row in matched]),
                "fail_under": {"bars": fail_under or {}, "below": below},
                # the settings of this eval's generation; with --predictions, see "generation"
                "settings": settings.to_dict() if generated_here else None,
                "perplexity_model_path": model_path if perplexity else None,
                "metrics_version": evaluate.metrics_versions(),
                "run_report": str(paths.report) if run_report else None,
                "seconds": time.monotonic() - started,
            }
            write_report(report, eval_path(out))
            write_eval_html(report, run_report, records, paths.html)
            # a metric below its bar is what a nightly job must see first; then failed rows
            return EvalResult(report, EXIT_BELOW_BAR if below else run_code, below)

        except (EngineError, ModelError) as exc:
            raise log.explain(exc) from exc
        finally:
            engines.close()


def write_eval_html(
    report: dict[str, Any], run_report: dict[str, Any], records: list[dict[str, Any]], path: Path
) -> None:
    """HTML: the eval's scores and per-row distributions, after the run's charts
    when this eval generated. Never fails the eval."""

    try:
        from bulkinfer.report.html import eval_sections, run_sections, write_html

        sections = [
            *eval_sections(report, evaluate.METRICS, records),
            *(run_sections(run_report) if "seconds" in run_report else []),
        ]
        write_html(f"bulkinfer eval: {report['golden']}", sections, path)
    except Exception as exc:
        print(f"bulkinfer: warning: HTML report not written: {type(exc).__name__}: {exc}", file=terminal())


def _write_records(paths: RunPaths, records: list[dict[str, Any]]) -> None:
    """Replace ``paths.output`` with ``records`` atomically, under its lock."""
    files = OutputFiles(paths.output)
    with files.locked():
        spool = JsonlAppender(paths.output.with_name(f".{paths.output.name}.scored.jsonl"))
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


def print_eval(report: dict[str, Any], previous: dict[str, Any] | None, console: Any) -> None:
    """The corpus scores as a rich table, with 95% intervals when resampled and
    the change against ``previous`` (a saved ``.eval.json``) when given."""
    from rich.table import Table

    scores = report["scores"]
    ci = scores.get("ci") or {}
    changes = {}
    if previous is not None:
        changes = {name: delta for name, _, _, delta in bars.compare(scores, previous.get("scores", previous))}
    table = Table(title=f"bulkinfer eval: {report['golden']} ({report['row_counts']['scored']} rows scored)")
    table.add_column("metric")
    table.add_column("score", justify="right")
    if ci:
        table.add_column("95% interval", justify="right")
    if previous is not None:
        table.add_column("change", justify="right")
    names = [*evaluate.METRICS, *(["perplexity"] if scores.get("perplexity") is not None else [])]
    for name in names:
        cells = [name, f"{scores[name]:.2f}"]
        if ci:
            low_high = ci.get(name)
            cells.append(f"{low_high[0]:.2f} - {low_high[1]:.2f}" if low_high else "")
        if previous is not None:
            delta = changes.get(name)
            cells.append(f"{delta:+.2f}" if delta is not None else "n/a")
        table.add_row(*cells)
    console.print(table)
    for name, signature in scores["signatures"].items():
        console.print(f"{name} signature: {signature}", markup=False)
    for line in [*scores.get("warnings", []), *scores.get("notes", [])]:
        console.print(f"note: {line}", markup=False)
    counts = report["row_counts"]
    unmatched = counts["unmatched_golden"]
    if unmatched:
        console.print(
            f"{len(unmatched)} golden rows without a prediction (not scored): {', '.join(unmatched[:10])}",
            markup=False,
        )
    extra = counts.get("unmatched_predictions") or []
    if extra:
        console.print(
            f"{len(extra)} predictions without a golden row (not scored): {', '.join(extra[:10])}", markup=False
        )
    generation = report.get("generation")
    if generation:
        console.print(f"predictions generated by: {describe_generation(generation)}", markup=False)
    if previous is not None:
        for warning in row_set_warnings(report, previous):
            console.print(f"warning: {warning}", markup=False)
