"""``bulkinfer run``: read -> plan -> generate -> write -> report, streaming.

The input is read in windows of ``plan.window_rows`` rows; each window is
tokenized, sorted and bucketed, then fed to the engine while at most
``max_in_flight`` requests are unfinished. The next window is planned as soon
as the current one is handed over, while the engine (its own process) keeps
computing, so continuous batching never drains between buckets or windows.
Memory is bounded by about two windows plus the requests in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkinfer import writers
from bulkinfer.config import Settings
from bulkinfer.engine import Engine, configure_environment
from bulkinfer.errors import EXIT_OK, EXIT_PARTIAL, InputFileError, OutputExistsError
from bulkinfer.planner import Planner
from bulkinfer.progress import Progress
from bulkinfer.readers import Reader, open_reader
from bulkinfer.report import peak_rss_bytes, throughput, write_report
from bulkinfer.rows import Request, RowError, RowInvalid, parse_row

EngineFactory = Callable[[str, Settings], Engine]


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

    @classmethod
    def build(cls, input_path: Path, output: Path | None) -> RunPaths:
        out = output if output is not None else writers.default_output(input_path)
        writers.check_output_path(out)
        return cls(input_path, out)


@dataclass(frozen=True, slots=True)
class RunResult:
    report: dict[str, Any]
    exit_code: int


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


def iter_windows(reader: Reader, settings: Settings, on_error: Callable[[RowError], None]) -> Iterator[list[Request]]:
    """Valid requests from ``reader`` in windows of ``plan.window_rows``; every
    invalid row (undecodable, bad fields, duplicate id) goes to ``on_error``.
    The first occurrence of an id runs; later ones are ``duplicate_id`` errors."""
    seen: set[str] = set()
    window: list[Request] = []
    for seq, raw in enumerate(reader):
        if raw.error is not None:
            on_error(raw.error.to_error(raw.line))
            continue
        try:
            request = parse_row(raw.data, seq, raw.line, settings.sampling)
        except RowInvalid as exc:
            on_error(exc.to_error(raw.line))
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
    engine_factory: EngineFactory = vllm_engine,
    progress_plain: bool = False,
) -> RunResult:
    """Run every row of ``paths.input`` through the model; write the output,
    errors and report files. Returns the report and the exit code
    (:data:`EXIT_OK`, or :data:`EXIT_PARTIAL` when some rows failed).

    Raises:
        OutputExistsError: the output exists and ``overwrite`` is False.
        InputFileError: the input cannot be read (before any model loads).
        ModelError, EngineError: the model or engine cannot start, or the engine dies.
    """
    from bulkinfer.models import resolve_model

    started = time.monotonic()
    if paths.output.exists() and not overwrite:
        raise OutputExistsError(f"output {paths.output} already exists; use --overwrite to replace it")
    if paths.input.resolve() == paths.output.resolve():
        raise InputFileError(f"output {paths.output} would overwrite the input")
    reader = open_reader(paths.input, passthrough=settings.passthrough)
    paths.output.parent.mkdir(parents=True, exist_ok=True)

    configure_environment()
    model = resolve_model(settings.model)
    tokenizer = load_tokenizer(model, settings.engine.trust_remote_code)
    engine = engine_factory(model, settings)
    load_s = time.monotonic() - started
    try:
        report = _generate(paths, settings, reader, tokenizer, engine, model, load_s, started, progress_plain)
    finally:
        engine.close()
    report["peak_rss_bytes"] = peak_rss_bytes()
    write_report(report, paths.report)
    code = EXIT_PARTIAL if report["request_counts"]["failed"] else EXIT_OK
    return RunResult(report, code)


def _generate(
    paths: RunPaths,
    settings: Settings,
    reader: Reader,
    tokenizer: Any,
    engine: Engine,
    model: str,
    load_s: float,
    started: float,
    progress_plain: bool,
) -> dict[str, Any]:
    planner = Planner(tokenizer, settings.plan, engine.max_model_len)
    max_in_flight = settings.plan.max_in_flight or 2 * engine.max_num_seqs
    spool = writers.JsonlAppender(writers.spool_path(paths.output))
    errors = writers.JsonlAppender(writers.spool_path(paths.errors))
    progress = Progress(count_rows(paths.input), force_plain=progress_plain)
    plan_s = write_s = 0.0
    prompt_tokens = completion_tokens = 0

    def on_error(error: RowError) -> None:
        errors.write(writers.error_record(error))
        progress.update(failed=1)

    windows = iter_windows(reader, settings, on_error)
    pending: deque[Request] = deque()
    in_flight: dict[str, Request] = {}
    exhausted = False
    generate_start = time.monotonic()
    while True:
        while len(in_flight) < max_in_flight:
            if not pending:
                if exhausted:
                    break
                t = time.monotonic()
                window = next(windows, None)
                if window is None:
                    exhausted = True
                else:
                    planned, window_errors = planner.plan_window(window)
                    pending.extend(planned)
                    for error in window_errors:
                        on_error(error)
                plan_s += time.monotonic() - t
                continue
            request = pending.popleft()
            request_id = str(request.seq)
            rejected = engine.add(request_id, request)
            if rejected is not None:
                on_error(
                    RowError(
                        request.line,
                        request.id,
                        "engine_error",
                        rejected.error or "rejected by the engine",
                        request.openai_url is not None,
                    )
                )
                continue
            in_flight[request_id] = request
        if not in_flight:
            break
        finished = engine.step()
        t = time.monotonic()
        for completion in finished:
            request = in_flight.pop(completion.request_id)
            if completion.error is not None:
                on_error(
                    RowError(request.line, request.id, "engine_error", completion.error, request.openai_url is not None)
                )
                continue
            spool.write(writers.output_record(request, completion, settings.model or Path(model).name))
            prompt_tokens += completion.prompt_tokens
            completion_tokens += completion.completion_tokens
            progress.update(done=1, completion_tokens=completion.completion_tokens)
        if finished:
            spool.flush()
            errors.flush()
        write_s += time.monotonic() - t
    generate_s = time.monotonic() - generate_start
    progress.close()

    t = time.monotonic()
    spool.close()
    errors.close()
    writers.publish(spool.path, paths.output)
    writers.publish(errors.path, paths.errors)
    write_s += time.monotonic() - t
    planner.padding.finish()
    completed, failed = spool.count, errors.count
    total_s = time.monotonic() - started
    return {
        "input": str(paths.input),
        "output": str(paths.output),
        "errors": str(paths.errors),
        "model": settings.model or "smollm2-135m-instruct",
        "model_path": model,
        "rows": completed + failed,
        "blank_lines": reader.blank_lines,
        "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
        "tokens": {"prompt": prompt_tokens, "completion": completion_tokens},
        "seconds": {"load": load_s, "plan": plan_s, "generate": generate_s, "write": write_s, "total": total_s},
        "throughput": throughput(completed, prompt_tokens, completion_tokens, generate_s),
        "throughput_end_to_end": throughput(completed, prompt_tokens, completion_tokens, total_s),
        **planner.padding.to_report(),
        "plan": {
            "order": settings.plan.order,
            "window_rows": settings.plan.window_rows,
            "max_in_flight": max_in_flight,
            "bucket_bounds": list(settings.plan.buckets),
        },
        "engine": engine.settings,
        "sampling": settings.to_dict()["sampling"],
    }
