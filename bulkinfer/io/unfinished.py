"""Error records for the requests a stopped run never finished (an OpenAI
batch past its ``completion_window``: each such request is in the batch's
error file with code ``batch_expired``, as OpenAI's expired batches have)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import orjson

from bulkinfer.io.files import atomic_write
from bulkinfer.io.records import error_record, read_records
from bulkinfer.schema import RowError


def add_unfinished_errors(out: Path, errors: Path, requests: Iterable[tuple[int, str]], code: str, message: str) -> int:
    """Append to the published ``errors`` file an OpenAI error record
    (``code``, ``message``) for each request ``(line, custom_id)`` that is in
    neither published file (``out``, ``errors``), in the order given; the file
    is rewritten whole (atomically), so a crash leaves it before or after.
    Returns how many were added (0 when called again).

    Raises:
        OSError: a file cannot be read or written.
    """
    done = {record.get("custom_id") for path in (out, errors) if path.exists() for record in read_records(path)}
    added = [
        error_record(RowError(line, custom_id, code, message, openai=True))
        for line, custom_id in requests
        if custom_id not in done
    ]
    if added:
        before = errors.read_bytes() if errors.exists() else b""
        atomic_write(errors, before + b"".join(orjson.dumps(record) + b"\n" for record in added))
    return len(added)
