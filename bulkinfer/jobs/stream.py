"""``bulkinfer run -``: rows read from standard input as they arrive, each
result written as soon as it is done.

The file pipeline reads its input to the end before the last window is
planned and publishes at the end; a stream never ends on its own schedule
(``tail -f``, a queue consumer, another program's output). Here:

- a thread reads JSONL rows from the stream into a bounded queue (the writer
  blocks when it is full), so memory holds at most the queue, a window and
  ``max_in_flight`` requests however long the stream runs;
- a window goes to the planner (tokenized, sorted by length, as a file's)
  when it holds ``[plan] window_rows`` rows or its oldest row has waited
  ``[plan] max_wait_s`` seconds (``--max-wait``), or the input ended
  (:func:`~bulkinfer.jobs.stream_windows.stream_requests`); its
  requests join the engine while earlier ones generate (the one feed loop,
  :func:`bulkinfer.engine.feed.feed`, which steps the engine while no
  request is ready);
- every finished row is one JSONL line on the output (``-o -``, standard
  output, the default; or a ``.jsonl`` file), flushed after each engine
  step; a failed row is an error record on the same stream (or on
  ``paths.errors`` when given). Completion order by default; ``input``
  holds finished records until every earlier row has its record
  (:class:`~bulkinfer.io.stream_out.StreamWriter`: at most ``window_rows``
  records plus a window's rows).

The end of the input finishes the run as usual; a stop signal (SIGTERM,
SIGINT) stops it with every row finished so far written (rows still in the
engine are not: they have no record; in input order, neither are records
held for an earlier unfinished row). Rows are not checked for duplicate ids
(that would hold every id of an unbounded stream): each row gets its
record. ``--resume`` needs a file output: it appends to it, and rows whose
id has a record there (output or errors file) are skipped
(:func:`~bulkinfer.io.stream_out.done_ids`); standard output keeps nothing
to resume from.

vLLM logs to standard output: while the engine runs, file descriptors 1 and
2 go to a log file (:class:`~bulkinfer.engine.log.EngineLog`; ``--verbose``:
fd 1 goes to standard error) and the output is written to a copy of the
original standard output, so no log line enters the data.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_MODEL, bulkinfer_home
from bulkinfer.engine.feed import PENDING, FeedStopped, feed
from bulkinfer.engine.heap import set_heap
from bulkinfer.engine.log import EngineLog, terminal, warn
from bulkinfer.errors import EXIT_OK, EXIT_PARTIAL, ConfigError, EngineError, ModelError
from bulkinfer.io import records
from bulkinfer.io.files import atomic_write, keep_newest
from bulkinfer.io.inputs import InputScan
from bulkinfer.io.journal import results_record, results_settings
from bulkinfer.io.output_files import OutputFiles, same_file
from bulkinfer.io.readers import RowQueue, StreamReader
from bulkinfer.io.stream_out import (
    STDOUT,
    STREAM_INPUT,
    StreamWriter,
    check_resumable,
    close_sinks,
    done_ids,
    open_sink,
)
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.engine_choice import choose_engine_settings
from bulkinfer.jobs.run import GENERATE, RunReport, make_output_dir
from bulkinfer.jobs.stream_windows import stream_requests
from bulkinfer.models import resolve_model
from bulkinfer.report.progress import Progress
from bulkinfer.schema import Completion, Request, RowError

QUEUE_WINDOWS = 2  # rows read ahead of the planner at most, in windows (the reading thread waits beyond)
KEEP_LOGS = 100  # logs of streams to standard output kept in $BULKINFER_HOME/logs
STOP_WAIT_S = 5.0  # how long a stopped stream waits for a pipe's reader to take what is buffered


@dataclass(frozen=True, slots=True)
class StreamPaths:
    """Where a stream's records go: ``output`` (``-``: standard output) and
    ``errors`` (None: the output stream itself); ``log``: the engine's log."""

    output: Path
    errors: Path | None
    log: Path

    @classmethod
    def build(cls, output: Path | None, errors: Path | None = None) -> StreamPaths:
        """``output`` None or ``-`` is standard output, logging to
        ``$BULKINFER_HOME/logs/stream-<time>-<pid>.log`` (the newest :data:`KEEP_LOGS` kept: a
        cron line's streams would fill the disk); a file logs beside it (``OUT.log``).

        Raises:
            ConfigError: an output or errors file that is not JSONL (Parquet cannot be
                appended to); ``errors`` is the output (opened twice, it would lose records).
        """
        output = output or STDOUT
        for path in (output, errors):
            if path is not None and path != STDOUT and path.suffix.lower() not in (".jsonl", ".ndjson"):
                raise ConfigError(f"{path}: a stream's records are written as they finish: give a .jsonl file or -")
        if errors is not None and (errors == output or (output != STDOUT and same_file(errors, output))):
            if output != STDOUT:
                raise ConfigError(
                    f"--errors {errors} is the output file: leave --errors out to write the error records "
                    "there, or give another file"
                )
            errors = None  # both standard output: the records' default
        if output == STDOUT:
            logs = bulkinfer_home() / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            keep_newest(logs, "stream-*.log", KEEP_LOGS - 1)
            log = logs / f"stream-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        else:
            log = output.with_name(output.stem + ".log")
        return cls(output, errors, log)


def stream(
    source: IO[bytes],
    paths: StreamPaths,
    settings: Settings,
    context: RunContext | None = None,
) -> RunReport:
    """Run every row of ``source`` (a binary stream of JSONL rows, read as
    they arrive) and write each result as soon as it is done (see the
    module docstring): ``paths.output`` gets one output record per finished
    row, in completion order (standard output for ``-``), the errors stream
    one error record per failed row. Returns the report (rows, tokens,
    seconds, windows; also written to ``OUT.report.json`` for a file
    output) and exit code 0, or 3 when some rows failed. With
    ``context.resume`` (a file output), the files are appended to and rows
    with a record there are skipped (``request_counts.resumed``).

    Raises:
        ConfigError: ``--resume`` with standard output (nothing to resume
            from); an output to resume from that is not JSONL records, was
            written with other settings or by a file's run
            (:func:`~bulkinfer.io.stream_out.check_resumable`);
            ``BULKINFER_HEAP`` other than ``arenas``, ``flat`` or ``glibc``.
        OutputExistsError: a file output exists, without ``overwrite``.
        LockHeldError: another run or stream writes the file output (exit 7).
        Interrupted: a stop signal (every row finished so far is written).
        EngineError, ModelError: the engine failed (likewise).
        OSError: the output cannot be written.
    """
    started = time.monotonic()
    context = context or RunContext()
    try:
        heap = set_heap()  # a long stream's C heap levels off (bulkinfer/engine/heap.py)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if context.resume and paths.output == STDOUT:
        raise ConfigError(
            "--resume is not offered for standard input to standard output: a stream cannot be read again "
            "and standard output keeps nothing; give -o OUT.jsonl, and a stream to a file can be resumed by "
            "id (rows whose id has a record there are skipped)"
        )
    for path in (paths.output, paths.errors):
        if path is not None and path != STDOUT:
            make_output_dir(path)
    with contextlib.ExitStack() as held:
        done: set[str] = set()
        if paths.output != STDOUT:
            state = OutputFiles(paths.output)
            held.enter_context(state.locked())  # another run or stream writing OUT: exit 7
            if context.resume:
                unchecked = check_resumable(state, results_settings(settings))
                if unchecked:
                    warn(unchecked)
                done = set().union(*(done_ids(path) for path in (paths.output, paths.errors) if path is not None))
        return _open_and_stream(source, paths, settings, context, done, (started, heap))


def _open_and_stream(
    source: IO[bytes],
    paths: StreamPaths,
    settings: Settings,
    context: RunContext,
    done: set[str],
    started_heap: tuple[float, str],
) -> RunReport:
    """:func:`stream` once its files may be written: opens them and runs."""
    sink = errors = open_sink(paths.output, context.overwrite, context.resume)
    # --verbose keeps the engine's log on the terminal: on standard error, never in the data
    saved = os.dup(1) if context.verbose and paths.output == STDOUT else None
    failed = True
    try:
        if paths.errors is not None:
            errors = open_sink(paths.errors, context.overwrite, context.resume)
        if paths.output != STDOUT:  # once it may be written: the settings it is the result of, for --resume
            record = results_record(STREAM_INPUT, results_settings(settings))
            atomic_write(OutputFiles(paths.output).journal, orjson.dumps(record))
        if saved is not None:
            os.dup2(2, 1)
        with EngineLog(paths.log, context.verbose) as log:
            try:
                writer = StreamWriter(sink, errors, *_order(settings), done=done, guard=context.stop.blocking_write)
                report = _stream(source, paths, settings, context, writer, *started_heap)
                failed = False
                return report
            except (EngineError, ModelError) as exc:
                raise log.explain(exc) from exc
    finally:
        # a stream that failed before its first record leaves no empty file a retry would be refused for;
        # a stopped one waits STOP_WAIT_S at most for a reader that stopped reading
        wait_s = STOP_WAIT_S if context.stop.is_set() else None
        if close_sinks(sink, errors, drop_empty=failed and not context.resume, wait_s=wait_s):
            warn(f"records the output's reader did not take in {STOP_WAIT_S:g} s were dropped")
        if paths.output != STDOUT and not paths.output.exists():
            OutputFiles(paths.output).journal.unlink(missing_ok=True)
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _order(settings: Settings) -> tuple[bool, int]:
    """Whether records are written in input order (``[plan] output_order``
    ``input``; completion order unless asked), and the reorder buffer's bound."""
    return settings.plan.output_order == "input", settings.plan.window_rows


def _stream(
    source: IO[bytes],
    paths: StreamPaths,
    settings: Settings,
    context: RunContext,
    writer: StreamWriter,
    started: float,
    heap: str,
) -> RunReport:
    with context.stop.loading(settings.plan.start_timeout_s):  # the CLI ends a load that takes longer
        model = resolve_model(settings.model)
        tokenizer = context.load_tokenizer(model, settings, generates=True)
        scan = InputScan(rows=None, mentions_priority=True)  # rows may set priority: vLLM's priority scheduling
        settings, engine_choice = choose_engine_settings(model, settings, scan, True, False)
        engine = context.engine_factory(model, settings)
    settings = settings.resolve_chat_template(tokenizer)
    load_s = time.monotonic() - started
    counts = {"completed": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0, "windows": 0}
    progress = Progress(None, force_plain=context.progress_plain, max_running=engine.max_num_seqs)
    name = settings.model or DEFAULT_MODEL

    def on_error(error: RowError) -> None:
        writer.error(error.line, records.error_record(error))
        counts["failed"] += 1
        progress.update(failed=1, planned=False)

    def on_finished(request: Request, completion: Completion) -> None:
        writer.output(request.line, records.output_record(request, completion, name))
        counts["completed"] += 1
        counts["prompt_tokens"] += completion.prompt_tokens
        counts["completion_tokens"] += completion.completion_tokens
        progress.update(done=1, completion_tokens=completion.completion_tokens, lengths=completion.lengths)

    def on_failed(request: Request, message: str) -> None:
        on_error(RowError(request.line, request.id, "engine_error", message, request.openai_url is not None))

    def on_step(finished: list[Completion]) -> None:
        if finished:
            writer.flush()
        progress.tick(
            engine.generated_tokens,
            engine.prefilled_tokens,
            engine.running_lengths(),
            engine.cached_tokens,
            engine.running_prompt_tokens,
            engine.ended_sequences,
        )

    def on_planned(request: Request) -> None:
        progress.planned(request.prompt_length, request.max_tokens, request.sequences, request.n)

    planner = GENERATE.planner(tokenizer, settings, engine, model)
    rows = RowQueue(StreamReader(source), QUEUE_WINDOWS * settings.plan.window_rows)

    def on_window(size: int) -> None:
        counts["windows"] += 1

    windows = writer.gate(
        stream_requests(rows, settings, planner, on_error, on_planned, on_window=on_window, writer=writer),
        PENDING,
    )
    generate_start = time.monotonic()
    context.stop.starting = False
    try:
        feed(
            engine,
            windows,
            max_in_flight=settings.plan.max_in_flight or 2 * engine.max_num_seqs,
            on_finished=on_finished,
            on_failed=on_failed,
            on_step=on_step,
            stop=context.stop,
        )
    except FeedStopped:
        raise context.stop.interrupted(
            f"{counts['completed']} finished rows and {counts['failed']} errors were written; "
            "rows still in the engine were not"
        ) from None
    finally:
        progress.close()
        engine.close()
        writer.flush()
    generate_s = time.monotonic() - generate_start
    report = _report(paths, name, model, settings, counts, load_s, generate_s, time.monotonic() - started)
    report["engine_choice"] = engine_choice
    report["blank_lines"] = rows.blank_lines()
    report["request_counts"]["resumed"] = writer.skipped
    report["output_order"] = "input" if writer.input_order else "completion"
    report["heap"] = heap
    if writer.input_order:
        report["reorder"] = {"bound": writer.bound, "peak_held": writer.peak_held}
    if paths.output != STDOUT:
        from bulkinfer.report.stats import write_json

        write_json(report, paths.output.with_name(paths.output.stem + ".report.json"))
    print(_summary(report), file=terminal())
    return RunReport(report, EXIT_PARTIAL if counts["failed"] else EXIT_OK, paths.output)


def _report(
    paths: StreamPaths,
    name: str,
    model_path: str,
    settings: Settings,
    counts: dict[str, int],
    load_s: float,
    generate_s: float,
    total_s: float,
) -> dict[str, Any]:
    """A stream's report: rows, tokens, windows, seconds and throughput (tokens/s over the generate phase)."""
    done = counts["completed"] + counts["failed"]
    return {
        "job": "stream",
        "input": "-",
        "output": str(paths.output),
        "errors": str(paths.errors) if paths.errors is not None else str(paths.output),
        "log": str(paths.log),
        "model": name,
        "model_path": model_path,
        "request_counts": {"completed": counts["completed"], "failed": counts["failed"]},
        "tokens": {"prompt": counts["prompt_tokens"], "completion": counts["completion_tokens"]},
        "windows": {
            "count": counts["windows"],
            "mean_rows": done / counts["windows"] if counts["windows"] else 0.0,
            "window_rows": settings.plan.window_rows,
            "max_wait_s": settings.plan.max_wait_s,
        },
        "seconds": {"load": load_s, "generate": generate_s, "total": total_s},
        "throughput": {
            "requests_per_s": counts["completed"] / generate_s if generate_s > 0 else 0.0,
            "completion_tokens_per_s": counts["completion_tokens"] / generate_s if generate_s > 0 else 0.0,
        },
    }


def _summary(report: dict[str, Any]) -> str:
    """One line on standard error at the end of a stream."""
    counts, seconds, windows = report["request_counts"], report["seconds"], report["windows"]["count"]
    blank = f", {report['blank_lines']} blank lines skipped" if report.get("blank_lines") else ""
    return (
        f"bulkinfer: stream ended: {counts['completed']} rows completed, {counts['failed']} failed{blank}, "
        f"{report['tokens']['completion']} completion tokens in {seconds['generate']:.1f} s "
        f"({report['throughput']['completion_tokens_per_s']:.1f} tok/s), {windows} window{'s' * (windows != 1)} "
        f"(max wait {report['windows']['max_wait_s']:g} s); load {seconds['load']:.1f} s; log {report['log']}"
    )
