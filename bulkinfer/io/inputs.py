"""The input file itself: a regular file (it is read more than once: the row
count for progress, ``--resume``), its compression found from its first
bytes (gzip and zstd read as a stream; others refused with what to do), and
a fast row count.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from bulkinfer.errors import InputFileError, file_kind
from bulkinfer.io.formats import PARQUET, SUFFIXES, format_suffix

# Magic bytes of the compressions read transparently...
_GZIP_MAGIC = b"\x1f\x8b"


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


# ... and of those refused, with what the user should do.
_DECOMPRESS_OR_RECOMPRESS = "decompress it first, or recompress it with gzip or zstd"


_REFUSED = (
    (b"BZh", "bzip2-compressed", _DECOMPRESS_OR_RECOMPRESS),
    (b"\xfd7zXZ\x00", "xz-compressed", _DECOMPRESS_OR_RECOMPRESS),
    (b"\x04\x22\x4d\x18", "lz4-compressed", _DECOMPRESS_OR_RECOMPRESS),
    (b"PK\x03\x04", "a zip archive", "extract the file first, or compress it with gzip or zstd"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "extract the file first, or compress it with gzip or zstd"),
)


def inspect_input(path: Path) -> str | None:
    """Check that ``path`` is a readable regular file and find its compression.

    The file type is read with ``os.stat`` first, so a FIFO is never opened
    (that would block until a writer appears); then the first 6 bytes are read.

    Returns:
        ``"gzip"``, ``"zstd"`` or ``None`` (not compressed, or an unknown
        compression: the reader then sees its bytes as they are).

    Raises:
        InputFileError: the path does not exist, cannot be read (permission
            denied), is a directory, a named pipe, socket or device, or is
            compressed with bzip2, xz or lz4, or is a zip or 7z archive.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputFileError(f"input file not found: {path}") from None
    except PermissionError:
        raise InputFileError(f"{path}: permission denied; make the input file readable by this user") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read the input file: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputFileError(f"{path} is a directory; give a .jsonl or .parquet file")
    kind = file_kind(mode)
    if kind is not None:
        raise InputFileError(
            f"{path} is {kind}, not a regular file: bulkinfer reads its input more than once "
            "(row count, --resume); write the rows to a file first, or stream JSONL rows into "
            "`bulkinfer run -` (standard input: read once, results written as they finish)"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except PermissionError:
        raise InputFileError(f"{path}: permission denied; make the input file readable by this user") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read the input file: {exc.strerror or exc}") from None
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_ZSTD_MAGIC):
        return "zstd"
    for magic, kind, advice in _REFUSED:
        if head.startswith(magic):
            raise InputFileError(f"{path} is {kind}; bulkinfer reads plain, gzip or zstd input: {advice}")
    return None


def open_binary(path: Path, compression: str | None) -> io.BufferedIOBase:
    """``path`` opened for binary reading, decompressed as it is read (never
    whole): gzip with :mod:`gzip`, zstd with pyarrow's streaming codec."""
    if compression == "gzip":
        return gzip.GzipFile(path, "rb")
    if compression == "zstd":
        import pyarrow as pa

        # CompressedInputStream has no readline: the BufferedReader gives lines.
        return io.BufferedReader(pa.input_stream(str(path), compression="zstd"), buffer_size=1 << 16)
    return open(path, "rb")


# A JSONL input that holds this key (or a Parquet input with such a column or
# field) may set per-row priorities: the engine is built for them.
PRIORITY_KEY = b'"priority"'


@dataclass(frozen=True, slots=True)
class InputScan:
    """What one fast pass over an input says: ``rows`` (an estimate, see
    :func:`scan_input`; None when unknown) and whether any row may set a
    ``priority`` (the key appears; a false alarm only turns on vLLM's
    priority scheduling, which runs equal priorities first come, first served)."""

    rows: int | None
    mentions_priority: bool
    bytes: int | None = None  # uncompressed bytes (JSONL) or the row groups' uncompressed size (Parquet)


def scan_input(path: Path) -> InputScan:
    """One pass over ``path``, before any model loads: the number of lines
    (blank lines included) for JSONL, read in 1 MiB blocks, or the footer's
    row count for Parquet; and whether the key ``"priority"`` appears (JSONL
    bytes, Parquet schema).

    A gzip- or zstd-compressed file is decompressed (streamed) to count its
    lines: a pass at decompression speed, small next to inference, and it
    gives progress a total and an ETA.

    Returns:
        The scan; ``InputScan(None, False)`` on any error (missing, not a
        regular file, corrupt): it never raises, and never opens a FIFO.
    """
    try:
        compression = inspect_input(path)
        if SUFFIXES.get(format_suffix(path)) == PARQUET:
            if compression is not None:
                return InputScan(None, False)
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            meta = parquet.metadata
            size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            return InputScan(int(meta.num_rows), "priority" in str(parquet.schema_arrow), size)
        count, size, last, tail, priority = 0, 0, b"\n", b"", False
        with open_binary(path, compression) as f:
            while block := f.read(1 << 20):
                count += block.count(b"\n")
                size += len(block)
                priority = priority or PRIORITY_KEY in tail + block
                last, tail = block[-1:], block[-len(PRIORITY_KEY) + 1 :]
        return InputScan(count + (last != b"\n"), priority, size)
    except Exception:
        return InputScan(None, False)


def count_rows(path: Path) -> int | None:
    """A fast estimate of the rows in ``path``, for progress (see
    :func:`scan_input`); None when unknown. Never raises."""
    return scan_input(path).rows
