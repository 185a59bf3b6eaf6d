"""The predictions file of ``bulkinfer eval --predictions`` and ``eval-rank
--predictions``: an output of ``run`` (or ``score``) read back, every record
a JSON object, a mis-shaped one an error naming the file and its line; and
kept apart from the files the eval writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from bulkinfer.errors import ConfigError, InputFileError, check_readable
from bulkinfer.fields import is_int
from bulkinfer.io.formats import PARQUET, SUFFIXES, output_format
from bulkinfer.io.output_files import OutputFiles, same_file
from bulkinfer.io.records import is_batch_record, parse_output, read_records


def read_predictions(path: Path) -> list[dict[str, Any]]:
    """Every record of a predictions file (JSONL or Parquet output of ``run``).

    Raises:
        InputFileError: the file is missing or unreadable, a line is not
            valid JSON, or a line is not a JSON object (naming the line).
    """
    check_readable(path, "predictions file")
    if path.suffix.lower() not in SUFFIXES:
        raise InputFileError(
            f"predictions file {path}: unknown format '{path.suffix}'; give the .jsonl or .parquet output of "
            "`bulkinfer run` (decompress a compressed one first)"
        )
    try:
        records = list(read_records(path))
    except OSError as exc:
        raise InputFileError(f"cannot read the predictions file {path}: {exc.strerror or exc}") from None
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise mis_shaped(path, index, f"a JSON {type(record).__name__}, not an output record (a JSON object)")
    return records


def record_place(path: Path, index: int) -> str:
    """Where record ``index`` (0-based) of an output file is: ``line N`` of a
    JSONL file (blank lines skipped, as :func:`read_records` skips them) or
    ``row N`` of a Parquet file (1-based)."""
    if output_format(path) == PARQUET:
        return f"row {index + 1}"
    try:
        with open(path, "rb") as f:
            numbers = (number for number, line in enumerate(f, start=1) if line.strip())
            return f"line {next(islice(numbers, index, None), '?')}"
    except OSError:
        return f"record {index + 1}"


def mis_shaped(path: Path, index: int, what: str) -> InputFileError:
    """The error for record ``index`` of the predictions file ``path``: ``what`` is wrong with it."""
    return InputFileError(
        f"predictions file {path}: {record_place(path, index)}: {what}; "
        "give the output of `bulkinfer run` (or `bulkinfer score` for eval-rank)"
    )


def check_apart(predictions: Path | None, out: Path, also: Iterable[Path] = ()) -> None:
    """Check that no file an eval on ``out`` writes (``OUT``, its errors,
    report, log and temporaries, and ``also``) is ``predictions``, by name,
    symlink or hard link: the predictions are an input.

    Raises:
        ConfigError: one is.
    """
    if predictions is None:
        return
    for path in [*OutputFiles(out).paths(), *also]:
        if same_file(path, predictions):
            what = "output" if path == out else f"the file {path.name} that output {out} writes"
            raise ConfigError(f"{what} would overwrite the predictions {predictions}; choose another -o")


@dataclass(slots=True)
class Predictions:
    """The predictions of an output file, by row id: ``by_id`` (id -> (index
    of its first record, completion text)), ``unusable`` (records without a
    string or integer id or without a completion text) and ``duplicates``
    (later records of an id already seen): neither is scored."""

    by_id: dict[str, tuple[int, str]] = field(default_factory=dict)
    unusable: int = 0
    duplicates: int = 0


def first_predictions(path: Path, records: list[dict[str, Any]]) -> Predictions:
    """The :class:`Predictions` of ``records`` (read from ``path``). An
    integer id is read as its decimal string, as golden ids are.

    Raises:
        InputFileError: a record is not in an output shape
            (:func:`bulkinfer.io.records.parse_output` cannot read it), naming its line.
    """
    found = Predictions()
    for index, record in enumerate(records):
        key = "custom_id" if is_batch_record(record) else "id"
        if is_int(record.get(key)):
            record = {**record, key: str(record[key])}
        try:
            row = parse_output(record)
        except (AttributeError, TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
            what = f"not an output record ({type(exc).__name__}: {exc})"[:300]
            raise mis_shaped(path, index, what) from None
        if row is None:
            found.unusable += 1
        elif row.id in found.by_id:
            found.duplicates += 1
        else:
            found.by_id[row.id] = (index, row.completion)
    return found
