"""``bulkinfer run``: read -> plan -> generate -> write -> report, streaming.

The input is read in windows of ``plan.window_rows`` rows; each window is
tokenized, sorted and bucketed, then fed to the engine while at most
``max_in_flight`` requests are unfinished. The next window is planned as soon
as the current one is handed over, while the engine (its own process) keeps
computing, so continuous batching never drains between buckets or windows.
Memory is bounded by about two windows plus the requests in flight.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.args import this_machine
from bulkinfer.engine.base import Engine, NoEngine
from bulkinfer.engine.log import EngineLog, warn
from bulkinfer.errors import (
    EXIT_OK,
    EXIT_PARTIAL,
    BulkinferError,
    ConfigError,
    EngineError,
    InputFileError,
    ModelError,
    OutputWriteError,
    os_reason,
    write_error,
)
from bulkinfer.io.files import GENERATION_COLUMNS, OutputColumns
from bulkinfer.io.inputs import scan_input
from bulkinfer.io.journal import (
    changed_while_read,
    check_same_results,
    file_key,
    input_identity,
    results_record,
    results_settings,
)
from bulkinfer.io.output_files import OutputFiles, RunPaths, same_file
from bulkinfer.io.readers import PROMPT_COLUMNS, RawRow, open_reader
from bulkinfer.jobs.compile_choice import record_compiled_start
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.engine_choice import choose_engine_settings, input_sample
from bulkinfer.jobs.generation import Attempt, Generation
from bulkinfer.models import resolve_model
from bulkinfer.prep.grammar import Grammars
from bulkinfer.prep.planner import Planner, UnscheduledPriority
from bulkinfer.prep.prefix import prefix_block_tokens
from bulkinfer.prep.rows import ROW_FIELDS_READ, RowParser, to_request
from bulkinfer.prep.vocabulary import vocabulary
from bulkinfer.report.calibration import length_prior, record_calibration
from bulkinfer.report.html import write_run_html
from bulkinfer.report.stats import peak_rss_bytes, write_report


def _generation_planner(tokenizer: Any, settings: Settings, engine: Engine, model_path: str) -> Planner:
    block = prefix_block_tokens(engine.settings)
    vocab, grammars = vocabulary(tokenizer, model_path), Grammars(tokenizer, settings.engine)
    planner = Planner(tokenizer, settings.plan, engine.max_model_len, block, vocab, grammars)
    if engine.settings.get("scheduling_policy") not in (None, "priority"):  # an engine opened before the run
        planner.checks.append(UnscheduledPriority())
    return planner


@dataclass(frozen=True, slots=True)
class Job:
    """What sets apart the jobs that run rows through this pipeline (read,
    plan, feed, spool, publish, report): ``bulkinfer run`` (the defaults),
    ``bulkinfer embed`` (:mod:`bulkinfer.jobs.embed`) and ``bulkinfer
    score`` (:mod:`bulkinfer.jobs.score`).

    - ``parse``: a row -> its :class:`~bulkinfer.schema.Request` (raises RowInvalid);
    - ``planner(tokenizer, settings, engine, model_path)``: the window planner;
    - ``journal``: settings of the job beyond :class:`Settings` that shape its
      results (``--resume`` refuses others);
    - ``columns``: what its Parquet output knows of its columns before its
      rows: embedding columns, the columns of an output with no rows
      (:class:`~bulkinfer.io.files.OutputColumns`);
    - ``calibrate``: record the run as a calibration of the model, and run it
      with the dtype and scheduler limits measured for the model
      (:func:`~bulkinfer.jobs.tune.measured_settings`; generation only);
    - ``kind``: the report's ``job`` (``run``, ``embed`` or ``score``; an encoder job's
      report has no generation figures: sampling, chat template, finish
      reasons, structured outputs, completion lengths);
    - ``describe(planner)``: the job's own figures for the report (keys -> values);
    - ``text_columns``: the Parquet input columns that hold a row's text;
    - ``consumed``: the row fields ``parse`` reads, to use or refuse (with ``passthrough = false``
      a Parquet input's other columns are not read);
    - ``sized_kv_cache``: with ``calibrate``, on CPU, a KV cache sized to the
      input (:func:`~bulkinfer.jobs.engine_choice.job_tokens`); off where the engine outlives the job (a
      server's, which the first batch would size for all).
    """

    parse: RowParser = to_request
    planner: Callable[[Any, Settings, Engine, str], Planner] = _generation_planner
    journal: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    columns: OutputColumns = GENERATION_COLUMNS
    calibrate: bool = True
    kind: str = "run"
    describe: Callable[[Planner], dict[str, Any]] | None = None
    text_columns: tuple[str, ...] = PROMPT_COLUMNS
    consumed: frozenset[str] = ROW_FIELDS_READ
    sized_kv_cache: bool = True


GENERATE = Job()


@dataclass(frozen=True, slots=True)
class RunReport:
    """What a run returns: ``report``, the contents of ``OUT.report.json``
    (see :mod:`bulkinfer.report.stats` for its keys; ``already_complete``
    when a resume found nothing to do), and the exit code ``bulkinfer run``
    ends with: :data:`~bulkinfer.errors.EXIT_OK`, or
    :data:`~bulkinfer.errors.EXIT_PARTIAL` when some rows failed (they are in
    the errors file)."""

    report: dict[str, Any]
    exit_code: int
    output: Path | None = None  # the output file

    @property
    def completed(self) -> int:
        """Rows with a completion in the output (resumed ones included)."""
        return int(self.report.get("request_counts", {}).get("completed", 0))

    @property
    def failed(self) -> int:
        """Rows in the errors file."""
        return int(self.report.get("request_counts", {}).get("failed", 0))


def run(
    paths: RunPaths,
    settings: Settings,
    context: RunContext | None = None,
    *,
    check_row: Callable[[RawRow], RawRow] | None = None,
    job: Job = GENERATE,
) -> RunReport:
    """Run every row of ``paths.input`` through the model; write the output,
    errors and report files. Returns the report and the exit code
    (:data:`EXIT_OK`, or :data:`EXIT_PARTIAL` when some rows failed).

    ``context``: the invocation's choices (overwrite or resume, stop token,
    verbosity, progress style, engine and tokenizer factories, observer);
    a default :class:`RunContext` when None.

    With ``context.resume``, rows an interrupted run finished are kept and skipped;
    on a complete output it does nothing (exit 0). An input with no rows
    loads no model: it writes an empty output, errors and report files.
    A run that fails before any row finished leaves no journal or spool
    behind, so the next run (with or without ``--resume``) starts clean.

    What the engine and its libraries print goes to ``OUT.log`` (appended to
    on resume), unless ``context.verbose`` or the engine outlives the run (a
    shared or a server's engine: its processes' output is the process's, and
    a run that is one of several in a process changes no file descriptor;
    see :mod:`bulkinfer.engine.log`); an
    engine or model failure's message then ends with the engine's last
    error line and the log's path.

    Raises:
        OutputExistsError: the output (or an interrupted run's partial output)
            exists and neither ``overwrite`` nor ``resume`` allows going on, or
            another format of the same output stem exists.
        LockHeldError: another run holds this output stem's lock.
        ConfigError: ``resume`` and ``overwrite`` both; ``resume`` with another
            input or other settings (once a row finished; the message says
            what changed), or a ``[sampling]`` default vLLM rejects.
        InputFileError: the input cannot be read (before any model loads).
        ModelError, EngineError: the model or engine cannot start, or the
            engine dies (finished rows stay in the spools).
        OutputWriteError: a file of the run cannot be written (disk full,
            read-only, permission, not a directory); finished rows are kept.
        Interrupted: ``stop`` was set (the CLI sets it on SIGINT, SIGTERM or
            SIGHUP); finished rows are on disk in the spool beside the
            output (exit code 128 + N).

    ``check_row``, when given, sees every row read before it is parsed and
    returns it or an error row (``RawRow.error`` set): ``eval`` turns a row
    without a reference into a row error that is never generated.

    Touches no process-wide state but the engine's log capture (file
    descriptors 1 and 2, see :mod:`bulkinfer.engine.log`): it runs in any thread.
    """
    started = time.monotonic()
    context = context or RunContext()
    resume, overwrite = context.resume, context.overwrite
    reader = open_reader(paths.input, None if settings.passthrough else job.consumed, job.text_columns)
    if settings.model not in (None, DEFAULT_MODEL):
        resolve_model(settings.model)  # a model that cannot be found fails here, before any file is written
    files = OutputFiles(paths.output, job.columns)
    make_output_dir(paths.output, files.errors, paths.report, paths.html)
    with files.locked():
        try:
            identity, results = input_identity(paths.input), {**results_settings(settings), **job.journal}
            key = file_key(paths.input)
            if resume and files.is_complete():  # resume excludes overwrite (RunContext)
                report = _complete(paths, files, identity, results)
                return RunReport({**report, "already_complete": True}, EXIT_OK, paths.output)
            done = files.start(identity, results, resume, overwrite)
            context.observer.started(done.completed, done.failed)
            resumed = bool(done.completed or done.failed)
            quiet = context.verbose or context.engine_outlives_run
            try:
                with EngineLog(files.log, quiet, append=resumed) as log:
                    try:
                        rows = map(check_row, reader) if check_row is not None else iter(reader)
                        record = results_record(identity, results)
                        attempt = Attempt(paths, files, done, reader, rows, record, started, key)
                        report = _run_locked(attempt, job, settings, context)
                    except (EngineError, ModelError) as exc:
                        raise log.explain(exc) from exc
            except BaseException:
                files.discard_if_nothing_done()
                raise
        except OSError as exc:
            raise _os_error(exc, paths) from exc
    context.observer.finished(report)
    changed = report.get("input_changed")
    code = EXIT_PARTIAL if report["request_counts"]["failed"] or (changed and not changed["read_whole"]) else EXIT_OK
    return RunReport(report, code, paths.output)


def _complete(paths: RunPaths, files: OutputFiles, identity: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The report of the complete output a ``--resume`` found, once it is
    checked to be this input's and these settings' (by its report's
    ``results_of``, or by the journal a run keeps until its report is
    written); an HTML report that was not written is drawn from it.

    Raises:
        ConfigError: another input or other settings than the run that wrote
            it; or neither its report nor a journal is there to say which.
        OSError: the HTML report cannot be written.
    """
    report = orjson.loads(paths.report.read_bytes()) if paths.report.exists() else {}
    if report.get("results_of"):
        check_same_results(paths.output, report["results_of"], identity, results, complete=True)
        if not paths.html.exists():
            write_run_html(report, paths.html)
        files.discard_partial()
        files.reported()
    elif files.journal.exists():  # published, then stopped before its report was written
        check_same_results(paths.output, orjson.loads(files.journal.read_bytes()), identity, results, complete=True)
        warn(
            f"{paths.output} is complete, but the run that wrote it stopped before writing its report "
            f"{paths.report}: there is none (--overwrite runs it again, with one)"
        )
    elif not report:
        raise ConfigError(
            f"cannot resume {paths.output}: it is complete, but its report {paths.report} is missing, so whether "
            "it is this input's and these settings' cannot be checked; use --overwrite to run it again"
        )
    # else a report from before 2026-12-05, which did not record its input and settings
    return report


def make_output_dir(out: Path, *beside: Path) -> None:
    """Create the directory of the output file ``out`` (and its parents)
    before anything is written there.

    Raises:
        OutputWriteError: ``out`` or a file written ``beside`` it (the
            errors file, the reports) is a directory, a component of its
            path is an existing non-directory, or the directory cannot be
            created (exit 9).
    """
    for path in (out, *beside):
        if path.is_dir():
            raise write_error(IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)), path)
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise write_error(NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), parent)
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, out.parent) from None


def _os_error(exc: OSError, paths: RunPaths) -> BulkinferError:
    """An OSError that escaped the run as a bulkinfer error: reading the
    input is an InputFileError; a file of the run (beside the output) or no
    file named, an OutputWriteError for it (or the output's directory); any
    other file, an OutputWriteError that names it without claiming it is
    the run's (the errno's hints speak of ``-o``)."""
    if exc.filename is None:
        return write_error(exc, paths.output.parent)
    named = Path(os.fsdecode(exc.filename))
    if same_file(named, paths.input):
        return InputFileError(f"cannot read {paths.input}: {exc.strerror or exc}")
    if named.absolute().parent == paths.output.absolute().parent:
        return write_error(exc)
    return OutputWriteError(f"{named}: {os_reason(exc)}; finished rows are kept: fix it, then --resume")


def _run_locked(attempt: Attempt, job: Job, settings: Settings, context: RunContext) -> dict[str, Any]:
    """The body of :func:`run`, with the lock held and the journal written."""
    paths = attempt.paths
    scan = scan_input(paths.input)
    first = next(attempt.rows, None)
    start: dict[str, float] = {}  # what the load spent, by phase (seconds)
    if first is None:  # no rows at all: no model to load
        model: str = ""
        engine: Engine = NoEngine()
        tokenizer = None
        engine_choice: dict[str, Any] = {}
    else:
        with context.stop.loading(settings.plan.start_timeout_s):  # the CLI ends a load that takes longer
            clock = time.monotonic()
            model = resolve_model(settings.model)
            tokenizer = context.load_tokenizer(model, settings, generates=job.kind == "run")
            start["tokenizer"], clock = time.monotonic() - clock, time.monotonic()
            sized = job.sized_kv_cache and not context.engine_outlives_run  # an engine that outlives the job: not sized
            sample = (
                functools.partial(input_sample, paths.input, tokenizer, settings, job.parse)
                if job.kind == "run"
                else None
            )
            settings, engine_choice = choose_engine_settings(model, settings, scan, job.calibrate, sized, sample)
            start["engine_choice"], clock = time.monotonic() - clock, time.monotonic()
            engine = context.engine_factory(model, settings)
            start["engine"] = time.monotonic() - clock
        compiled = engine_choice.get("compile", {}).get("enforce_eager") is False
        if compiled and not context.engine_outlives_run:  # the compile cache now holds this graph
            record_compiled_start(model, settings, start["engine"], warn=warn)
        context.observer.engine_ready()
    settings = settings.resolve_chat_template(tokenizer)
    load_s = time.monotonic() - attempt.started
    try:
        planner = job.planner(tokenizer, settings, engine, model)
        prior = length_prior(model, str(paths.output), this_machine(), engine.settings)
        generation = Generation(attempt, settings, engine, planner, context, job, scan.rows, prior)
        generation.run(itertools.chain([first], attempt.rows) if first is not None else ())
    finally:
        engine.close()
    report = generation.report(model, load_s, time.monotonic() - attempt.started)
    first_token = generation.stats.first_token_at
    report["seconds"]["start"] = {
        **start,
        "first_token": None if first_token is None else first_token - attempt.started,
    }
    report["job"] = job.kind
    report["engine_choice"] = engine_choice
    report["peak_rss_bytes"] = peak_rss_bytes()
    report["results_of"] = attempt.results_of
    read_to = getattr(attempt.reader, "bytes_read", None)
    changed = changed_while_read(paths.input, attempt.results_of["input"], attempt.input_key, read_to)
    if changed:
        report["input_changed"] = changed
        warn(changed["message"])
        now = input_identity(paths.input) if changed["read_whole"] and not changed["replaced"] else {}
        if read_to is not None and now.get("size") == read_to:  # grown, and read to its end: of this file
            report["results_of"] = {**attempt.results_of, "input": now}
    if job.describe is not None:
        report.update(job.describe(planner))
    write_report(report, paths.report)
    write_run_html(report, paths.html)
    attempt.files.reported()
    if job.calibrate:
        work = generation.progress.work
        lengths, fit = work.length_quantiles(), work.fitted_step_cost()
        record_calibration(report, this_machine(), "run", lengths, fit, warn=warn)
    return report
