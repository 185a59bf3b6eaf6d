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
import itertools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings, with_engine
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.args import detect_device, sized_kv_cache, this_machine
from bulkinfer.engine.base import Engine, EngineFactory, NoEngine
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.engine.log import EngineLog
from bulkinfer.errors import (
    EXIT_OK,
    EXIT_PARTIAL,
    BulkinferError,
    ConfigError,
    EngineError,
    InputFileError,
    ModelError,
    write_error,
)
from bulkinfer.io.inputs import InputScan, scan_input
from bulkinfer.io.readers import PROMPT_COLUMNS, RawRow, Reader, open_reader
from bulkinfer.jobs.generation import Generation
from bulkinfer.jobs.output_files import OutputFiles, RunPaths, input_identity, results_settings, same_file
from bulkinfer.jobs.tune import measured_settings, print_to_stderr
from bulkinfer.models import TokenizerFactory, load_tokenizer, resolve_model
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.prefix import prefix_block_tokens
from bulkinfer.prep.rows import CONSUMED_FIELDS, to_request
from bulkinfer.prep.windows import RowParser
from bulkinfer.report.calibration import length_prior, record_calibration
from bulkinfer.report.html import write_run_html
from bulkinfer.report.stats import peak_rss_bytes, write_report
from bulkinfer.schema import Done
from bulkinfer.stop import StopToken


def _generation_planner(tokenizer: Any, settings: Settings, engine: Engine, model_path: str) -> Planner:
    return Planner(tokenizer, settings.plan, engine.max_model_len, prefix_block_tokens(engine.settings))


@dataclass(frozen=True, slots=True)
class Job:
    """What sets apart the jobs that run rows through this pipeline (read,
    plan, feed, spool, publish, report): ``bulkinfer run`` (the defaults)
    and ``bulkinfer embed`` (:mod:`bulkinfer.jobs.embed`).

    - ``parse``: a row -> its :class:`~bulkinfer.schema.Request` (raises RowInvalid);
    - ``planner(tokenizer, settings, engine, model_path)``: the window planner;
    - ``journal``: settings of the job beyond :class:`Settings` that shape its
      results (``--resume`` refuses others);
    - ``vectors``: output columns written as ``fixed_size_list<float32>`` in Parquet;
    - ``calibrate``: record the run as a calibration of the model, and run it
      with the dtype and scheduler limits measured for the model
      (:func:`~bulkinfer.jobs.tune.measured_settings`; generation only);
    - ``describe(report, planner)``: adds the job's own figures to the report;
    - ``text_columns``: the Parquet input columns that hold a row's text;
    - ``consumed``: the row fields ``parse`` reads (with ``passthrough = false``
      a Parquet input's other columns are not read);
    - ``sized_kv_cache``: with ``calibrate``, on CPU, a KV cache sized to the
      input (:func:`job_tokens`); off where the engine outlives the job (a
      server's, which the first batch would size for all).
    """

    parse: RowParser = to_request
    planner: Callable[[Any, Settings, Engine, str], Planner] = _generation_planner
    journal: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    vectors: tuple[str, ...] = ()
    calibrate: bool = True
    describe: Callable[[dict[str, Any], Planner], None] | None = None
    text_columns: tuple[str, ...] = PROMPT_COLUMNS
    consumed: frozenset[str] = CONSUMED_FIELDS
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
    *,
    overwrite: bool = False,
    resume: bool = False,
    engine_factory: EngineFactory = vllm_engine,
    tokenizer_factory: TokenizerFactory = load_tokenizer,
    progress_plain: bool = False,
    verbose: bool = False,
    stop: StopToken | None = None,
    check_row: Callable[[RawRow], RawRow] | None = None,
    job: Job = GENERATE,
) -> RunReport:
    """Run every row of ``paths.input`` through the model; write the output,
    errors and report files. Returns the report and the exit code
    (:data:`EXIT_OK`, or :data:`EXIT_PARTIAL` when some rows failed).

    With ``resume``, rows an interrupted run finished are kept and skipped;
    on a complete output it does nothing (exit 0). An input with no rows
    loads no model: it writes an empty output, errors and report files.
    A run that fails before any row finished leaves no journal or spool
    behind, so the next run (with or without ``--resume``) starts clean.

    What the engine and its libraries print goes to ``OUT.log`` (appended to
    on resume), unless ``verbose`` (see :mod:`bulkinfer.engine.log`); an
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

    ``engine_factory(model_path, settings)`` builds the engine,
    ``tokenizer_factory(model_path, trust_remote_code)`` loads the tokenizer
    (tests inject their own). Touches no process-wide state but the engine's
    log capture (file descriptors 1 and 2, see :mod:`bulkinfer.engine.log`):
    it runs in any thread.
    """
    started = time.monotonic()
    check_resume_overwrite(resume, overwrite)
    reader = open_reader(paths.input, None if settings.passthrough else job.consumed, job.text_columns)
    if settings.model not in (None, DEFAULT_MODEL):
        resolve_model(settings.model)  # a model that cannot be found fails here, before any file is written
    files = OutputFiles(paths.output, job.vectors)
    make_output_dir(paths.output)
    with files.locked():
        try:
            if resume and files.is_complete():  # resume excludes overwrite (check_resume_overwrite)
                files.discard_partial()
                report = orjson.loads(paths.report.read_bytes()) if paths.report.exists() else {}
                return RunReport({**report, "already_complete": True}, EXIT_OK)
            results = {**results_settings(settings), **job.journal}
            done = files.start(input_identity(paths.input), results, resume, overwrite)
            resumed = bool(done.completed or done.failed)
            try:
                with EngineLog(files.log, verbose, append=resumed) as log:
                    try:
                        report = _run_locked(
                            paths,
                            files,
                            done,
                            settings,
                            reader,
                            (engine_factory, tokenizer_factory),
                            progress_plain,
                            started,
                            stop or StopToken(),
                            check_row,
                            job,
                        )
                    except (EngineError, ModelError) as exc:
                        raise log.explain(exc) from exc
            except BaseException:
                files.discard_if_nothing_done()
                raise
        except OSError as exc:
            raise _os_error(exc, paths) from exc
    code = EXIT_PARTIAL if report["request_counts"]["failed"] else EXIT_OK
    return RunReport(report, code)


def check_resume_overwrite(resume: bool, overwrite: bool) -> None:
    """Raises ConfigError when both are asked: continuing a run and starting it over contradict."""
    if resume and overwrite:
        raise ConfigError("give --resume (continue the interrupted run) or --overwrite (start over), not both")


def with_priority_scheduling(settings: Settings, rows_set_priority: bool) -> Settings:
    """``settings`` with vLLM's ``scheduling_policy = "priority"`` when rows
    may set a ``priority`` (or ``[sampling] priority`` is set), unless
    ``[engine] scheduling_policy`` is given: vLLM refuses a request's
    priority under its default first-come-first-served policy."""
    extra = settings.engine.extra_args
    if "scheduling_policy" in extra or not (rows_set_priority or settings.sampling.priority):
        return settings
    return with_engine(settings, extra_args={**extra, "scheduling_policy": "priority"})


# Tokens a row's chat template adds beyond its JSON bytes / 2 (and its n x max_tokens completion tokens).
TEMPLATE_TOKENS = 64


def job_tokens(settings: Settings, scan: InputScan) -> int | None:
    """About how many tokens a job's prompts and completions take: the
    input's ``scan.bytes / 2`` plus ``rows x (n x max_tokens +
    TEMPLATE_TOKENS)``, generous on purpose (English runs ~4 bytes a token);
    None when the input's size is unknown or the engines run on other
    machines (a Ray cluster's)."""
    if scan.rows is None or scan.bytes is None or settings.ray.address not in (None, "local"):
        return None  # unknown size; or a cluster's machines, whose memory this one does not know
    sampling = settings.sampling
    return scan.bytes // 2 + scan.rows * (sampling.n * sampling.max_tokens + TEMPLATE_TOKENS)


def make_output_dir(out: Path) -> None:
    """Create the directory of the output file ``out`` (and its parents)
    before anything is written there.

    Raises:
        OutputWriteError: ``out`` is a directory, a component of its path is
            an existing non-directory, or the directory cannot be created
            (exit 9).
    """
    if out.is_dir():
        raise write_error(IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)), out)
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
    input is an InputFileError; writing a file is an OutputWriteError."""
    if exc.filename is not None and same_file(Path(exc.filename), paths.input):
        return InputFileError(f"cannot read {paths.input}: {exc.strerror or exc}")
    return write_error(exc, None if exc.filename is not None else paths.output.parent)


def _run_locked(
    paths: RunPaths,
    files: OutputFiles,
    done: Done,
    settings: Settings,
    reader: Reader,
    factories: tuple[EngineFactory, TokenizerFactory],
    progress_plain: bool,
    started: float,
    stop: StopToken,
    check_row: Callable[[RawRow], RawRow] | None,
    job: Job,
) -> dict[str, Any]:
    """The body of :func:`run`, with the lock held and the journal written."""
    engine_factory, tokenizer_factory = factories
    scan = scan_input(paths.input)
    rows = map(check_row, reader) if check_row is not None else iter(reader)
    first = next(rows, None)
    if first is None:  # no rows at all: no model to load
        model: str = ""
        engine: Engine = NoEngine()
        tokenizer = None
        engine_choice: dict[str, Any] = {}
    else:
        model = resolve_model(settings.model)
        tokenizer = tokenizer_factory(model, settings.engine.trust_remote_code)
        engine_choice = {}
        if job.calibrate:  # the dtype probe and the tuning measure generation
            # the probe starts engines of its own: never a kept engine (serve and eval pass one), which it would reuse
            device = detect_device()
            settings, engine_choice = measured_settings(model, settings, device, vllm_engine, print_to_stderr)
            # an engine that outlives the run (a shared one) is not sized to it
            sized = job.sized_kv_cache and device == "cpu" and not getattr(engine_factory, "outlives_run", False)
            tokens = job_tokens(settings, scan) if sized else None
            if tokens is not None and (kv := sized_kv_cache(model, settings.engine, tokens)):
                settings = with_engine(settings, kv_cache_memory_bytes=kv["kv_cache_memory_bytes"])
                engine_choice["kv_cache"] = kv
        engine = engine_factory(model, with_priority_scheduling(settings, scan.mentions_priority))
    settings = settings.resolve_chat_template(tokenizer)
    load_s = time.monotonic() - started
    try:
        planner = job.planner(tokenizer, settings, engine, model)
        prior = length_prior(model, str(paths.output))
        generation = Generation(
            paths, files, done, settings, engine, planner, progress_plain, scan.rows, prior, job.parse
        )
        generation.run(itertools.chain([first], rows) if first is not None else (), stop)
    finally:
        engine.close()
    report = generation.report(reader, model, load_s, time.monotonic() - started)
    report["engine_choice"] = engine_choice
    report["peak_rss_bytes"] = peak_rss_bytes()
    if job.describe is not None:
        job.describe(report, planner)
    write_report(report, paths.report)
    write_run_html(report, paths.html)
    if job.calibrate:
        record_calibration(report, this_machine(), completion_lengths=generation.progress.work.length_quantiles())
    return report
