"""File formats by name: one suffix table for input and output, and the
names of the files a run writes beside its output.

``x.jsonl`` / ``x.ndjson`` are JSONL and ``x.parquet`` / ``x.pq`` Parquet,
for input and output alike. Input JSONL may also be compressed
(``x.jsonl.gz``, ``x.ndjson.zst``: the compression itself is found from the
file's first bytes, see :func:`bulkinfer.io.readers.inspect_input`); output
is never compressed.
"""

from __future__ import annotations

from pathlib import Path

from bulkinfer.errors import ConfigError, InputFileError

JSONL = "jsonl"
PARQUET = "parquet"
# suffix (lower case) -> format, for input and output
SUFFIXES = {".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET, ".pq": PARQUET}
# Stripped from an input's name before the format is read from it.
COMPRESSION_SUFFIXES = (".gz", ".gzip", ".zst", ".zstd", ".bz2", ".xz", ".lz4", ".zip", ".7z")


def format_suffix(path: Path) -> str:
    """The lower-case suffix that names the format of ``path``, after one
    compression suffix is stripped: ``x.JSONL.gz`` -> ``.jsonl``; ``""`` if none."""
    name = path.name.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return Path(name).suffix


def _known() -> str:
    return ", ".join(SUFFIXES)


def input_format(path: Path) -> str:
    """:data:`JSONL` or :data:`PARQUET` for an input file, from its name.

    Raises:
        InputFileError: the name has no known suffix.
    """
    suffix = format_suffix(path)
    if suffix not in SUFFIXES:
        raise InputFileError(
            f"{path}: unknown input format '{suffix or path.name}'; expected "
            f"{_known()} (JSONL may be gzip- or zstd-compressed: .jsonl.gz, .jsonl.zst)"
        )
    return SUFFIXES[suffix]


def output_format(path: Path) -> str:
    """:data:`JSONL` or :data:`PARQUET` for an output file, from its name.

    Raises:
        ConfigError: the name has no known suffix (a compression suffix included).
    """
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"output {path}: unknown format '{suffix}'; use one of {_known()}")
    return SUFFIXES[suffix]


def default_output(input_path: Path, suffix: str = ".out.jsonl") -> Path:
    """``<input stem><suffix>`` beside the input (``x.jsonl.gz`` -> ``x.out.jsonl``)."""
    name, found = input_path.name, format_suffix(input_path)
    stem = name[: name.lower().rindex(found)] if found else input_path.stem
    return input_path.with_name(stem + suffix)


def sibling(out: Path, suffix: str) -> Path:
    """``out`` with its last extension replaced: ``res/out.jsonl`` + ``.report.json``
    -> ``res/out.report.json``."""
    return out.with_name(out.stem + suffix)


def spool_path(out: Path) -> Path:
    """The hidden JSONL spool rows are appended to before ``out`` is published."""
    return out.with_name(f".{out.name}.partial.jsonl")
