"""Streaming readers for JSONL and Parquet input, behind one small interface.

A reader yields :class:`RawRow` values in file order and never holds the whole
file: JSONL is read line by line and decoded with orjson; Parquet is read one
row group at a time, in record batches, with only the needed columns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from bulkinfer.errors import InputFileError
from bulkinfer.rows import RowInvalid

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
# A JSONL line longer than this (bytes) is a row error, not a crash.
MAX_LINE_BYTES = 64 * 1024 * 1024
PARQUET_BATCH_ROWS = 1024
_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True)
class RawRow:
    """A decoded row (``data``), or the reason it could not be decoded (``error``).

    ``line`` is the 1-based line number (JSONL) or row number (Parquet).
    """

    line: int
    data: Any = None
    error: RowInvalid | None = None


class Reader(Protocol):
    path: Path
    blank_lines: int

    def __iter__(self) -> Iterator[RawRow]: ...


class JsonlReader:
    """Reads a JSONL file line by line (binary, so U+2028/U+0085 inside strings
    never split a row). Accepts a UTF-8 BOM on the first line, CRLF endings and
    a last line without a newline; blank lines are skipped and counted."""

    def __init__(self, path: Path):
        self.path = path
        self.blank_lines = 0
        if not path.is_file():
            raise InputFileError(f"input file not found: {path}")

    def __iter__(self) -> Iterator[RawRow]:
        with open(self.path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if line_no == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM) :]
                if not raw.strip():
                    self.blank_lines += 1
                    continue
                if len(raw) > MAX_LINE_BYTES:
                    yield RawRow(
                        line_no,
                        error=RowInvalid(
                            "invalid_row", f"line is {len(raw)} bytes, over the limit of {MAX_LINE_BYTES} bytes"
                        ),
                    )
                    continue
                try:
                    yield RawRow(line_no, data=orjson.loads(raw))
                except orjson.JSONDecodeError as exc:
                    yield RawRow(line_no, error=_decode_error(raw, exc))


def _decode_error(raw: bytes, exc: Exception) -> RowInvalid:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as utf8_exc:
        return RowInvalid("invalid_json", f"line is not valid UTF-8 ({utf8_exc.reason} at byte {utf8_exc.start})")
    return RowInvalid("invalid_json", f"line is not valid JSON: {exc}")


class ParquetReader:
    """Reads a Parquet file row group by row group, in record batches.

    Raises:
        InputFileError: at construction when the file is not Parquet, is
            truncated, or has neither a ``prompt``/``messages`` column nor the
            OpenAI batch ``custom_id`` + ``body`` columns, or ``prompt`` is not
            a string column. A row group that fails to decode later yields one
            ``invalid_row`` error per row it holds, and reading goes on.
    """

    def __init__(self, path: Path, passthrough: bool = True):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        self.blank_lines = 0
        if not path.is_file():
            raise InputFileError(f"input file not found: {path}")
        try:
            self._file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise InputFileError(f"{path}: not a readable Parquet file: {exc}") from None
        schema = self._file.schema_arrow
        names = schema.names
        if not ({"prompt", "messages"} & set(names) or {"custom_id", "body"} <= set(names)):
            raise InputFileError(
                f"{path}: no 'prompt' or 'messages' column; columns found: {', '.join(names) or '(none)'}"
            )
        if "prompt" in names and not (
            pa.types.is_string(schema.field("prompt").type) or pa.types.is_large_string(schema.field("prompt").type)
        ):
            raise InputFileError(f"{path}: column 'prompt' has type {schema.field('prompt').type}, expected string")
        needed = {
            "id",
            "prompt",
            "messages",
            "max_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "custom_id",
            "method",
            "url",
            "body",
        }
        self.columns = list(names) if passthrough else [n for n in names if n in needed]

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


def open_reader(path: Path, passthrough: bool = True) -> Reader:
    """A reader for ``path`` chosen by its extension (.jsonl/.ndjson, .parquet/.pq).

    Raises:
        InputFileError: missing file, unknown extension, or unreadable Parquet.
    """
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return JsonlReader(path)
    if suffix in PARQUET_SUFFIXES:
        return ParquetReader(path, passthrough=passthrough)
    raise InputFileError(
        f"{path}: unknown input format '{suffix}'; expected {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
    )
