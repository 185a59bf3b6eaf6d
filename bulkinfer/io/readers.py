"""Streaming readers for JSONL and Parquet input, behind one small interface.

A reader yields :class:`RawRow` values in file order and never holds the whole
file: JSONL is read line by line and decoded with orjson; Parquet is read one
row group at a time, in record batches, with only the needed columns.

The input must be a regular file (it is read more than once: the row count for
progress, ``--resume``); :func:`bulkinfer.io.inputs.inspect_input` is the one place that checks it.
JSONL may be gzip- or zstd-compressed: the compression is found from the
file's first bytes (whatever its name) and the stream is decompressed as it is
read. The format comes from the name without its compression suffix:
``x.jsonl``, ``x.jsonl.gz``, ``x.ndjson.zst`` are JSONL; ``x.parquet``, ``x.pq``
Parquet.
"""

from __future__ import annotations

import io
import queue
import re
import threading
import zlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import orjson

from bulkinfer.errors import InputFileError
from bulkinfer.io.files import json_line_error
from bulkinfer.io.formats import JSONL, input_format
from bulkinfer.io.inputs import inspect_input, open_binary
from bulkinfer.schema import RowInvalid

# A JSONL line longer than this (bytes) is a row error, not a crash; at most
# this much of it is held in memory.
MAX_LINE_BYTES = 64 * 1024 * 1024
PARQUET_BATCH_ROWS = 1024
# The columns of a Parquet input that hold a row's text (bulkinfer run's).
PROMPT_COLUMNS = ("prompt", "messages")
# The columns of an OpenAI Batch API input (https://platform.openai.com/docs/api-reference/batch/request-input).
BATCH_COLUMNS = ("custom_id", "method", "url", "body")
_BOM = b"\xef\xbb\xbf"
_DECOMPRESS_COMMAND = {"gzip": "gunzip -k", "zstd": "zstd -d"}
# What a decompressing stream raises on a corrupt or truncated input: gzip
# raises EOFError (truncated), zlib.error (bad deflate data) or BadGzipFile,
# an OSError (bad header, CRC); pyarrow raises OSError or ArrowInvalid (a ValueError).
_STREAM_ERRORS = (OSError, EOFError, ValueError, zlib.error)


# --- readers --------------------------------------------------------------------------------------


@dataclass(slots=True)
class RawRow:
    """A decoded row (``data``), or the reason it could not be decoded (``error``).

    ``line`` is the 1-based line number (JSONL) or row number (Parquet).
    """

    line: int
    data: Any = None
    error: RowInvalid | None = None


class Reader(Protocol):
    """Rows of one input file in file order; ``blank_lines`` counts the blank
    JSONL lines skipped so far (0 for Parquet)."""

    path: Path
    blank_lines: int

    def __iter__(self) -> Iterator[RawRow]: ...


class JsonlReader:
    """Reads a JSONL file line by line (binary, so U+2028/U+0085 inside strings
    never split a row). Accepts a UTF-8 BOM on the first line, CRLF endings and
    a last line without a newline; blank lines are skipped and counted.

    A gzip or zstd file (found by its first bytes) is decompressed as it is
    read. A line that is not JSON, or longer than :data:`MAX_LINE_BYTES`, is a
    row error (``invalid_json`` / ``invalid_row``) and reading goes on.

    A compressed stream that breaks after its start (truncated download,
    corrupt bytes) ends the rows with one ``invalid_row`` error at line N, the
    first line not read completely: "the gzip stream is corrupt or truncated
    at line N". The rows before it are yielded as usual. This keeps "every
    input row ends as exactly one output or error record" as far as the file
    allows: every row that could be read runs, the unreadable rest is one
    error record (exit code 3, not a lost run), and a ``--resume`` meets the
    same error at the same line and skips it. An :class:`InputFileError`
    instead would stop the run and make every rerun fail the same way.
    (Rows past line N cannot be counted: there may be none, when only the
    stream's trailer is missing.)

    Raises:
        InputFileError: at construction, as :func:`inspect_input`, or when a
            compressed stream is broken before its first byte can be decoded;
            while iterating, when reading an uncompressed file fails (an I/O
            error: rerunning may succeed, so it is not recorded as a row).
    """

    def __init__(self, path: Path):
        self.path = path
        self.blank_lines = 0
        self.bytes_read: int | None = None  # an uncompressed file's, once its rows ended
        self.compression = inspect_input(path)
        if self.compression is not None:
            try:
                with open_binary(path, self.compression) as f:
                    f.read(1)
            except _STREAM_ERRORS as exc:
                raise InputFileError(
                    f"{path}: not a readable {self.compression} stream ({exc}); the file is corrupt or truncated"
                ) from None

    def __iter__(self) -> Iterator[RawRow]:
        try:
            f = open_binary(self.path, self.compression)
        except OSError as exc:
            raise InputFileError(f"{self.path}: cannot read the input file: {exc.strerror or exc}") from None
        with f:
            yield from _rows(f, self, self._read_failed)
            if self.compression is None:
                self.bytes_read = f.tell()

    def _read_failed(self, lines: int, exc: Exception) -> RawRow:
        """The row that ends a compressed stream broken after ``lines`` lines.

        Raises:
            InputFileError: reading an uncompressed file failed.
        """
        if self.compression is None:
            raise InputFileError(f"{self.path}: reading failed after line {lines}: {exc}") from None
        line = lines + 1
        return RawRow(
            line,
            error=RowInvalid(
                "invalid_row",
                f"the {self.compression} stream of {self.path.name} is corrupt or truncated at line {line} "
                f"({type(exc).__name__}: {exc}); the {line - 1} lines before it were read, any rows after it "
                "could not be: fix or re-download the file and run those rows again",
            ),
        )


def line_row(raw: bytes, size: int, line_no: int) -> RawRow | None:
    """The row of JSONL line ``line_no`` (1-based; ``raw`` its bytes, at most
    :data:`MAX_LINE_BYTES` of its ``size``), or None for a blank line. A
    UTF-8 BOM on the first line is dropped. A line over the limit or that is
    not JSON is a row whose ``error`` says where and why."""
    if line_no == 1 and raw.startswith(_BOM):
        raw, size = raw[len(_BOM) :], size - len(_BOM)
    if size > MAX_LINE_BYTES:
        message = f"line is {size} bytes, over the limit of {MAX_LINE_BYTES} bytes"
        return RawRow(line_no, error=RowInvalid("invalid_row", message))
    if not raw.strip():
        return None
    try:
        return RawRow(line_no, data=orjson.loads(raw))
    except orjson.JSONDecodeError as exc:
        return RawRow(line_no, error=_decode_error(raw, line_no, exc))


class StreamReader:
    """Reads JSONL rows from a binary stream (standard input) as they
    arrive, with the rules of :class:`JsonlReader` (BOM, CRLF, blank lines
    skipped and counted, a bad line a row error); no compression. ``path``
    is ``-``.

    Raises:
        InputFileError: while iterating, when reading the stream fails.
    """

    def __init__(self, source: IO[bytes]):
        self.path = Path("-")
        self.blank_lines = 0
        self._source = source

    def __iter__(self) -> Iterator[RawRow]:
        yield from _rows(self._source, self, self._read_failed)

    def _read_failed(self, lines: int, exc: Exception) -> RawRow:
        raise InputFileError(f"standard input: reading failed after line {lines}: {exc}") from None


def _rows(
    f: io.BufferedIOBase | IO[bytes], reader: Any, read_failed: Callable[[int, Exception], RawRow]
) -> Iterator[RawRow]:
    """The rows of the JSONL lines of ``f`` (:func:`line_row`), blank lines
    counted in ``reader.blank_lines``; a read that fails after N lines ends
    them with ``read_failed(N, exc)`` (which may raise instead)."""
    lines = 0
    while True:
        try:
            raw, size = _next_line(f)
        except _STREAM_ERRORS as exc:
            yield read_failed(lines, exc)
            return
        if not raw:
            return
        lines += 1
        row = line_row(raw, size, lines)
        if row is None:
            reader.blank_lines += 1
            continue
        yield row


def _next_line(f: io.BufferedIOBase | IO[bytes]) -> tuple[bytes, int]:
    """The next line of ``f`` and its length in bytes; ``(b"", 0)`` at the end.

    At most ``MAX_LINE_BYTES + 1`` bytes of a line are returned: the rest of
    a longer line is read and counted, not kept.
    """
    raw = f.readline(MAX_LINE_BYTES + 1)
    size = len(raw)
    if size > MAX_LINE_BYTES and not raw.endswith(b"\n"):
        while chunk := f.readline(1 << 20):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
    return raw, size


# `"custom_id": "..."` or `"id": "..."` / `"id": 12` in the bytes of a line that is not JSON
_ID_FIELDS = {key: re.compile(rb'"' + key + rb'"\s*:\s*("(?:[^"\\\n]|\\.)*"|-?\d+)') for key in (b"custom_id", b"id")}


def recover_id(raw: bytes) -> tuple[str, bool] | None:
    """The row's id read from the bytes of an undecodable line, best effort:
    ``(custom_id, True)`` for an OpenAI batch line, else ``(id, False)``; the
    first occurrence wins, and a value that is not itself valid JSON text is
    not taken. None when neither can be read."""
    for key, pattern in _ID_FIELDS.items():
        match = pattern.search(raw)
        if match is None:
            continue
        try:
            value = orjson.loads(match.group(1))
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, int | str) and not isinstance(value, bool) and str(value):
            return str(value), key == b"custom_id"
    return None


def _decode_error(raw: bytes, line: int, exc: orjson.JSONDecodeError) -> RowInvalid:
    """The row error of line ``line`` (1-based, of the file) that orjson cannot
    decode: where (the file's line, the column within it) and why, with the
    row's id when :func:`recover_id` can read it (the record then says
    ``id_recovered``). orjson's own position counts within the line alone."""
    try:
        raw.decode("utf-8")
        message = json_line_error(raw, line, exc)
    except UnicodeDecodeError as utf8_exc:
        message = f"line {line}: not valid UTF-8 ({utf8_exc.reason} at byte {utf8_exc.start} of the line)"
    recovered = recover_id(raw)
    if recovered is None:
        return RowInvalid("invalid_json", message)
    return RowInvalid("invalid_json", message, row_id=recovered[0], openai=recovered[1], id_recovered=True)


def _is_prompt_list(type_: Any) -> bool:
    """Whether an Arrow type is a list (list, large_list, fixed_size_list) of
    integers (token ids) or of text (OpenAI's list of prompts, which each row
    reads: one prompt is that prompt)."""
    import pyarrow as pa

    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    return any(is_list(type_) for is_list in lists) and (
        pa.types.is_integer(type_.value_type) or _is_text(type_.value_type)
    )


def _is_text(type_: Any) -> bool:
    """Whether an Arrow type reads as Python ``str``: string, large_string,
    string_view, or a dictionary of one of them."""
    import pyarrow as pa

    if pa.types.is_dictionary(type_):
        return _is_text(type_.value_type)
    is_string_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return bool(
        pa.types.is_string(type_)
        or pa.types.is_large_string(type_)
        or (is_string_view is not None and is_string_view(type_))
    )


class ParquetReader:
    """Reads a Parquet file row group by row group, in record batches.

    Each row is a dict of Python values: text columns (string, large_string,
    string_view, dictionary-encoded strings) become ``str``.

    Raises:
        InputFileError: at construction, as :func:`inspect_input`; when the
            file is wrapped in gzip or zstd (Parquet compresses its own
            pages: decompress it first), is not Parquet, is truncated, or has
            neither a text column (``prompt``/``messages``, or the given
            ``text_columns``) nor the OpenAI batch
            ``custom_id`` + ``body`` columns, or ``prompt`` is not a text
            column. A row group that fails to decode later yields one
            ``invalid_row`` error per row it holds, and reading goes on.
    """

    def __init__(
        self,
        path: Path,
        columns: Collection[str] | None = None,
        text_columns: tuple[str, ...] = PROMPT_COLUMNS,
    ):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        self.blank_lines = 0
        compression = inspect_input(path)
        if compression is not None:
            raise InputFileError(
                f"{path} is a {compression}-compressed Parquet file; Parquet compresses its own pages, and "
                f"bulkinfer reads the .parquet file itself: decompress it first ({_DECOMPRESS_COMMAND[compression]})"
            )
        try:
            self._file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise InputFileError(f"{path}: not a readable Parquet file: {exc}") from None
        schema = self._file.schema_arrow
        names = schema.names
        if not (set(text_columns) & set(names) or {"custom_id", "body"} <= set(names)):
            wanted = " or ".join(f"'{name}'" for name in text_columns)
            raise InputFileError(f"{path}: no {wanted} column; columns found: {', '.join(names) or '(none)'}")
        if "prompt" in names and not (_is_text(prompt := schema.field("prompt").type) or _is_prompt_list(prompt)):
            raise InputFileError(
                f"{path}: column 'prompt' has type {prompt}, expected string (string, large_string, "
                "string_view or dictionary-encoded string), token ids (a list of integers) or a list of strings"
            )
        # ``columns``: the fields the job reads from a row (its other fields are not passed through)
        read = None if columns is None else {*columns, *text_columns, *BATCH_COLUMNS}
        self.columns = [n for n in names if read is None or n in read]

    def __iter__(self) -> Iterator[RawRow]:
        import pyarrow as pa

        line = 0
        for group in range(self._file.num_row_groups):
            group_rows = self._file.metadata.row_group(group).num_rows
            done = 0
            try:
                for batch in self._file.iter_batches(
                    batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=self.columns
                ):
                    for record in batch.to_pylist():
                        line += 1
                        done += 1
                        yield RawRow(line, data=record)
            except (pa.ArrowException, OSError) as exc:
                for _ in range(group_rows - done):
                    line += 1
                    yield RawRow(
                        line, error=RowInvalid("invalid_row", f"Parquet row group {group} could not be read: {exc}")
                    )


def open_reader(
    path: Path, columns: Collection[str] | None = None, text_columns: tuple[str, ...] = PROMPT_COLUMNS
) -> Reader:
    """A reader for ``path`` chosen by its name without a compression suffix:
    ``.jsonl``/``.ndjson`` (plain, gzip or zstd, found by the first bytes) or
    ``.parquet``/``.pq``. ``columns``: read only these Parquet columns (and
    the text and OpenAI batch ones), the fields the job's row parser reads,
    when a row's other fields are not passed through; None reads every
    column. A Parquet input needs one of ``text_columns``
    (``prompt``/``messages``; ``bulkinfer embed``: ``text``/``input``) or
    the OpenAI batch columns.

    Raises:
        InputFileError: as :func:`inspect_input` (missing, unreadable, not a
            regular file, refused compression), an unknown extension, or as
            the reader's constructor (unreadable Parquet, broken stream).
    """
    inspect_input(path)
    if input_format(path) == JSONL:
        return JsonlReader(path)
    return ParquetReader(path, columns=columns, text_columns=text_columns)


class RowQueue:
    """The rows of ``reader`` (a :class:`StreamReader`), read on a daemon
    thread into a queue of at most ``capacity`` rows: the stream's writer
    blocks while the queue is full."""

    _END = object()

    def __init__(self, reader: StreamReader, capacity: int):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(capacity, 1))
        self.ended = False
        self.blank_lines = lambda: reader.blank_lines
        threading.Thread(target=self._read, args=(reader,), name="bulkinfer-stdin", daemon=True).start()

    def _read(self, reader: StreamReader) -> None:
        try:
            for row in reader:
                self._queue.put(row)
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread, raised there)
            self._queue.put(exc)
        self._queue.put(self._END)

    def get(self) -> RawRow | None:
        """The next row read, or None when none is there now (or the stream ended: :attr:`ended`).

        Raises:
            InputFileError: reading the stream failed.
        """
        if self.ended:
            return None
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is self._END:
            self.ended = True
            return None
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]
