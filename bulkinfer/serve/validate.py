"""Validation of a batch's input file, in the batch's ``validating`` state:
the checks OpenAI's Batch API makes before it runs a line.

Each line must be a JSON object with a string ``custom_id`` unique in the
file, ``method`` ``"POST"``, ``url`` equal to the batch's ``endpoint`` and a
``body`` object; the file holds at most ``max_lines`` requests (OpenAI's
50,000). Lines are read as ``bulkinfer run`` reads them
(:func:`~bulkinfer.io.readers.line_row`: a UTF-8 BOM on the first line is
dropped, CRLF endings and blank lines are fine). Top-level keys besides
those four are ignored, as ``bulkinfer run`` ignores them. Problems come
back as OpenAI's ``BatchError`` objects (``code``, ``message``, ``param``,
``line``: 1-based) — never as an exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bulkinfer.errors import InputFileError
from bulkinfer.io.inputs import inspect_input
from bulkinfer.io.readers import RawRow, line_row

MAX_LINES = 50_000  # OpenAI's requests per batch
MAX_ERRORS = 100  # errors listed in a failed batch's ``errors.data``


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's ``BatchError``."""
    return {"code": code, "message": message, "param": param, "line": line}


def validate_input(path: Path, endpoint: str, max_lines: int = MAX_LINES) -> tuple[int, list[dict[str, Any]]]:
    """The number of requests in ``path`` (non-blank lines) and the
    ``BatchError`` of each bad line (at most :data:`MAX_ERRORS`); an empty
    error list means the file may run. A compressed file or an archive is one
    ``invalid_file`` error (0 requests): OpenAI's Batch API takes plain
    JSONL, and its bytes read as lines would each be "not valid UTF-8".
    Streams the file: memory is one line."""
    try:
        compression = inspect_input(path)
    except InputFileError as exc:  # a zip, bzip2, xz, ... file
        return 0, [batch_error("invalid_file", f"{exc}; a batch's input file is plain JSONL")]
    if compression is not None:
        message = f"the file is {compression}-compressed; a batch's input file is plain JSONL: upload it decompressed"
        return 0, [batch_error("invalid_file", message)]
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            row = line_row(raw, len(raw), number)
            if row is None:
                continue
            count += 1
            if count > max_lines:
                return count, [batch_error("too_many_requests", f"the file has more than {max_lines} requests")]
            problem = _line_problem(row, endpoint, seen)
            if problem is not None and len(errors) < MAX_ERRORS:
                errors.append(batch_error(problem[0], problem[1], number, problem[2]))
    if count == 0:
        errors.append(batch_error("empty_file", "the input file has no requests"))
    return count, errors


def _line_problem(row: RawRow, endpoint: str, seen: set[str]) -> tuple[str, str, str | None] | None:
    """``(code, message, param)`` of what is wrong with one line's row, or None."""
    if row.error is not None:
        return "invalid_json_line", row.error.message, None
    line = row.data
    if not isinstance(line, dict):
        return "invalid_json_line", "not a JSON object", None
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "custom_id must be a non-empty string", "custom_id"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line", "custom_id"
    seen.add(custom_id)
    if line.get("method") != "POST":
        return "invalid_request", "method must be POST", "method"
    if line.get("url") != endpoint:
        return "mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", "url"
    if not isinstance(line.get("body"), dict):
        return "invalid_request", "body must be a JSON object", "body"
    return None


def custom_ids(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, custom_id)`` of each line of ``path`` that is a JSON object
    with a non-empty string ``custom_id`` (1-based lines; others skipped;
    read as :func:`validate_input` reads them). Streams the file."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            row = line_row(raw, len(raw), number)
            line = row.data if row is not None else None
            custom_id = line.get("custom_id") if isinstance(line, dict) else None
            if isinstance(custom_id, str) and custom_id:
                yield number, custom_id
