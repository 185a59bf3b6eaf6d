"""Input rows -> windows of valid requests, for the planner.

:func:`iter_windows` cuts a file's rows into windows of ``plan.window_rows``
valid requests (ids checked, resume skips applied): the planner sorts and
buckets one window at a time, so memory stays bounded on any input size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from bulkinfer.config import Settings
from bulkinfer.io.readers import RawRow
from bulkinfer.prep.rows import RowParser, to_request
from bulkinfer.schema import Done, Request, RowError, RowInvalid


def _duplicate(row_id: str) -> str:
    return f"id '{row_id}' already appeared earlier in the file"


def iter_windows(
    reader: Iterable[RawRow],
    settings: Settings,
    on_error: Callable[[RowError], None],
    done: Done | None = None,
    parse: RowParser = to_request,
) -> Iterator[list[Request]]:
    """Valid requests from ``reader`` (raw rows in file order) in windows of ``plan.window_rows``; every
    invalid row (undecodable, bad fields, duplicate id) goes to ``on_error``.
    The first occurrence of an id is its record, an output or an error
    (a row with bad fields keeps its id); later ones are ``duplicate_id``
    errors, so an id names one record across the output and errors files
    (a default id, the line number, included). An id read from a line that
    is not JSON is a guess and claims nothing. Rows an earlier attempt
    finished (``done``: error lines and their ids, completed ids) are
    skipped. ``parse`` builds each request (``run``'s :func:`to_request`,
    or ``embed``'s); with ``passthrough = false`` its pass-through fields are
    dropped (an OpenAI line's are its output's, such as ``model``)."""
    done = done or Done()
    seen: set[str] = done.done_ids | done.failed_ids
    window_ids_skipped: set[str] = set()
    window: list[Request] = []
    for seq, raw in enumerate(reader):
        if raw.line in done.done_lines:
            continue
        if raw.error is not None:
            on_error(raw.error.to_error(raw.line))
            continue
        try:
            request = parse(raw.data, seq, raw.line, settings)
        except RowInvalid as exc:
            if exc.row_id is not None and exc.row_id in seen:
                exc = RowInvalid("duplicate_id", _duplicate(exc.row_id), exc.row_id, exc.openai)
            elif exc.row_id is not None:
                seen.add(exc.row_id)
            on_error(exc.to_error(raw.line))
            continue
        if not settings.passthrough and request.openai_url is None:
            request.passthrough = {}  # ``passthrough = false``: the row's other fields are not copied to its output
        if request.id in done.done_ids and request.id not in window_ids_skipped:
            window_ids_skipped.add(request.id)
            continue
        if request.id in seen:
            on_error(
                RowError(
                    raw.line,
                    request.id,
                    "duplicate_id",
                    _duplicate(request.id),
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
