"""The spool's line format, and publishing a spool in input or completion order.

A spool (``.NAME.partial.jsonl``, see :mod:`bulkinfer.io.files`) holds one
line per finished row, in the order rows finished (crash safety needs
appending): ``[LINE, RECORD]``, where ``LINE`` is the row's 1-based input
line (JSONL) or row (Parquet) number and ``RECORD`` the published record
exactly (an output row, an OpenAI ``BatchRequestOutput`` line, an error
record). The published files hold the records alone.

Input order is restored by an external merge sort on ``LINE``: the spool is
cut into sorted runs of at most ``run_rows`` records (default
:data:`MERGE_RUN_ROWS`), each spilled to a temporary file beside the spool
(``.NAME.partial.jsonl.run-K.tmp``), then merged with :func:`heapq.merge`,
at most :data:`MERGE_FAN_IN` runs at a time (more runs are merged in
rounds). Memory holds at most ``run_rows`` records (their JSON bytes) while
runs are cut, and one record per run while they are merged, whatever the
number of rows; disk holds the spool, its runs and the output at once. A
spool of at most ``run_rows`` records is sorted in memory and nothing is
spilled. Completion order is one streaming pass, nothing sorted or spilled.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Iterable, Iterator
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

import orjson

from bulkinfer.io.files import GENERATION_COLUMNS, JsonlAppender, OutputColumns, json_default, publish, write_synced

MERGE_RUN_ROWS = 65536
MERGE_FAN_IN = 64

Order = Literal["input", "completion"]

# A record's input line and its JSON bytes (no newline).
Keyed = tuple[int, bytes]


class Spool(JsonlAppender):
    """A spool: :class:`~bulkinfer.io.files.JsonlAppender` of ``[LINE, RECORD]`` lines."""

    def add(self, line: int, record: dict[str, Any]) -> None:
        """Append ``record``, the result of the input's row ``line`` (1-based)."""
        self.write_raw(orjson.dumps([line, record], default=json_default, option=orjson.OPT_APPEND_NEWLINE))


def read_spool(path: Path) -> Generator[Keyed, None, None]:
    """Each spool line of ``path`` as (input line, record's JSON bytes), in
    file order. A line that is a bare record (a published errors file taken
    back into its spool, or a spool of an older bulkinfer) is keyed by its
    ``line`` field when it has an integer one, else 0.

    Raises:
        OSError: the file cannot be read.
        orjson.JSONDecodeError: a line that is not JSON.
    """
    with open(path, "rb") as f:
        for raw in f:
            text = raw.strip()
            if text:
                yield spool_line(text)


def spool_line(text: bytes) -> Keyed:
    """One stripped, non-blank line of a spool as (input line, record's JSON
    bytes); a bare record is keyed as :func:`read_spool` says.

    Raises:
        orjson.JSONDecodeError: a bare record that is not JSON.
    """
    if text.startswith(b"["):  # [LINE,{...}]: orjson writes no spaces
        comma = text.index(b",")
        return int(text[1:comma]), text[comma + 1 : -1]
    line = orjson.loads(text).get("line")
    return (line if isinstance(line, int) and not isinstance(line, bool) else 0), text


def spool_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each spool line of ``path`` as (input line, record), in file order
    (see :func:`read_spool`)."""
    for line, body in read_spool(path):
        yield line, orjson.loads(body)


def publish_spool(
    spool: Path, out: Path, order: Order, run_rows: int | None = None, columns: OutputColumns = GENERATION_COLUMNS
) -> None:
    """Make ``spool`` the final ``out`` (JSONL or Parquet, by its name)
    atomically, its records in input ``order`` (an external merge sort in
    bounded memory, ``run_rows`` records a run, default
    :data:`MERGE_RUN_ROWS`; see the module docstring) or in completion order (as
    they are in the spool). The records go to ``.OUT.ordered.tmp`` (JSONL,
    fsync'd), which :func:`~bulkinfer.io.files.publish` makes ``out`` (a
    rename, or a conversion to Parquet of the job's ``columns``:
    :class:`~bulkinfer.io.files.OutputColumns`). The spool is gone afterwards; so
    are the temporaries, also when a write fails.

    Raises:
        OSError: a temporary or the output cannot be written (ENOSPC, ...).
    """
    ordered = ordered_path(out)
    records = sorted_records(spool, run_rows) if order == "input" else read_spool(spool)
    try:
        write_synced(ordered, (body + b"\n" for _, body in records))
        publish(ordered, out, columns)
    except BaseException:
        ordered.unlink(missing_ok=True)
        raise
    finally:
        records.close()  # the merge's runs are removed now, not when the traceback goes
    spool.unlink()


def ordered_path(out: Path) -> Path:
    """The temporary JSONL file of ``out``'s records in their final order."""
    return out.with_name(f".{out.name}.ordered.tmp")


def run_paths(spool: Path) -> list[Path]:
    """The merge's run temporaries of ``spool`` left on disk (a kill during a merge)."""
    return sorted(spool.parent.glob(f"{spool.name}.run-*.tmp"))


def sorted_records(spool: Path, run_rows: int | None = None) -> Generator[Keyed, None, None]:
    """The spool's records sorted by input line (stable), holding at most
    ``run_rows`` (default :data:`MERGE_RUN_ROWS`) records in memory; run
    temporaries are removed when the iterator ends or is closed."""
    run_rows = run_rows or MERGE_RUN_ROWS
    runs: list[Path] = []
    try:
        batch: list[Keyed] = []
        for keyed in read_spool(spool):
            batch.append(keyed)
            if len(batch) >= run_rows:
                runs.append(_spill(sorted(batch, key=itemgetter(0)), spool, len(runs)))
                batch = []
        batch.sort(key=itemgetter(0))
        if not runs:
            yield from batch
            return
        if batch:
            runs.append(_spill(batch, spool, len(runs)))
        del batch
        made = len(runs)
        while len(runs) > MERGE_FAN_IN:  # merge in rounds: at most MERGE_FAN_IN files open at once
            merged = []
            for start in range(0, len(runs), MERGE_FAN_IN):
                group = runs[start : start + MERGE_FAN_IN]
                merged.append(_spill(_merge(group), spool, made))
                made += 1
                for path in group:
                    path.unlink()
            runs = merged
        yield from _merge(runs)
    finally:
        for path in runs:
            path.unlink(missing_ok=True)


def _spill(records: Iterable[Keyed], spool: Path, index: int) -> Path:
    """Write ``records`` (sorted) as run ``index`` of ``spool``, in the spool's line format."""
    path = spool.with_name(f"{spool.name}.run-{index}.tmp")
    try:
        with open(path, "wb") as f:
            for line, body in records:
                f.write(b"[%d,%s]\n" % (line, body))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _merge(runs: list[Path]) -> Iterator[Keyed]:
    """The records of the sorted ``runs`` merged by input line (ties in run order)."""
    streams = [read_spool(path) for path in runs]
    try:
        yield from heapq.merge(*streams, key=itemgetter(0))
    finally:
        for stream in streams:
            stream.close()
