"""A stream's windows: the time-based batcher of ``bulkinfer run -``.

Rows arrive over time; a window goes to the planner (tokenized, sorted by
length, as a file's) when it is full or its oldest row has waited long
enough, so waiting longer fills fuller, better-sorted windows (throughput)
and waiting less answers sooner (latency). The stream itself (engine,
records, report) is :mod:`bulkinfer.jobs.stream`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.engine.feed import PENDING
from bulkinfer.io.readers import RowQueue
from bulkinfer.io.stream_out import StreamWriter
from bulkinfer.prep.planner import Planner
from bulkinfer.prep.rows import to_request
from bulkinfer.schema import Request, RowError, RowInvalid


def stream_requests(
    rows: RowQueue,
    settings: Settings,
    planner: Planner,
    on_error: Callable[[RowError], None],
    on_planned: Callable[[Request], None],
    clock: Callable[[], float] = time.monotonic,
    on_window: Callable[[int], None] | None = None,
    writer: StreamWriter | None = None,
) -> Iterator[Request | Any]:
    """Planned requests of ``rows`` a window at a time, :data:`PENDING` while
    the next window is not due: a window is due when it holds
    ``settings.plan.window_rows`` rows, its oldest row has waited
    ``settings.plan.max_wait_s`` seconds (``clock``), or the stream ended.
    Rows that cannot be parsed or planned go to ``on_error``; each window
    planned is told to ``on_window`` (its rows). Each row read is told to
    ``writer`` (:meth:`StreamWriter.read`); a row whose id is in its
    ``done`` (a resumed stream's) is skipped (:meth:`StreamWriter.skip`)."""
    done = writer.done if writer is not None else ()
    window: list[Request] = []
    oldest = 0.0
    seq = 0
    size, wait = settings.plan.window_rows, settings.plan.max_wait_s
    while True:
        while len(window) < size:
            raw = rows.get()
            if raw is None:
                break
            if writer is not None:
                writer.read(raw.line)
            try:
                if raw.error is not None:
                    raise raw.error
                request = to_request(raw.data, seq, raw.line, settings)
            except RowInvalid as exc:
                error = exc.to_error(raw.line)
                if error.id in done:
                    _skip(writer, raw.line)
                else:
                    on_error(error)
                continue
            finally:
                seq += 1
            if request.id in done:
                _skip(writer, raw.line)
                continue
            if not settings.passthrough and request.openai_url is None:
                request.passthrough = {}
            if not window:
                oldest = clock()
            window.append(request)
        if window and (len(window) >= size or rows.ended or clock() - oldest >= wait):
            if on_window is not None:
                on_window(len(window))
            planned, errors = planner.plan_window(window)
            window = []
            for error in errors:
                on_error(error)
            for request in planned:
                on_planned(request)
            yield from planned
        elif rows.ended:
            return
        else:
            yield PENDING


def _skip(writer: StreamWriter | None, line: int) -> None:
    """Row ``line`` has its record from before a resume: nothing is written for it."""
    if writer is not None:
        writer.skip(line)
