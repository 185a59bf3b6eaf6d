"""Output records and the files they go to.

Results are appended as they complete to a JSONL *spool* beside the output
(``.NAME.partial.jsonl``), flushed in small groups and fsync'd every few
seconds. At the end the spool becomes the output atomically: renamed as is
for ``.jsonl``, or converted to Parquet in a temporary file first; readers
never see a half-written final file.

Record shapes:

- bulkinfer rows: ``id``, ``completion``, ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens`` and the row's pass-through fields;
- OpenAI batch lines (https://platform.openai.com/docs/api-reference/batch/request-output):
  ``id``, ``custom_id``, ``response`` {``status_code``, ``request_id``,
  ``body`` (a ``chat.completion`` or ``text_completion``)}, ``error``;
- errors (``OUT.errors.jsonl``): ``id``, ``line``, ``error`` {``type``,
  ``message``}; OpenAI lines: ``custom_id``, ``response: null``,
  ``error`` {``code``, ``message``} and ``line``.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from bulkinfer.engine import Completion
from bulkinfer.errors import ConfigError
from bulkinfer.rows import CHAT_URL, Request, RowError

OUTPUT_SUFFIXES = (".jsonl", ".parquet")
# Columns of an output with no rows (an empty input): a bulkinfer output row's own.
EMPTY_OUTPUT_FIELDS = (
    ("id", "string"),
    ("completion", "string"),
    ("finish_reason", "string"),
    ("prompt_tokens", "int64"),
    ("completion_tokens", "int64"),
)
FSYNC_INTERVAL_S = 2.0
PARQUET_CHUNK_ROWS = 4096


def sibling(out: Path, suffix: str) -> Path:
    """``out`` with its last extension replaced: ``res/out.jsonl`` + ``.report.json``
    -> ``res/out.report.json``."""
    return out.with_name(out.stem + suffix)


def default_output(input_path: Path) -> Path:
    """``<input stem>.out.jsonl`` beside the input."""
    return input_path.with_name(input_path.stem + ".out.jsonl")


def check_output_path(out: Path) -> None:
    """Raises ConfigError unless ``out`` ends in .jsonl or .parquet."""
    if out.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ConfigError(f"output {out}: unknown format '{out.suffix}'; use {' or '.join(OUTPUT_SUFFIXES)}")


def failpoint(name: str, path: Path | None = None) -> None:
    """Fault injection for the crash tests, inert unless ``BULKINFER_FAILPOINT``
    names this point: ``NAME`` makes the process kill itself with SIGKILL
    here; ``NAME:ERRNO`` (e.g. ``spool_flush:ENOSPC``) raises that OSError
    for ``path``; ``NAME:ERRNO:SUFFIX`` only for a ``path`` whose name ends
    with SUFFIX (``atomic_write:ENOSPC:.report.html``)."""
    wanted = os.environ.get("BULKINFER_FAILPOINT")
    if not wanted:
        return
    point, _, rest = wanted.partition(":")
    if point != name:
        return
    if not rest:
        os.kill(os.getpid(), signal.SIGKILL)
    errno_name, _, suffix = rest.partition(":")
    if suffix and not (path is not None and path.name.endswith(suffix)):
        return
    code = getattr(errno, errno_name)
    raise OSError(code, os.strerror(code), str(path) if path is not None else None)


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it
    (``.NAME.PID.tmp``, so two processes never share one), fsync'd when ``durable``, then ``os.replace``. The
    temporary file is removed if anything fails, so a full disk leaves no
    debris.

    Raises:
        OSError: as the writes raise (ENOSPC, EROFS, EACCES, ...).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            failpoint("atomic_write", path)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _dumps(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE)


def output_record(request: Request, completion: Completion, model: str) -> dict[str, Any]:
    """The output row for a completed request, in the row's own format."""
    if request.openai_url is None:
        return {
            **request.passthrough,
            "id": request.id,
            "completion": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
        }
    usage = {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }
    if request.openai_url == CHAT_URL:
        body_id, obj = f"chatcmpl-{uuid.uuid4().hex}", "chat.completion"
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": completion.text}}
    else:
        body_id, obj = f"cmpl-{uuid.uuid4().hex}", "text_completion"
        choice = {"index": 0, "text": completion.text}
    choice.update(logprobs=None, finish_reason=completion.finish_reason)
    body = {
        "id": body_id,
        "object": obj,
        "created": int(time.time()),
        "model": request.passthrough.get("model", model),
        "choices": [choice],
        "usage": usage,
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def error_record(error: RowError) -> dict[str, Any]:
    """The errors-file record for a failed row, in the row's own format.
    ``"id_recovered": true`` says the id (``custom_id``) was read from the
    bytes of a line that is not valid JSON."""
    record: dict[str, Any]
    if error.openai:
        record = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": error.id,
            "line": error.line,
            "response": None,
            "error": {"code": error.type, "message": error.message},
        }
    else:
        record = {"id": error.id, "line": error.line, "error": {"type": error.type, "message": error.message}}
    if error.id_recovered:
        record["id_recovered"] = True
    return record


class JsonlAppender:
    """Appends records to ``path``, flushing to the OS after each group and
    fsync-ing at most every :data:`FSYNC_INTERVAL_S` seconds.

    ``count`` starts at ``already`` (records an earlier attempt left in the
    file when ``append`` is True; otherwise the file starts empty)."""

    def __init__(self, path: Path, append: bool = False, already: int = 0):
        self.path = path
        self.count = already if append else 0
        self._file: IO[bytes] = open(path, "ab" if append else "wb")
        self._last_sync = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(_dumps(record))
        self.count += 1

    def flush(self, force_sync: bool = False) -> None:
        failpoint("spool_flush", self.path)
        self._file.flush()
        now = time.monotonic()
        if force_sync or now - self._last_sync >= FSYNC_INTERVAL_S:
            os.fsync(self._file.fileno())
            self._last_sync = now

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.flush(force_sync=True)
            finally:
                self._file.close()

    def abandon(self) -> None:
        """Close after a failure without raising: what reached the file stays
        (a torn last line is cut off by ``--resume``), a buffer that cannot
        be written is dropped (those rows run again)."""
        try:
            self.close()
        except OSError:
            pass


def spool_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial.jsonl")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(spool: Path, out: Path) -> None:
    """Make ``spool`` (complete JSONL) the final ``out`` atomically: a rename for
    JSONL output, a conversion to a temporary Parquet file then a rename for
    Parquet. The spool is gone afterwards."""
    if out.suffix.lower() == ".parquet":
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            _jsonl_to_parquet(spool, tmp)
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        spool.unlink()
    else:
        os.replace(spool, out)
    fsync_path(out.parent)


def iter_jsonl_chunks(path: Path, rows: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """Records of a JSONL file in lists of at most ``rows`` (default :data:`PARQUET_CHUNK_ROWS`)."""
    rows = rows or PARQUET_CHUNK_ROWS
    chunk: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                chunk.append(orjson.loads(line))
                if len(chunk) >= rows:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _jsonl_to_parquet(src: Path, dst: Path) -> None:
    """Two streaming passes over ``src``: infer one Arrow type per column over
    all rows, then write. A column whose values have no common Arrow type (a
    pass-through field that is a number in one row and text in another) is
    written as JSON text, so no row is lost."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    seen: dict[str, list[pa.DataType]] = {}
    as_json: set[str] = set()
    for chunk in iter_jsonl_chunks(src):
        for name in dict.fromkeys(key for record in chunk for key in record):
            try:
                seen.setdefault(name, []).append(pa.array([r.get(name) for r in chunk]).type)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                as_json.add(name)
    fields = [] if seen else [pa.field(name, type_) for name, type_ in EMPTY_OUTPUT_FIELDS]
    for name, types in seen.items():
        try:
            unified = pa.unify_schemas([pa.schema([(name, t)]) for t in types], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            as_json.add(name)
        fields.append(pa.field(name, pa.string()) if name in as_json else unified.field(name))
    schema = pa.schema(fields)

    def encoded(record: dict[str, Any]) -> dict[str, Any]:
        for name in as_json & record.keys():
            if record[name] is not None:
                record[name] = orjson.dumps(record[name], default=str).decode()
        return record

    with pq.ParquetWriter(dst, schema) as writer:
        for chunk in iter_jsonl_chunks(src):
            writer.write_table(pa.Table.from_pylist([encoded(r) for r in chunk], schema=schema))
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
