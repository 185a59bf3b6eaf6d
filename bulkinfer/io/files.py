"""Spools and atomic publishing: the one durability policy of every file bulkinfer writes.

Results are appended as they complete to a JSONL *spool* beside the output
(``.NAME.partial.jsonl``), flushed in small groups and fsync'd every few
seconds. At the end the spool becomes the output atomically, in input or
completion order (:mod:`bulkinfer.io.spool`): written in that order to a
temporary JSONL file, then renamed (JSONL) or converted to Parquet in a
temporary file first (:func:`publish`). Every final
file (output, errors, report.json, report.html, journal, calibration, the
model marker) is published the same way (:func:`publish_path`): a temporary
file in the same directory, fsync'd, renamed over the final name, and the
directory fsync'd, so readers never see a half-written file and a crash
leaves the old file or the new one, never neither.
"""

from __future__ import annotations

import base64
import errno
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from bulkinfer.errors import InputFileError
from bulkinfer.io.formats import PARQUET, output_format


@dataclass(frozen=True, slots=True)
class OutputColumns:
    """What a job's Parquet output knows of its columns before its rows:
    ``vectors``, the embedding columns (written as
    ``fixed_size_list<float32>[dim]``), and ``empty``, the columns (name,
    Arrow type name) of an output with no rows (an empty input), its own
    record's, so a reader of a day's empty output finds the columns of any
    other day's. The default is a generation's (``bulkinfer run``)."""

    vectors: tuple[str, ...] = ()
    empty: tuple[tuple[str, str], ...] = (
        ("id", "string"),
        ("completion", "string"),
        ("finish_reason", "string"),
        ("prompt_tokens", "int64"),
        ("completion_tokens", "int64"),
    )


GENERATION_COLUMNS = OutputColumns()
FSYNC_INTERVAL_S = 2.0
PARQUET_CHUNK_ROWS = 4096


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


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably: a temporary file
    beside it (``.NAME.PID.tmp``, so two processes never share one), fsync'd,
    then :func:`publish_path`. The temporary file is removed if anything
    fails, so a full disk leaves no debris.

    Raises:
        OSError: as the writes raise (ENOSPC, EROFS, EACCES, ...).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_synced(tmp, [data])
        failpoint("atomic_write", path)
        publish_path(tmp, path)
    except OSError as exc:  # named by the file asked for, not the temporary one
        tmp.unlink(missing_ok=True)
        if exc.errno is None or os.fsdecode(exc.filename or "") != str(tmp):
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_synced(path: Path, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` (replacing it), flushed and fsync'd.

    Raises:
        OSError: as the writes raise.
    """
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def publish_path(src: Path, dst: Path) -> None:
    """Rename the complete (already fsync'd) file or directory ``src`` over
    ``dst`` in the same directory, then fsync the directory so the rename
    survives a crash.

    Raises:
        OSError: as ``os.replace`` or the fsync raise.
    """
    os.replace(src, dst)
    fsync_path(dst.parent)


def keep_newest(directory: Path, pattern: str, keep: int) -> None:
    """Remove all but the newest ``keep`` files of ``directory`` matching the
    glob ``pattern`` (by modification time); a file that vanished or cannot
    be removed is left to the next call."""
    files = []
    for path in directory.glob(pattern):
        try:
            files.append((path.stat().st_mtime_ns, path))
        except OSError:
            continue
    for _, path in sorted(files, reverse=True)[keep:]:
        try:
            path.unlink()
        except OSError:
            pass


def json_default(value: Any) -> str:
    """The JSON text of a pass-through value orjson has no type for (orjson
    writes datetimes and dates as RFC 3339 itself, NaN and infinities as
    null): bytes (a Parquet binary column) as base64, anything else (a
    Decimal) as ``str``."""
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode("ascii")
    return str(value)


def _dumps(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, default=json_default, option=orjson.OPT_APPEND_NEWLINE)


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
        self.write_raw(_dumps(record))

    def write_raw(self, line: bytes) -> None:
        """Append one complete line (its newline included)."""
        self._file.write(line)
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


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(spool: Path, out: Path, columns: OutputColumns = GENERATION_COLUMNS) -> None:
    """Make ``spool`` (complete JSONL, fsync'd) the final ``out`` atomically:
    a rename for JSONL output, a conversion to a temporary Parquet file
    (fsync'd; ``columns`` as :func:`jsonl_to_parquet` takes them) then a
    rename for Parquet. The spool is gone afterwards."""
    if output_format(out) == PARQUET:
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            jsonl_to_parquet(spool, tmp, columns)
            publish_path(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        spool.unlink()
    else:
        publish_path(spool, out)


def json_line_error(raw: bytes, line: int, exc: orjson.JSONDecodeError) -> str:
    """``line N, column C: not valid JSON: WHY`` for line ``line`` (1-based, of
    the file) whose bytes ``raw`` orjson could not decode. orjson counts lines
    and columns within ``raw`` alone; an error past its end (the line's own
    newline) is at the column after its last character."""
    column = exc.colno if exc.lineno == 1 else len(raw.rstrip(b"\r\n").decode("utf-8", "replace")) + 1
    return f"line {line}, column {column}: not valid JSON: {exc.msg}"


def iter_jsonl_chunks(path: Path, rows: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """Records of a JSONL file in lists of at most ``rows`` (default :data:`PARQUET_CHUNK_ROWS`).

    Raises:
        InputFileError: a line is not valid JSON (naming the file's line and the column).
        OSError: the file cannot be read.
    """
    rows = rows or PARQUET_CHUNK_ROWS
    chunk: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    chunk.append(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    raise InputFileError(f"{path}: {json_line_error(line, line_no, exc)}") from None
                if len(chunk) >= rows:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def jsonl_to_parquet(src: Path, dst: Path, columns: OutputColumns = GENERATION_COLUMNS) -> None:
    """Write the records of the JSONL file ``src`` to the Parquet file ``dst`` (fsync'd) in
    two streaming passes over ``src``: infer one Arrow type per column over
    all rows, then write. A column whose values have no common Arrow type (a
    pass-through field that is a number in one row and text in another) is
    written as JSON text, so no row is lost. A column named in
    ``columns.vectors`` (an embedding) whose values are lists of numbers of
    one length ``dim`` is written as ``fixed_size_list<float32>[dim]``
    (``list<float32>`` when the lengths differ; so is such a column of an
    output with no rows, whose columns are ``columns.empty``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    seen: dict[str, list[pa.DataType]] = {}
    as_json: set[str] = set()
    lengths: dict[str, set[int]] = {name: set() for name in columns.vectors}
    for chunk in iter_jsonl_chunks(src):
        for name, found in lengths.items():
            found.update(len(r[name]) for r in chunk if isinstance(r.get(name), list))
        for name in dict.fromkeys(key for record in chunk for key in record):
            try:
                seen.setdefault(name, []).append(pa.array([r.get(name) for r in chunk]).type)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                as_json.add(name)
    vector = pa.list_(pa.float32())
    fields = [] if seen else [pa.field(n, vector if n in lengths else t) for n, t in columns.empty]
    for name, types in seen.items():
        try:
            unified = pa.unify_schemas([pa.schema([(name, t)]) for t in types], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            as_json.add(name)
        if name in as_json:
            fields.append(pa.field(name, pa.string()))
        elif name in lengths and pa.types.is_list(unified.field(name).type):
            size = lengths[name].pop() if len(lengths[name]) == 1 else -1
            fields.append(pa.field(name, pa.list_(pa.float32(), size)))
        else:
            fields.append(unified.field(name))
    schema = pa.schema(fields)

    def encoded(record: dict[str, Any]) -> dict[str, Any]:
        for name in as_json & record.keys():
            if record[name] is not None:
                record[name] = orjson.dumps(record[name], default=json_default).decode()
        return record

    with pq.ParquetWriter(dst, schema) as writer:
        for chunk in iter_jsonl_chunks(src):
            writer.write_table(pa.Table.from_pylist([encoded(r) for r in chunk], schema=schema))
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
