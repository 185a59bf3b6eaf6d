"""A stream's records (``bulkinfer run -``): written as rows finish, in
completion order or in input order through a bounded reorder buffer, and
read back by id for ``--resume``.

Completion order (a stream's default) writes each record as soon as its row
ends: nothing is held. Input order holds a finished row's record until
every row read before it has its record. The buffer is bounded by
back-pressure: once it holds ``bound`` records and the oldest unfinished row
is in the engine, no new request is fed (:meth:`StreamWriter.gate`) until
that row finishes; the held records then drain. A window's rows are fed in
the planner's order (longest first), so at most ``bound`` records plus one
window's rows are held at once.

A resumed stream (a file output, never standard output) appends to its
output and errors files: a torn last line (the previous run killed while
writing) is cut off, and every id with a record there is done; a row of the
new stream with a done id is skipped (it has its record). Rows are matched
by id (``custom_id`` for OpenAI lines, ``id`` otherwise, the default id of a
row without one is its line number in the stream); a line that was not JSON
has no id and is not matched.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any, NoReturn

import orjson

from bulkinfer.errors import ConfigError, Interrupted, OutputExistsError, write_error
from bulkinfer.io.journal import check_same_results
from bulkinfer.io.output_files import OutputFiles
from bulkinfer.io.records import is_batch_record
from bulkinfer.schema import Request


class StreamWriter:
    """Writes a stream's output records to ``sink`` and error records to
    ``errors`` (the same stream when errors are not split off), in
    completion order, or in input order (``input_order``) holding at most
    about ``bound`` finished records (see the module docstring). ``done``:
    the ids a resumed stream has records of (:func:`done_ids`)."""

    def __init__(
        self,
        sink: IO[bytes],
        errors: IO[bytes],
        input_order: bool,
        bound: int,
        done: Collection[str] = (),
        guard: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.sink, self.errors = sink, errors
        self._guard = guard  # around each write and flush (StopToken.blocking_write: a stop may abandon it)
        self.done = done
        self.input_order = input_order
        self.bound = max(bound, 1)
        self._order: deque[int] = deque()  # lines read and not yet written, in arrival order
        self._held: dict[int, tuple[IO[bytes], bytes] | None] = {}  # line -> record (None: no record)
        self._fed: set[int] = set()  # lines of _order whose request went to the engine
        self.peak_held = 0
        self.skipped = 0
        self.flushed = 0  # records that reached their reader (written and flushed)
        self._written = 0
        self._gone = False  # a reader went away (a closed pipe): nothing more is written

    def read(self, line: int) -> None:
        """Row ``line`` was read: in input order, its record is awaited."""
        if self.input_order:
            self._order.append(line)

    def output(self, line: int, record: dict[str, Any]) -> None:
        """Row ``line``'s output record."""
        self._put(line, self.sink, record)

    def error(self, line: int, record: dict[str, Any]) -> None:
        """Row ``line``'s error record."""
        self._put(line, self.errors, record)

    def skip(self, line: int) -> None:
        """Row ``line`` gets no record (a resumed stream's done row)."""
        self.skipped += 1
        if self.input_order:
            self._held[line] = None
            self._drain()

    def _put(self, line: int, out: IO[bytes], record: dict[str, Any]) -> None:
        data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        if not self.input_order:
            self._write(out, data)
            return
        self._held[line] = (out, data)
        self._drain()
        self.peak_held = max(self.peak_held, len(self._held))

    def _drain(self) -> None:
        while self._order and self._order[0] in self._held:
            line = self._order.popleft()
            self._fed.discard(line)
            held = self._held.pop(line)
            if held is not None:
                self._write(*held)

    @property
    def held(self) -> int:
        """Finished records waiting for an earlier row's."""
        return len(self._held)

    def gate(self, requests: Iterator[Any], pending: Any) -> Iterator[Any]:
        """``requests`` (a stream's planned requests and ``pending`` markers),
        holding each request back (``pending`` instead) while the buffer is
        full and its oldest row is in the engine; marks each request fed."""
        for item in requests:
            if isinstance(item, Request):
                if self.input_order:
                    while self.held >= self.bound and self._order and self._order[0] in self._fed:
                        yield pending
                    self._fed.add(item.line)
            yield item

    def flush(self) -> None:
        """Flush both streams (the records written so far reach their reader).

        Raises:
            Interrupted: a reader went away (see :meth:`_write`).
        """
        if self._gone:
            return
        try:
            with self._guard():
                self.sink.flush()
                if self.errors is not self.sink:
                    self.errors.flush()
        except BrokenPipeError:
            self._reader_gone()
        self.flushed = self._written

    def _write(self, out: IO[bytes], data: bytes) -> None:
        """Write one record; nothing once a reader went away.

        Raises:
            Interrupted: the reader of ``out`` went away (a closed pipe:
                ``bulkinfer run - -o - | head``); exit code 141, as a
                process SIGPIPE ends.
        """
        if self._gone:
            return
        try:
            with self._guard():
                out.write(data)
        except BrokenPipeError:
            self._reader_gone()
        self._written += 1

    def _reader_gone(self) -> NoReturn:
        self._gone = True
        raise Interrupted(
            signal.SIGPIPE,
            f"the output's reader went away (a closed pipe) after {self.flushed} records were written to it; "
            "the rows after them were not written",
        )


STDOUT = Path("-")  # a stream's output or errors path that means standard output


# A stream's input in the record of what an output is the result of: standard input, read once.
STREAM_INPUT = {"path": "-"}


def check_resumable(state: OutputFiles, settings: dict[str, Any]) -> str | None:
    """Refuse to resume the stream to ``state.out`` with other settings than
    those it was written with (its journal, which a stream keeps), or an
    output a ``run FILE`` wrote (its journal or its report's ``results_of``).
    ``settings``: :func:`~bulkinfer.io.journal.results_settings`. Returns
    what to warn of for an output with neither (a bulkinfer before
    2026-12-07): not checked.

    Raises:
        ConfigError: the settings differ, or another input wrote it (naming it).
    """
    if state.journal.exists():
        recorded, complete = orjson.loads(state.journal.read_bytes()), False
    elif state.report.exists() and "results_of" in (report := orjson.loads(state.report.read_bytes())):
        recorded, complete = report["results_of"], True
    else:
        return f"{state.out} has no record of the settings that wrote it: not checked"
    if recorded.get("input", {}).get("path") != "-":
        raise ConfigError(
            f"cannot resume {state.out} with a stream: `bulkinfer run {recorded['input'].get('path')}` wrote it; "
            "resume it with that input, or give the stream another -o"
        )
    check_same_results(state.out, recorded, STREAM_INPUT, settings, complete=complete)
    return None


def open_sink(path: Path, overwrite: bool, append: bool = False) -> IO[bytes]:
    """A binary stream for ``path``: a copy of standard output for
    :data:`STDOUT` (taken before the engine's log takes file descriptor 1),
    else the file, created (replaced with ``overwrite``, appended to with
    ``append``).

    Raises:
        OutputExistsError: the file exists and neither ``overwrite`` nor ``append`` is set.
        OutputWriteError: the file cannot be opened (exit 9).
    """
    if path == STDOUT:
        return os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    if path.exists() and not (overwrite or append):
        raise OutputExistsError(f"output {path} already exists; use --overwrite to replace it or --resume to go on")
    try:
        return open(path, "ab" if append else "wb", buffering=1 << 16)  # noqa: SIM115 (closed by close_sinks)
    except OSError as exc:
        raise write_error(exc, path) from None


def close_sinks(*sinks: IO[bytes], drop_empty: bool = False, wait_s: float | None = None) -> bool:
    """Flush and close each of ``sinks`` (one given twice: once). A reader
    that went away (a closed pipe) is no error here: :class:`StreamWriter`
    has said so. With ``drop_empty``, a file left empty is removed (a
    stream that failed before its first record: its retry is then not
    refused for an output that exists). With ``wait_s`` (a stopped stream),
    a pipe's reader gets that many seconds to take what is buffered, the
    rest is dropped: a reader that stopped reading must not hold the stop.
    Returns whether records were dropped so.

    Raises:
        OSError: a flush failed otherwise (a full disk).
    """
    dropped = False
    for out in {id(out): out for out in sinks}.values():
        if wait_s is not None and not stat.S_ISREG(os.fstat(out.fileno()).st_mode):
            dropped = _flush_within(out, wait_s) or dropped
        with contextlib.suppress(BrokenPipeError):
            out.flush()
        with contextlib.suppress(BrokenPipeError):  # the flush again, then the file is closed all the same
            out.close()
        name = getattr(out, "name", None)  # a path for a file; standard output's copy has its descriptor
        if drop_empty and isinstance(name, str) and os.path.isfile(name) and os.path.getsize(name) == 0:
            os.unlink(name)
    return dropped


def _flush_within(out: IO[bytes], wait_s: float) -> bool:
    """Flush ``out`` (a pipe's or terminal's writer) without blocking for
    more than ``wait_s`` seconds; what is left unwritten then is discarded
    (its descriptor then points at ``/dev/null``). Returns whether something
    was. The descriptor is non-blocking only meanwhile: its open file is
    shared with standard output."""
    fd = out.fileno()
    deadline = time.monotonic() + wait_s
    os.set_blocking(fd, False)
    try:
        while True:
            try:
                out.flush()
                return False
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                select.select([], [fd], [], min(left, 0.2))
            except BrokenPipeError:
                return False
    finally:
        os.set_blocking(fd, True)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
    return True


def record_id(record: dict[str, Any]) -> str | None:
    """The row id of an output or error record: ``custom_id`` for OpenAI lines, else ``id``."""
    row_id = record["custom_id"] if is_batch_record(record) else record.get("id")
    return row_id if isinstance(row_id, str) else None


def done_ids(path: Path) -> set[str]:
    """The row ids with a record in ``path`` (a stream's JSONL output or
    errors file; none when it does not exist), after cutting off a torn last
    line (the file is truncated after its last newline).

    Raises:
        ConfigError: a line that is not a JSON record (naming the file and line).
        OSError: the file cannot be read or truncated.
    """
    if not path.exists():
        return set()
    _cut_torn_line(path)
    ids: set[str] = set()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{path}, line {number}: not a JSON record ({exc}); cannot resume from it") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}, line {number}: not a JSON object; cannot resume from it")
            row_id = record_id(record)
            if row_id is not None:
                ids.add(row_id)
    return ids


def _cut_torn_line(path: Path) -> None:
    """Truncate ``path`` after its last newline (a line cut short by a kill)."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        block = 1 << 16
        end = size
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                break
            end = start
        else:
            f.truncate(0)
        f.flush()
        os.fsync(f.fileno())
