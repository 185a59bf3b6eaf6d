"""``bulkinfer run``: read -> plan -> generate -> write -> report, streaming.

The input is read in windows of ``plan.window_rows`` rows; each window is
tokenized, sorted and bucketed, then fed to the engine while at most
``max_in_flight`` requests are unfinished. The next window is planned as soon
as the current one is handed over, while the engine (its own process) keeps
computing, so continuous batching never drains between buckets or windows.
Memory is bounded by about two windows plus the requests in flight.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.engine.base import Engine, EngineFactory, NoEngine
from bulkinfer.engine.feed import FeedStopped, feed
from bulkinfer.engine.log import EngineLog
from bulkinfer.engine.vllm import vllm_engine
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
from bulkinfer.io import formats, records
from bulkinfer.io.files import JsonlAppender
from bulkinfer.io.readers import RawRow, Reader, count_rows, open_reader
from bulkinfer.jobs.output_files import OutputFiles, input_identity, settings_fingerprint
from bulkinfer.models import DEFAULT_MODEL, TokenizerFactory, load_tokenizer, resolve_model
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.windows import iter_windows
from bulkinfer.report.calibration import record_calibration
from bulkinfer.report.html import write_run_html
from bulkinfer.report.progress import Progress
from bulkinfer.report.stats import RunStats, peak_rss_bytes, write_report
from bulkinfer.schema import Completion, Done, Request, RowError
from bulkinfer.stop import StopToken


@dataclass(frozen=True, slots=True)
class RunPaths:
    """Where one run reads and writes."""

    input: Path
    output: Path

    @property
    def errors(self) -> Path:
        return formats.sibling(self.output, ".errors.jsonl")

    @property
    def report(self) -> Path:
        return formats.sibling(self.output, ".report.json")

    @property
    def html(self) -> Path:
        return formats.sibling(self.output, ".report.html")

    @classmethod
    def build(cls, input_path: Path, output: Path | None) -> RunPaths:
        """The paths of a run; ``output`` defaults to ``INPUT_STEM.out.jsonl``.

        Raises:
            ConfigError: the output has an unknown suffix, or a path the run
                writes (output, errors, report, spool, journal, lock; see
                :meth:`bulkinfer.jobs.output_files.OutputFiles.paths`) is the input,
                by name, symlink or hard link.
        """
        out = output if output is not None else formats.default_output(input_path)
        formats.output_format(out)
        for path in OutputFiles(out).paths():
            if _same_file(path, input_path):
                what = "output" if path == out else f"the file {path.name} that output {out} writes"
                raise ConfigError(f"{what} would overwrite the input {input_path}; choose another -o")
        return cls(input_path, out)


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same real path, or (both
    existing) the same inode, so symlinks and hard links count."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


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
        ConfigError: ``resume`` with another input or other settings (once a
            row finished), or a ``[sampling]`` default vLLM rejects.
        InputFileError: the input cannot be read (before any model loads).
        ModelError, EngineError: the model or engine cannot start, or the
            engine dies (finished rows stay in the spools).
        OutputWriteError: a file of the run cannot be written (disk full,
            read-only, permission, not a directory); finished rows are kept.
        Interrupted: ``stop`` was set (the CLI sets it on SIGINT, SIGTERM or
            SIGHUP); finished rows are on disk in the spool beside the
            output (exit code 128 + N).

    ``engine_factory(model_path, settings)`` builds the engine,
    ``tokenizer_factory(model_path, trust_remote_code)`` loads the tokenizer
    (tests inject their own). Touches no process-wide state but the engine's
    log capture (file descriptors 1 and 2, see :mod:`bulkinfer.engine.log`):
    it runs in any thread.
    """
    started = time.monotonic()
    reader = open_reader(paths.input, passthrough=settings.passthrough)
    files = OutputFiles(paths.output)
    _check_writable_path(paths.output)
    try:
        paths.output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, paths.output.parent) from None
    with files.locked():
        try:
            if resume and not overwrite and files.is_complete():
                files.discard_partial()
                report = orjson.loads(paths.report.read_bytes()) if paths.report.exists() else {}
                return RunReport({**report, "already_complete": True}, EXIT_OK)
            done = files.start(input_identity(paths.input), settings_fingerprint(settings), resume, overwrite)
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


def _check_writable_path(out: Path) -> None:
    """Raises OutputWriteError when ``out`` is a directory or a component of
    its path is an existing non-directory (before anything is written)."""
    if out.is_dir():
        raise write_error(IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)), out)
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise write_error(NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), parent)
            break


def _os_error(exc: OSError, paths: RunPaths) -> BulkinferError:
    """An OSError that escaped the run as a bulkinfer error: reading the
    input is an InputFileError; writing a file is an OutputWriteError."""
    if exc.filename is not None and _same_file(Path(exc.filename), paths.input):
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
) -> dict[str, Any]:
    """The body of :func:`run`, with the lock held and the journal written."""
    engine_factory, tokenizer_factory = factories
    rows = iter(reader)
    first = next(rows, None)
    if first is None:  # no rows at all: no model to load
        model: str = ""
        engine: Engine = NoEngine()
        tokenizer = None
    else:
        model = resolve_model(settings.model)
        tokenizer = tokenizer_factory(model, settings.engine.trust_remote_code)
        engine = engine_factory(model, settings)
    settings = settings.resolve_chat_template(tokenizer)
    load_s = time.monotonic() - started
    try:
        planner = Planner(tokenizer, settings.plan, engine.max_model_len)
        generation = Generation(paths, files, done, settings, engine, planner, progress_plain)
        generation.run(itertools.chain([first], rows) if first is not None else (), stop)
    finally:
        engine.close()
    report = generation.report(reader, model, load_s, time.monotonic() - started)
    report["peak_rss_bytes"] = peak_rss_bytes()
    write_report(report, paths.report)
    write_run_html(report, paths.html)
    record_calibration(report)
    return report


class Generation:
    """One run's rows through the feed loop (:func:`bulkinfer.engine.feed.feed`):
    windows planned as the loop pulls requests, each result appended to the
    spools, progress and :class:`~bulkinfer.report.stats.RunStats` updated.
    Rows an earlier attempt finished (``done``) are skipped.
    """

    def __init__(
        self,
        paths: RunPaths,
        files: OutputFiles,
        done: Done,
        settings: Settings,
        engine: Engine,
        planner: Planner,
        progress_plain: bool = False,
    ):
        self.paths, self.files, self.done, self.settings = paths, files, done, settings
        self.engine, self.planner = engine, planner
        self.max_in_flight = settings.plan.max_in_flight or 2 * engine.max_num_seqs
        self.model_name = settings.model or DEFAULT_MODEL
        resumed = bool(done.completed or done.failed)
        self.spool = JsonlAppender(files.spool, append=resumed, already=done.completed)
        self.errors = JsonlAppender(files.errors_spool, append=resumed, already=done.failed)
        total = count_rows(paths.input)
        if total is not None:  # rows left for this attempt (blank lines included: an estimate)
            total = max(total - done.completed - done.failed, 0)
        self.progress = Progress(total, force_plain=progress_plain)
        self.stats = RunStats()
        # the engine's live counts when this run started (an engine may be reused)
        self._engine_base = (engine.generated_tokens, engine.prefilled_tokens)

    def fail(self, error: RowError, planned: bool = False) -> None:
        """Record a failed row; ``planned``: it failed in the engine, after planning."""
        self.errors.write(records.error_record(error))
        self.progress.update(failed=1, planned=planned)

    def run(self, rows: Iterable[RawRow], stop: StopToken) -> None:
        """Feed every row and collect every result; then publish.

        Raises:
            EngineError: the engine died (finished rows stay in the spools).
            Interrupted: ``stop`` was set (likewise).
            OSError: a spool or final file cannot be written (likewise).
        """
        try:
            self._feed(rows, stop)
        except BaseException:
            self._close(failed=True)
            raise

    def _feed(self, rows: Iterable[RawRow], stop: StopToken) -> None:
        stop.starting = False  # from here on a stop finishes cleanly
        if stop.is_set():
            raise stop.interrupted("before any row was run")
        self.stats.start()
        try:
            feed(
                self.engine,
                self._requests(iter_windows(rows, self.settings, self.fail, self.done)),
                max_in_flight=self.max_in_flight,
                on_finished=self._finished,
                on_failed=self._failed,
                on_step=self._stepped,
                stop=stop,
            )
        except FeedStopped:
            raise stop.interrupted(
                f"{self.spool.count} finished rows and {self.errors.count} errors kept in "
                f"{self.spool.path} and {self.errors.path}; continue with --resume"
            ) from None
        self.stats.generation_ended()
        with self.stats.timed("write"):
            self._close()
            self.files.finish()
        self.planner.padding.finish()

    def _requests(self, windows: Iterator[list[Request]]) -> Iterator[Request]:
        """Planned requests, a window at a time (planning is timed as ``plan``)."""
        while True:
            with self.stats.timed("plan"):
                window = next(windows, None)
                if window is None:
                    return
                planned, errors = self.planner.plan_window(window)
                for request in planned:
                    self.progress.planned(len(request.prompt_token_ids or ()), request.max_tokens)
                for error in errors:
                    self.fail(error)
            yield from planned

    def _failed(self, request: Request, message: str) -> None:
        error = RowError(request.line, request.id, "engine_error", message, request.openai_url is not None)
        self.fail(error, planned=True)

    def _finished(self, request: Request, completion: Completion) -> None:
        self.spool.write(records.output_record(request, completion, self.model_name))
        self.stats.finished(completion)
        self.progress.update(done=1, completion_tokens=completion.completion_tokens)

    def _stepped(self, finished: list[Completion]) -> None:
        """After an engine step: flush what finished; the engine's live token
        counts to the progress display and the timeline."""
        if finished:
            with self.stats.timed("write"):
                self.spool.flush()
                self.errors.flush()
        generated = self.engine.generated_tokens - self._engine_base[0]
        prefilled = self.engine.prefilled_tokens - self._engine_base[1]
        self.progress.tick(generated, prefilled, self.engine.running_lengths())
        self.stats.sample(generated)

    def _close(self, failed: bool = False) -> None:
        """Close the progress display and the spools; after a failure
        (``failed``) without raising, keeping what reached the disk."""
        self.progress.close()
        if failed:
            self.spool.abandon()
            self.errors.abandon()
        else:
            self.spool.close()
            self.errors.close()

    def report(self, reader: Reader, model_path: str, load_s: float, total_s: float) -> dict[str, Any]:
        """The run report (see :mod:`bulkinfer.report.stats` for the keys)."""
        return self.stats.report(
            paths={"input": self.paths.input, "output": self.paths.output, "errors": self.paths.errors},
            model=self.model_name,
            model_path=model_path,
            counts=(self.spool.count, self.errors.count, reader.blank_lines),
            done=self.done,
            load_s=load_s,
            total_s=total_s,
            padding=self.planner.padding.to_report(),
            plan={
                "order": self.settings.plan.order,
                "window_rows": self.settings.plan.window_rows,
                "max_in_flight": self.max_in_flight,
                "bucket_bounds": list(self.settings.plan.buckets),
            },
            engine=self.engine.settings,
            sampling=self.settings.to_dict()["sampling"],
            chat_template_applied=self.settings.apply_chat_template,
        )
