"""One run's generation: rows through the feed loop into the spools.

Windows are planned as the loop pulls requests; each result is appended to
the output or errors spool; progress and the run's counters observe it all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_MODEL
from bulkinfer.engine.base import Engine
from bulkinfer.engine.feed import FeedStopped, feed
from bulkinfer.io import records
from bulkinfer.io.inputs import count_rows
from bulkinfer.io.output_files import OutputFiles, RunPaths
from bulkinfer.io.readers import RawRow, Reader
from bulkinfer.io.spool import Spool
from bulkinfer.jobs.context import RunContext
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.rows import RowParser
from bulkinfer.prep.windows import iter_windows
from bulkinfer.report.calibration import LengthPrior
from bulkinfer.report.progress import Progress
from bulkinfer.report.stats import RunStats
from bulkinfer.schema import Completion, Done, Request, RowError
from bulkinfer.stop import StopToken

# to the engine's log file with vLLM's own lines (bulkinfer.engine.log)
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt at a job, with its output's lock held and its journal
    written: ``done`` holds what an interrupted attempt finished; ``rows``
    the input's rows (as the job checks them) read by ``reader``;
    ``results_of``: the journal's record of the input and settings
    (:func:`bulkinfer.io.journal.results_record`), kept in the report;
    ``started``: :func:`time.monotonic` when the run began (seconds);
    ``input_key``: the input's :func:`~bulkinfer.io.journal.file_key` then."""

    paths: RunPaths
    files: OutputFiles
    done: Done
    reader: Reader
    rows: Iterator[RawRow]
    results_of: dict[str, Any]
    started: float
    input_key: tuple[int, int]


class RowJob(Protocol):
    """What :class:`Generation` reads of its job (:class:`bulkinfer.jobs.run.Job`)."""

    @property
    def parse(self) -> RowParser:
        """A row -> its :class:`~bulkinfer.schema.Request` (raises RowInvalid)."""

    @property
    def kind(self) -> str:
        """``run`` for a job that generates text; ``embed`` and ``score`` do not
        (the progress line counts their prompt tokens, the report has no sampling)."""


class Generation:
    """One run's rows through the feed loop (:func:`bulkinfer.engine.feed.feed`):
    windows planned as the loop pulls requests, each result appended to the
    spools, progress and :class:`~bulkinfer.report.stats.RunStats` updated.
    Rows an earlier attempt finished (``done``) are skipped. ``length_prior``:
    an earlier run's completion lengths and whether it was this job, for the progress line's ETA (see
    :class:`~bulkinfer.report.eta.WorkEstimate`). ``parse`` turns each row
    into a request (``embed`` gives its own), as ``job`` says.
    """

    def __init__(
        self,
        attempt: Attempt,
        settings: Settings,
        engine: Engine,
        planner: Planner,
        context: RunContext,
        job: RowJob,
        input_rows: int | None = None,
        length_prior: LengthPrior | None = None,
    ):
        self.paths, self.files, self.done = attempt.paths, attempt.files, attempt.done
        self.reader, self.settings, self.parse = attempt.reader, settings, job.parse
        self.generates = job.kind == "run"
        self.engine, self.planner, self.observer, self.stop = engine, planner, context.observer, context.stop
        self.max_in_flight = settings.plan.max_in_flight or 2 * engine.max_num_seqs
        self.model_name = settings.model or DEFAULT_MODEL
        done = self.done
        resumed = bool(done.completed or done.failed)
        self.spool = Spool(self.files.spool, append=resumed, already=done.completed)
        self.errors = Spool(self.files.errors_spool, append=resumed, already=done.failed)
        total = input_rows if input_rows is not None else count_rows(self.paths.input)
        if total is not None:  # rows left for this attempt (blank lines included: an estimate)
            total = max(total - done.completed - done.failed, 0)
        self.progress = Progress(
            total,
            force_plain=context.progress_plain,
            tokens="completion" if self.generates else "prompt",
            prior=length_prior,
            max_running=engine.max_num_seqs,
        )
        # rows ended and not yet told to the observer: completed, failed, completion tokens
        self._untold = [0, 0, 0]
        self.stats = RunStats()
        # the engine's live counts when this run started (an engine may be reused)
        self._engine_base = (engine.generated_tokens, engine.prefilled_tokens, engine.cached_tokens)
        self._counts_base = self._step_counts()
        self._counts: dict[str, int] | None = None  # the same when generation ended

    def fail(self, error: RowError, planned: bool = False, sequences: int = 1) -> None:
        """Record a failed row; ``planned``: it failed in the engine, after planning (its ``sequences``)."""
        self.errors.add(error.line, records.error_record(error))
        self.progress.update(failed=1, planned=planned, sequences=sequences)
        self._untold[1] += 1

    def run(self, rows: Iterable[RawRow]) -> None:
        """Feed every row and collect every result; then publish.

        Raises:
            EngineError: the engine died (finished rows stay in the spools).
            Interrupted: the context's ``stop`` was set (likewise).
            OSError: a spool or final file cannot be written (likewise).
        """
        try:
            self._feed(rows, self.stop)
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
                self._requests(iter_windows(rows, self.settings, self.fail, self.done, self.parse)),
                max_in_flight=self.max_in_flight,
                on_finished=self._finished,
                on_failed=self._failed,
                on_step=self._stepped,
                stop=stop,
            )
        except FeedStopped:
            if self.files.nothing_done():  # no row finished in any attempt: the spools are discarded
                raise stop.interrupted("no row had finished, so nothing is kept; run it again") from None
            raise stop.interrupted(
                f"{self.spool.count} finished rows and {self.errors.count} errors kept in "
                f"{self.spool.path} and {self.errors.path}; continue with --resume"
            ) from None
        self.stats.generation_ended()
        self._counts = self._step_counts()  # now: an engine in processes of its own is closed before the report
        with self.stats.timed("write"):
            self._close()
            self.files.finish(self.settings.plan.file_output_order, reported=False)  # the run writes the report
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
                    self.progress.planned(request.prompt_length, request.max_tokens, request.sequences, request.n)
                for error in errors:
                    self.fail(error)
            yield from planned

    def _failed(self, request: Request, message: str) -> None:
        error = RowError(request.line, request.id, "engine_error", message, request.openai_url is not None)
        self.fail(error, planned=True, sequences=request.sequences)

    def _finished(self, request: Request, completion: Completion) -> None:
        self.spool.add(request.line, records.output_record(request, completion, self.model_name))
        self.stats.finished(completion, request.structured)
        self.progress.update(done=1, completion_tokens=completion.completion_tokens, lengths=completion.lengths)
        self._untold[0] += 1
        self._untold[2] += completion.completion_tokens

    def _stepped(self, finished: list[Completion]) -> None:
        """After an engine step: flush what finished; the engine's live token
        counts to the progress display and the token series."""
        if finished:
            with self.stats.timed("write"):
                self.spool.flush()
                self.errors.flush()
        self._tell()
        generated = self.engine.generated_tokens - self._engine_base[0]
        prefilled = self.engine.prefilled_tokens - self._engine_base[1]
        cached = self.engine.cached_tokens - self._engine_base[2]
        running = self.engine.running_lengths()
        prompts, ended = self.engine.running_prompt_tokens, self.engine.ended_sequences
        self.progress.tick(generated, prefilled, running, cached, prompts, ended)
        self.stats.sample(generated, self.progress.usage_prompt_tokens(prefilled))

    def _tell(self) -> None:
        """Tell the observer the rows that ended since it was last told."""
        if any(self._untold):
            completed, failed, tokens = self._untold
            self._untold = [0, 0, 0]
            self.observer.rows_finished(completed, failed, tokens)

    def _close(self, failed: bool = False) -> None:
        """Close the progress display and the spools; after a failure
        (``failed``) without raising, keeping what reached the disk."""
        self.progress.close()
        self._tell()
        if failed:
            self.spool.abandon()
            self.errors.abandon()
        else:
            self.spool.close()
            self.errors.close()

    def _step_counts(self) -> dict[str, int] | None:
        """The engine's preemptions and rows moved into KV-block order so far
        (:func:`bulkinfer.engine.batch_order.step_counts`), None without."""
        counts = getattr(self.engine, "step_counts", None)
        try:
            return None if counts is None else counts()
        except Exception as exc:  # counts for the report: never the reason a run fails
            log.warning("the engine's step counts are not known: %s: %s", type(exc).__name__, exc)
            return None

    def report(self, model_path: str, load_s: float, total_s: float) -> dict[str, Any]:
        """The run report (see :mod:`bulkinfer.report.model` for the keys; a
        job that generates no text has no sampling, finish reasons,
        structured outputs or completion lengths) and
        ``passthrough_fields`` (see :meth:`~bulkinfer.prep.planner.Planner.passthrough_fields`)."""
        plan = self.settings.plan
        engine = self.engine.settings
        if self._counts is not None and self._counts_base is not None:
            base = self._counts_base
            engine = {**engine, **{name: n - base.get(name, 0) for name, n in self._counts.items()}}
        counts = (self.spool.count, self.errors.count, self.reader.blank_lines)
        prefix = self.planner.prefix.to_report() if self.planner.prefix is not None else None
        report = {
            **{name: str(getattr(self.paths, name)) for name in ("input", "output", "errors")},
            "model": self.model_name,
            "model_path": model_path,
            **self.stats.report(counts, self.done, (load_s, total_s), prefix, self.generates),
            **self.planner.padding.to_report(),
            "plan": {
                "order": plan.order,
                "prefix_aware": plan.prefix_aware and self.planner.prefix is not None,
                "output_order": plan.file_output_order,
                "window_rows": plan.window_rows,
                "max_in_flight": self.max_in_flight,
                "bucket_bounds": list(plan.buckets),
            },
            "engine": engine,
        }
        if self.generates:  # the figures of generated text (an embedding job has none)
            report["sampling"] = self.settings.to_dict()["sampling"]
            report["sampling_set_by_rows"] = self.planner.sampling_set_by_rows()
            report["chat_template_applied"] = self.settings.apply_chat_template
            report["structured_outputs"] = self.stats.structured_report(engine.get("structured_outputs_backend"))
        report["passthrough_fields"] = self.planner.passthrough_fields()
        work = self.progress.work
        report["eta_trace"] = {
            "points": self.progress.eta_trace,
            "end_s": self.progress.ended_s,
            "step_cost": work.step_cost.to_json(),
            "step_cost_stored": work.step_cost_stored,
            "step_cost_same_job": work.step_cost_same_job,
        }
        return report
