"""``bulkinfer run``: read -> plan -> generate -> write -> report, streaming.

The input is read in windows of ``plan.window_rows`` rows; each window is
tokenized, sorted and bucketed, then fed to the engine while at most
``max_in_flight`` requests are unfinished. The next window is planned as soon
as the current one is handed over, while the engine (its own process) keeps
computing, so continuous batching never drains between buckets or windows.
Memory is bounded by about two windows plus the requests in flight.
"""

from __future__ import annotations

import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer import writers
from bulkinfer.config import Settings
from bulkinfer.engine import Completion, Engine, configure_environment
from bulkinfer.errors import EXIT_OK, EXIT_PARTIAL, EngineError, InputFileError, Interrupted
from bulkinfer.journal import Done, OutputFiles, input_identity, settings_fingerprint
from bulkinfer.models import DEFAULT_MODEL, resolve_model
from bulkinfer.planner import Planner, bucket_index, bucket_label
from bulkinfer.progress import Progress
from bulkinfer.readers import Reader, open_reader
from bulkinfer.report import peak_rss_bytes, throughput, write_report
from bulkinfer.rows import COMPLETIONS_URL, Request, RowError, RowInvalid, parse_row

EngineFactory = Callable[[str, Settings], Engine]
# completion-length histogram bins (tokens): 1, 2, 3-4, 5-8, ..., 8193+
LENGTH_BINS: tuple[int, ...] = tuple(2**i for i in range(14))


@dataclass(frozen=True, slots=True)
class RunPaths:
    """Where one run reads and writes."""

    input: Path
    output: Path

    @property
    def errors(self) -> Path:
        return writers.sibling(self.output, ".errors.jsonl")

    @property
    def report(self) -> Path:
        return writers.sibling(self.output, ".report.json")

    @property
    def html(self) -> Path:
        return writers.sibling(self.output, ".report.html")

    @classmethod
    def build(cls, input_path: Path, output: Path | None) -> RunPaths:
        out = output if output is not None else writers.default_output(input_path)
        writers.check_output_path(out)
        return cls(input_path, out)


@dataclass(frozen=True, slots=True)
class RunResult:
    report: dict[str, Any]
    exit_code: int


class StopSignals:
    """Turns SIGINT, SIGTERM and SIGHUP into a flag the run loop checks, so a
    stop finishes cleanly: no new requests, finished rows flushed and fsync'd,
    exit code 128 + N. A second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            raise Interrupted(signum, f"stopped at once by a second {signal.Signals(signum).name}")
        self.received = signum

    def interrupted(self, detail: str) -> Interrupted:
        assert self.received is not None
        return Interrupted(self.received, f"stopped by {signal.Signals(self.received).name}: {detail}")


def count_rows(path: Path) -> int | None:
    """A fast estimate of the rows in ``path`` for progress: newlines for
    JSONL (read in 1 MiB blocks), the footer's row count for Parquet."""
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        count, last = 0, b"\n"
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                count += block.count(b"\n")
                last = block[-1:]
        return count + (last != b"\n")
    except Exception:
        return None


def to_request(data: Any, seq: int, line: int, settings: Settings) -> Request:
    """:func:`~bulkinfer.rows.parse_row` with the run's settings applied: with
    ``apply_chat_template`` a ``prompt`` becomes a one-message user chat
    (except on OpenAI ``/v1/completions`` lines).

    Raises:
        RowInvalid: as parse_row.
    """
    request = parse_row(data, seq, line, settings.sampling)
    if settings.apply_chat_template and request.prompt is not None and request.openai_url != COMPLETIONS_URL:
        request.messages, request.prompt = [{"role": "user", "content": request.prompt}], None
    return request


def iter_windows(
    reader: Reader, settings: Settings, on_error: Callable[[RowError], None], done: Done | None = None
) -> Iterator[list[Request]]:
    """Valid requests from ``reader`` in windows of ``plan.window_rows``; every
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
    import sys

    try:
        from bulkinfer.html_report import run_sections, write_html

        write_html(f"bulkinfer: {report['input']}", run_sections(report), path)
    except Exception as exc:  # matplotlib missing, a font problem, ...
        print(f"bulkinfer: warning: HTML report not written: {type(exc).__name__}: {exc}", file=sys.stderr)


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """The model's Hugging Face tokenizer (fast when one exists)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)


def vllm_engine(model: str, settings: Settings) -> Engine:
    from bulkinfer.engine import VllmEngine

    return VllmEngine(model, settings.engine)


def run(
    paths: RunPaths,
    settings: Settings,
    *,
    overwrite: bool = False,
    resume: bool = False,
    engine_factory: EngineFactory = vllm_engine,
    progress_plain: bool = False,
) -> RunResult:
    """Run every row of ``paths.input`` through the model; write the output,
    errors and report files. Returns the report and the exit code
    (:data:`EXIT_OK`, or :data:`EXIT_PARTIAL` when some rows failed).

    With ``resume``, rows an interrupted run finished are kept and skipped;
    on a complete output it does nothing (exit 0).

    Raises:
        OutputExistsError: the output (or an interrupted run's partial output)
            exists and neither ``overwrite`` nor ``resume`` allows going on.
        LockHeldError: another run holds this output's lock.
        ConfigError: ``resume`` with another input or other settings.
        InputFileError: the input cannot be read (before any model loads).
        ModelError, EngineError: the model or engine cannot start, or the engine dies.
        Interrupted: SIGINT, SIGTERM or SIGHUP arrived; finished rows are on
            disk in the spool beside the output (exit code 128 + N).
    """
    started = time.monotonic()
    if paths.input.resolve() == paths.output.resolve():
        raise InputFileError(f"output {paths.output} would overwrite the input")
    reader = open_reader(paths.input, passthrough=settings.passthrough)
    paths.output.parent.mkdir(parents=True, exist_ok=True)
    files = OutputFiles(paths.output, paths.errors)
    with files.locked():
        if resume and not overwrite and files.is_complete():
            files.discard_partial()
            report = orjson.loads(paths.report.read_bytes()) if paths.report.exists() else {}
            return RunResult({**report, "already_complete": True}, EXIT_OK)
        done = files.start(input_identity(paths.input), settings_fingerprint(settings), resume, overwrite)
        configure_environment()
        with StopSignals() as signals:
            model = resolve_model(settings.model)
            tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
            engine = engine_factory(model, settings)
            load_s = time.monotonic() - started
            try:
                if signals.received is not None:
                    raise signals.interrupted("before any row was run")
                planner = Planner(tokenizer, settings.plan, engine.max_model_len)
                generation = Generation(paths, files, done, settings, engine, planner, signals, progress_plain)
                generation.run(reader)
            finally:
                engine.close()
        report = generation.report(reader, model, load_s, time.monotonic() - started)
        report["peak_rss_bytes"] = peak_rss_bytes()
        write_report(report, paths.report)
        write_run_html(report, paths.html)
        from bulkinfer.plan_job import record_calibration

        record_calibration(report)
    code = EXIT_PARTIAL if report["request_counts"]["failed"] else EXIT_OK
    return RunResult(report, code)


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
        self.spool = writers.JsonlAppender(files.spool, append=resumed, already=done.completed)
        self.errors = writers.JsonlAppender(files.errors_spool, append=resumed, already=done.failed)
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

    def fail(self, error: RowError) -> None:
        self.errors.write(writers.error_record(error))
        self.progress.update(failed=1)

    def _engine_error(self, request: Request, message: str) -> RowError:
        return RowError(request.line, request.id, "engine_error", message, request.openai_url is not None)

    def run(self, reader: Reader) -> None:
        """Feed every row of ``reader`` and collect every result; then publish.

        Raises:
            EngineError: the engine died (finished rows stay in the spools).
            Interrupted: a stop signal arrived (likewise).
        """
        windows = iter_windows(reader, self.settings, self.fail, self.done)
        exhausted = False
        start = self._started = time.monotonic()
        while True:
            if self.signals.received is not None:
                self._close()
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
                    for error in errors:
                        self.fail(error)
                self.seconds["plan"] += time.monotonic() - t
            if not self.in_flight:
                break
            try:
                finished = self.engine.step()
            except EngineError:
                if self.signals.received is None:
                    self._close()
                    raise
                continue  # the signal also reached the engine's processes
            self._collect(finished)
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
            self.fail(self._engine_error(request, rejected.error or "rejected by the engine"))
        else:
            self.in_flight[request_id] = request

    def _collect(self, finished: list[Completion]) -> None:
        t = time.monotonic()
        for completion in finished:
            request = self.in_flight.pop(completion.request_id)
            if completion.error is not None:
                self.fail(self._engine_error(request, completion.error))
                continue
            self.spool.write(writers.output_record(request, completion, self.model_name))
            self.prompt_tokens += completion.prompt_tokens
            self.completion_tokens += completion.completion_tokens
            self.completion_lengths[bucket_index(completion.completion_tokens, LENGTH_BINS)] += 1
            self.progress.update(done=1, completion_tokens=completion.completion_tokens)
        if finished:
            self.spool.flush()
            self.errors.flush()
            elapsed = time.monotonic() - self._started
            if not self.timeline or elapsed - self.timeline[-1][0] >= 1.0:
                self.timeline.append((round(elapsed, 2), self.completion_tokens))
        self.seconds["write"] += time.monotonic() - t

    def _close(self) -> None:
        self.progress.close()
        self.spool.close()
        self.errors.close()

    def report(self, reader: Reader, model_path: str, load_s: float, total_s: float) -> dict[str, Any]:
        """The run report (see :mod:`bulkinfer.report` for the keys).

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
            "completion_length_histogram": [
                {"range": bucket_label(i, LENGTH_BINS), "rows": n} for i, n in sorted(self.completion_lengths.items())
            ],
            "timeline": [
                *self.timeline,
                (round(seconds["generate"], 2), self.completion_tokens),
            ],
        }
