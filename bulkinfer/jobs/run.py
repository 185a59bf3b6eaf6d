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
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.engine.base import Engine, EngineFactory, NoEngine
from bulkinfer.engine.log import EngineLog, terminal
from bulkinfer.engine.vllm import configure_environment
from bulkinfer.errors import (
    EXIT_OK,
    EXIT_PARTIAL,
    BulkinferError,
    ConfigError,
    EngineError,
    InputFileError,
    Interrupted,
    ModelError,
    write_error,
)
from bulkinfer.io import formats, records
from bulkinfer.io.files import JsonlAppender
from bulkinfer.io.readers import RawRow, Reader, count_rows, open_reader
from bulkinfer.jobs.output_files import Done, OutputFiles, input_identity, settings_fingerprint
from bulkinfer.models import DEFAULT_MODEL, resolve_model
from bulkinfer.prep.planner import Planner, bucket_index, bucket_label
from bulkinfer.prep.rows import parse_row
from bulkinfer.report.progress import Progress
from bulkinfer.report.stats import peak_rss_bytes, throughput, write_report
from bulkinfer.schema import COMPLETIONS_URL, Completion, Request, RowError, RowInvalid

# completion-length histogram bins (tokens): 1, 2, 3-4, 5-8, ..., 8193+
LENGTH_BINS: tuple[int, ...] = tuple(2**i for i in range(14))
# The feed loop waits at most this long (seconds) for an engine step before it
# looks at stop signals again.
STEP_WAIT_S = 0.5


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
class RunResult:
    report: dict[str, Any]
    exit_code: int


class StopSignals:
    """Turns SIGINT, SIGTERM and SIGHUP into a flag the run loop checks, so a
    stop finishes cleanly: no new requests, finished rows flushed and fsync'd,
    exit code 128 + N. A second signal stops at once.

    While ``immediate`` is True (model load and engine start: nothing to
    flush yet) the first signal raises :class:`Interrupted` at once, wherever
    the main thread is; the engine start cleans its processes up."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        self.immediate = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise Interrupted(signum, f"stopped at once by a second {name}")
        self.received = signum
        if self.immediate:
            from bulkinfer.engine.watchdog import kill_all_now

            kill_all_now()  # an engine being started dies now, not after vLLM's graceful shutdown
            raise Interrupted(signum, f"stopped by {name} before any row was run")

    def interrupted(self, detail: str) -> Interrupted:
        assert self.received is not None
        return Interrupted(self.received, f"stopped by {signal.Signals(self.received).name}: {detail}")


def to_request(data: Any, seq: int, line: int, settings: Settings) -> Request:
    """:func:`~bulkinfer.prep.rows.parse_row` with the run's settings applied: with
    ``apply_chat_template`` a ``prompt`` becomes a one-message user chat
    (except on OpenAI ``/v1/completions`` lines).

    Raises:
        RowInvalid: as parse_row.
    """
    if not isinstance(settings.apply_chat_template, bool):
        raise ValueError('apply_chat_template "auto" must be resolved first (Settings.resolve_chat_template)')
    request = parse_row(data, seq, line, settings.sampling)
    if settings.apply_chat_template and request.prompt is not None and request.openai_url != COMPLETIONS_URL:
        request.messages, request.prompt = [{"role": "user", "content": request.prompt}], None
    return request


def iter_windows(
    reader: Iterable[RawRow], settings: Settings, on_error: Callable[[RowError], None], done: Done | None = None
) -> Iterator[list[Request]]:
    """Valid requests from ``reader`` (raw rows in file order) in windows of ``plan.window_rows``; every
    invalid row (undecodable, bad fields, duplicate id) goes to ``on_error``.
    The first occurrence of an id runs; later ones are ``duplicate_id`` errors.
    Rows an earlier attempt finished (``done``: error lines, completed ids)
    are skipped."""
    done = done or Done()
    seen: set[str] = set(done.done_ids)
    window_ids_skipped: set[str] = set()
    window: list[Request] = []
    for seq, raw in enumerate(reader):
        if raw.line in done.done_lines:
            continue
        if raw.error is not None:
            on_error(raw.error.to_error(raw.line))
            continue
        try:
            request = to_request(raw.data, seq, raw.line, settings)
        except RowInvalid as exc:
            on_error(exc.to_error(raw.line))
            continue
        if request.id in done.done_ids and request.id not in window_ids_skipped:
            window_ids_skipped.add(request.id)
            continue
        if request.id in seen:
            on_error(
                RowError(
                    raw.line,
                    request.id,
                    "duplicate_id",
                    f"id '{request.id}' already appeared earlier in the file",
                    request.openai_url is not None,
                )
            )
            continue
        seen.add(request.id)
        window.append(request)
        if len(window) >= settings.plan.window_rows:
            yield window
            window = []
    if window:
        yield window


def write_run_html(report: dict[str, Any], path: Path) -> None:
    """The self-contained HTML report beside the output. A failure to draw it
    is reported on stderr and never fails the run (the JSON report has it all)."""
    try:
        from bulkinfer.report.html import run_sections, write_html

        write_html(f"bulkinfer: {report['input']}", run_sections(report), path)
    except Exception as exc:  # matplotlib missing, a font problem, ...
        print(f"bulkinfer: warning: HTML report not written: {type(exc).__name__}: {exc}", file=terminal())


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """The model's Hugging Face tokenizer (fast when one exists).

    Raises:
        ModelError: transformers cannot load a tokenizer from ``model``.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load the tokenizer of {model}: {type(exc).__name__}: {exc}") from None


def vllm_engine(model: str, settings: Settings) -> Engine:
    """The real engine: vLLM's ``SamplingParams`` checks the ``[sampling]``
    defaults first (ConfigError), then the engine starts."""
    from bulkinfer.engine.vllm import VllmEngine, check_sampling_defaults

    check_sampling_defaults(settings.sampling)
    return VllmEngine(model, settings.engine, stall_timeout_s=settings.plan.stall_timeout_s)


def run(
    paths: RunPaths,
    settings: Settings,
    *,
    overwrite: bool = False,
    resume: bool = False,
    engine_factory: EngineFactory = vllm_engine,
    progress_plain: bool = False,
    verbose: bool = False,
) -> RunResult:
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
        Interrupted: SIGINT, SIGTERM or SIGHUP arrived; finished rows are on
            disk in the spool beside the output (exit code 128 + N).
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
                return RunResult({**report, "already_complete": True}, EXIT_OK)
            done = files.start(input_identity(paths.input), settings_fingerprint(settings), resume, overwrite)
            resumed = bool(done.completed or done.failed)
            try:
                with EngineLog(files.log, verbose, append=resumed) as log:
                    try:
                        report = _run_locked(
                            paths, files, done, settings, reader, engine_factory, progress_plain, started
                        )
                    except (EngineError, ModelError) as exc:
                        raise log.explain(exc) from exc
            except BaseException:
                files.discard_if_nothing_done()
                raise
        except OSError as exc:
            raise _os_error(exc, paths) from exc
    code = EXIT_PARTIAL if report["request_counts"]["failed"] else EXIT_OK
    return RunResult(report, code)


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
    engine_factory: EngineFactory,
    progress_plain: bool,
    started: float,
) -> dict[str, Any]:
    """The body of :func:`run`, with the lock held and the journal written."""
    configure_environment()
    with StopSignals() as signals:
        rows = iter(reader)
        first = next(rows, None)
        if first is None:  # no rows at all: no model to load
            model: str = ""
            engine: Engine = NoEngine()
            tokenizer = None
        else:
            model = resolve_model(settings.model)
            tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
            engine = engine_factory(model, settings)
        settings = settings.resolve_chat_template(tokenizer)
        load_s = time.monotonic() - started
        try:
            planner = Planner(tokenizer, settings.plan, engine.max_model_len)
            generation = Generation(paths, files, done, settings, engine, planner, signals, progress_plain)
            generation.run(itertools.chain([first], rows) if first is not None else ())
        finally:
            engine.close()
    report = generation.report(reader, model, load_s, time.monotonic() - started)
    report["peak_rss_bytes"] = peak_rss_bytes()
    write_report(report, paths.report)
    write_run_html(report, paths.html)
    from bulkinfer.jobs.plan import record_calibration

    record_calibration(report)
    return report


class Generation:
    """The feed loop of one run and its counters.

    Keeps at most ``max_in_flight`` requests in the engine, plans the next
    window when the planned ones run out, and appends each finished row to
    the spools. Rows an earlier attempt finished (``done``) are skipped.
    """

    def __init__(
        self,
        paths: RunPaths,
        files: OutputFiles,
        done: Done,
        settings: Settings,
        engine: Engine,
        planner: Planner,
        signals: StopSignals,
        progress_plain: bool = False,
    ):
        self.paths, self.files, self.done, self.settings = paths, files, done, settings
        self.engine, self.planner, self.signals = engine, planner, signals
        self.max_in_flight = settings.plan.max_in_flight or 2 * engine.max_num_seqs
        self.model_name = settings.model or DEFAULT_MODEL
        resumed = bool(done.completed or done.failed)
        self.spool = JsonlAppender(files.spool, append=resumed, already=done.completed)
        self.errors = JsonlAppender(files.errors_spool, append=resumed, already=done.failed)
        total = count_rows(paths.input)
        if total is not None:  # rows left for this attempt (blank lines included: an estimate)
            total = max(total - done.completed - done.failed, 0)
        self.progress = Progress(total, force_plain=progress_plain)
        self.pending: deque[Request] = deque()
        self.in_flight: dict[str, Request] = {}
        self.seconds = {"plan": 0.0, "generate": 0.0, "write": 0.0}
        self.prompt_tokens = self.completion_tokens = 0
        # for the HTML report: completion lengths (power-of-two bins) and the
        # cumulative completion tokens over time (at most one point a second)
        self.completion_lengths: Counter[int] = Counter()
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self._started = time.monotonic()
        # the engine's live counts when this run started (an engine may be reused)
        self._engine_base = (engine.generated_tokens, engine.prefilled_tokens)

    def fail(self, error: RowError, planned: bool = False) -> None:
        """Record a failed row; ``planned``: it failed in the engine, after planning."""
        self.errors.write(records.error_record(error))
        self.progress.update(failed=1, planned=planned)

    def _engine_error(self, request: Request, message: str) -> RowError:
        return RowError(request.line, request.id, "engine_error", message, request.openai_url is not None)

    def run(self, rows: Iterable[RawRow]) -> None:
        """Feed every row and collect every result; then publish.

        Raises:
            EngineError: the engine died (finished rows stay in the spools).
            Interrupted: a stop signal arrived (likewise).
            OSError: a spool or final file cannot be written (likewise).
        """
        try:
            self._feed(rows)
        except BaseException:
            self._close(failed=True)
            raise

    def _feed(self, rows: Iterable[RawRow]) -> None:
        windows = iter_windows(rows, self.settings, self.fail, self.done)
        exhausted = False
        start = self._started = time.monotonic()
        self.signals.immediate = False  # from here on a first signal stops cleanly
        if self.signals.received is not None:
            raise self.signals.interrupted("before any row was run")
        while True:
            if self.signals.received is not None:
                raise self.signals.interrupted(
                    f"{self.spool.count} finished rows and {self.errors.count} errors kept in "
                    f"{self.spool.path} and {self.errors.path}; continue with --resume"
                )
            while len(self.in_flight) < self.max_in_flight and not (exhausted and not self.pending):
                if self.pending:
                    self._add(self.pending.popleft())
                    continue
                t = time.monotonic()
                window = next(windows, None)
                if window is None:
                    exhausted = True
                else:
                    planned, errors = self.planner.plan_window(window)
                    self.pending.extend(planned)
                    for request in planned:
                        self.progress.planned(len(request.prompt_token_ids or ()), request.max_tokens)
                    for error in errors:
                        self.fail(error)
                self.seconds["plan"] += time.monotonic() - t
            if not self.in_flight:
                break
            try:
                finished = self.engine.step(wait=STEP_WAIT_S)
            except EngineError:
                if self.signals.received is None:
                    raise
                continue  # the signal also reached the engine's processes
            self._collect(finished)
            self._tick()
        self.seconds["generate"] = time.monotonic() - start
        t = time.monotonic()
        self._close()
        self.files.finish()
        self.seconds["write"] += time.monotonic() - t
        self.planner.padding.finish()

    def _add(self, request: Request) -> None:
        request_id = str(request.seq)
        rejected = self.engine.add(request_id, request)
        if rejected is not None:
            self.fail(self._engine_error(request, rejected.error or "rejected by the engine"), planned=True)
        else:
            self.in_flight[request_id] = request

    def _collect(self, finished: list[Completion]) -> None:
        t = time.monotonic()
        for completion in finished:
            request = self.in_flight.pop(completion.request_id)
            if completion.error is not None:
                self.fail(self._engine_error(request, completion.error), planned=True)
                continue
            self.spool.write(records.output_record(request, completion, self.model_name))
            self.prompt_tokens += completion.prompt_tokens
            self.completion_tokens += completion.completion_tokens
            self.completion_lengths[bucket_index(completion.completion_tokens, LENGTH_BINS)] += 1
            self.progress.update(done=1, completion_tokens=completion.completion_tokens)
        if finished:
            self.spool.flush()
            self.errors.flush()
        self.seconds["write"] += time.monotonic() - t

    def _tick(self) -> None:
        """After an engine step: the engine's live token counts to the
        progress display, and to the timeline (at most one point a second)."""
        generated = self.engine.generated_tokens - self._engine_base[0]
        prefilled = self.engine.prefilled_tokens - self._engine_base[1]
        self.progress.tick(generated, prefilled, self.engine.running_lengths())
        elapsed = time.monotonic() - self._started
        if elapsed - self.timeline[-1][0] >= 1.0:
            self.timeline.append((round(elapsed, 2), max(generated, self.completion_tokens)))

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
        """The run report (see :mod:`bulkinfer.report.stats` for the keys).

        ``tokens`` and ``request_counts`` cover the whole output (resumed rows
        included); ``throughput``, ``buckets`` and ``padding_efficiency`` cover
        the rows this attempt ran.
        """
        done = self.done
        completed, failed, skipped = self.spool.count, self.errors.count, reader.blank_lines
        ran = completed - done.completed
        seconds = {"load": load_s, **self.seconds, "total": total_s}
        return {
            "input": str(self.paths.input),
            "output": str(self.paths.output),
            "errors": str(self.paths.errors),
            "model": self.model_name,
            "model_path": model_path,
            "rows": completed + failed + skipped,
            "request_counts": {
                "total": completed + failed + skipped,
                "completed": completed,
                "failed": failed,
                "skipped": skipped,
            },
            "resumed": {"completed": done.completed, "failed": done.failed},
            "tokens": {
                "prompt": done.prompt_tokens + self.prompt_tokens,
                "completion": done.completion_tokens + self.completion_tokens,
            },
            "seconds": seconds,
            "throughput": throughput(ran, self.prompt_tokens, self.completion_tokens, seconds["generate"]),
            "throughput_end_to_end": throughput(ran, self.prompt_tokens, self.completion_tokens, total_s),
            **self.planner.padding.to_report(),
            "plan": {
                "order": self.settings.plan.order,
                "window_rows": self.settings.plan.window_rows,
                "max_in_flight": self.max_in_flight,
                "bucket_bounds": list(self.settings.plan.buckets),
            },
            "engine": self.engine.settings,
            "sampling": self.settings.to_dict()["sampling"],
            "chat_template_applied": self.settings.apply_chat_template,
            "completion_length_histogram": [
                {"range": bucket_label(i, LENGTH_BINS), "rows": n} for i, n in sorted(self.completion_lengths.items())
            ],
            "timeline": [
                *self.timeline,
                (round(seconds["generate"], 2), self.completion_tokens),
            ],
        }
