"""Crash-safe state of one output: its files, its lock, its spools and its journal.

A run on ``OUT`` (say ``res/r.jsonl``) writes only these paths, all in the
output's directory so renames are atomic (:meth:`OutputFiles.paths` lists them):

- ``r.jsonl``, ``r.errors.jsonl``, ``r.report.json``, ``r.report.html``: the
  final files (the last three are shared by every output format of the stem
  ``r``: ``r.parquet`` would write them too);
- ``.r.lock``: held with ``fcntl.flock`` for the whole run; one lock per
  output *stem*, so ``-o r.jsonl`` and ``-o r.parquet`` never run at once.
  The kernel frees it when the holder dies, even by ``kill -9``;
- ``.r.jsonl.partial.jsonl`` and ``.r.errors.jsonl.partial.jsonl``: the
  spools, one complete JSON line per finished row (``[LINE, RECORD]``, see
  :mod:`bulkinfer.io.spool`), appended as rows finish;
- ``.r.jsonl.journal.json``: the input's identity (path, size, mtime) and a
  fingerprint of the settings that shape results, so that ``--resume``
  refuses to continue with another input or other settings (the record and
  its check: :mod:`bulkinfer.io.journal`; a finished run keeps it in its
  report, ``results_of``);
- temporaries ``.NAME.tmp`` / ``.NAME.PID.tmp`` / ``.NAME.ordered.tmp``
  that become a final file by ``os.replace``, and the sorted runs of the
  merge that restores input order (``.NAME.partial.jsonl.run-K.tmp``), all
  removed when a write fails.

The spools are the record of what is done: after a crash, a torn last line is
cut off and every complete line stays done. The final files appear by
``os.replace``: errors first, output last, so an existing final ``OUT`` means
the run is complete. Publishing puts the records in input order (by default)
or leaves them in completion order (``plan.output_order``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import OutputOrder
from bulkinfer.errors import ConfigError, LockHeldError, OutputExistsError, write_error
from bulkinfer.io import formats
from bulkinfer.io.files import GENERATION_COLUMNS, OutputColumns, atomic_write, failpoint, publish_path
from bulkinfer.io.journal import check_same_results, results_record
from bulkinfer.io.records import parse_output, read_records
from bulkinfer.io.spool import Spool, ordered_path, publish_spool, run_paths, spool_records
from bulkinfer.schema import Done


def cut_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline (a line a crash cut short)."""
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(1 << 16, pos)
            f.seek(pos - step)
            block = f.read(step)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = pos - step + nl + 1
                break
            pos -= step
        else:
            keep = 0
        if keep != end:
            f.truncate(keep)


class OutputFiles:
    """The files of one output ``out`` and the rules for starting, resuming
    and finishing a run on it."""

    def __init__(self, out: Path, columns: OutputColumns = GENERATION_COLUMNS):
        self.out = out
        self.columns = columns  # what a Parquet output knows of its columns before its rows
        self.errors = formats.sibling(out, ".errors.jsonl")
        self.report = formats.sibling(out, ".report.json")
        self.html = formats.sibling(out, ".report.html")
        self.log = formats.sibling(out, ".log")  # the engine's log (bulkinfer.engine.log)
        self.spool = formats.spool_path(out)
        self.errors_spool = formats.spool_path(self.errors)
        self.journal = out.with_name(f".{out.name}.journal.json")
        self.lock_path = out.with_name(f".{out.stem}.lock")
        self.tmp = out.with_name(f".{out.name}.tmp")
        self.ordered = ordered_path(out)
        self.errors_ordered = ordered_path(self.errors)

    def paths(self) -> list[Path]:
        """Every path a run on this output writes (temporaries of the
        report files are ``.NAME.PID.tmp`` beside them)."""
        return [
            self.out,
            self.errors,
            self.report,
            self.html,
            self.log,
            self.spool,
            self.errors_spool,
            self.journal,
            self.lock_path,
            self.tmp,
            self.ordered,
            self.errors_ordered,
        ]

    def _stem_files_are_ours(self) -> bool:
        """True when the errors and report files of this stem are absent or
        this output's: its report names it, or a run of it is under way (a
        crash between publishing the errors and the output leaves both)."""
        if self.has_partial():
            return True
        if self.report.exists():
            try:
                return Path(str(orjson.loads(self.report.read_bytes()).get("output"))).name == self.out.name
            except (OSError, ValueError, AttributeError):
                return False
        return not self.errors.exists()

    def siblings(self) -> list[Path]:
        """Outputs of the same stem in another format, with their spools and
        journals: they share this output's errors and report files."""
        found = []
        for suffix in formats.SUFFIXES:
            other = self.out.with_suffix(suffix)
            if other.suffix.lower() == self.out.suffix.lower():
                continue
            for path in (other, formats.spool_path(other), other.with_name(f".{other.name}.journal.json")):
                if path.exists():
                    found.append(path)
        return found

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the output's exclusive lock.

        Raises:
            LockHeldError: another process holds it (exit code 7).
        """
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise write_error(exc, self.lock_path) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeldError(
                    f"another bulkinfer run is writing {self.out} (lock {self.lock_path} is held)"
                ) from None
            yield
        finally:
            os.close(fd)

    def is_complete(self) -> bool:
        return self.out.exists()

    def has_partial(self) -> bool:
        return self.spool.exists() or self.journal.exists()

    def nothing_done(self) -> bool:
        """True when no attempt finished a row: the spools hold no record."""
        return not any(
            path.exists() and path.stat().st_size > 0 and self._has_line(path)
            for path in (self.spool, self.errors_spool)
        )

    @staticmethod
    def _has_line(path: Path) -> bool:
        with open(path, "rb") as f:
            return any(b"\n" in block for block in iter(lambda: f.read(1 << 16), b""))

    def start(self, identity: dict[str, Any], settings: dict[str, Any], resume: bool, overwrite: bool) -> Done:
        """Decide how this run starts; call with the lock held. ``identity``
        is :func:`input_identity`, ``settings`` :func:`results_settings`.

        Returns what earlier attempts finished (empty for a fresh start).

        Raises:
            OutputExistsError: the final output exists (without ``overwrite``),
                or a partial one does (without ``resume`` or ``overwrite``).
            ConfigError: ``resume`` with another input or other settings; the
                message says what changed (file size, modification time, each
                setting with its old and new value).
        """
        others = self.siblings()
        if len(others) == 1 and same_file(others[0], Path(identity["path"])):
            if not self._stem_files_are_ours():
                raise OutputExistsError(
                    f"the input {others[0]} has the stem of the output {self.out}, and {self.errors.name} or "
                    f"{self.report.name} beside it are not {self.out.name}'s (an earlier run's, with "
                    f"{others[0].name} as its output?); choose another output name "
                    f"(e.g. {formats.sibling(self.out, '.out' + self.out.suffix)})"
                )
            others = []  # `run data.jsonl -o data.parquet`: the input is no output whose files this one takes
        if others:
            raise OutputExistsError(
                f"{others[0]} shares {self.errors.name} and {self.report.name} with {self.out}; "
                "remove it or choose another output name"
            )
        if self.is_complete() and not overwrite:
            raise OutputExistsError(f"output {self.out} already exists; use --overwrite to replace it")
        self.discard_if_nothing_done()  # a start that failed before any row finished: nothing to keep
        if self.has_partial() and not (resume or overwrite):
            raise OutputExistsError(
                f"an interrupted run left partial output for {self.out}; "
                "use --resume to continue it or --overwrite to start over"
            )
        if resume and self.journal.exists() and not overwrite:
            check_same_results(self.out, orjson.loads(self.journal.read_bytes()), identity, settings, complete=False)
            return self._read_progress()
        self.discard_partial()
        self._write_journal(results_record(identity, settings))
        return Done()

    def _write_journal(self, data: dict[str, Any]) -> None:
        atomic_write(self.journal, orjson.dumps(data))

    def _read_progress(self) -> Done:
        # A crash between the two final renames leaves the errors published
        # and the output still spooled: take the errors back.
        if self.errors.exists() and not self.errors_spool.exists():
            self._take_back_errors()
        progress = Done()
        for path in (self.spool, self.errors_spool):
            if path.exists():
                cut_torn_tail(path)
        if self.spool.exists():
            for _, record in spool_records(self.spool):
                row = parse_output(record)
                if row is None:
                    raise ValueError(f"{self.spool}: a record that is not an output row: {record!r:.200}")
                progress.completed += 1
                progress.done_ids.add(row.id)
                progress.prompt_tokens += row.prompt_tokens
                progress.completion_tokens += row.completion_tokens
        if self.errors_spool.exists():
            for line, record in spool_records(self.errors_spool):
                progress.failed += 1
                progress.done_lines.add(line)
                row_id = record.get("custom_id", record.get("id"))
                if row_id is not None and not record.get("id_recovered"):
                    progress.failed_ids.add(str(row_id))
        return progress

    def _take_back_errors(self) -> None:
        """The published errors file (bare records, each with its ``line``)
        back into the errors spool's format, then removed."""
        tmp = self.errors_spool.with_name(f"{self.errors_spool.name}.{os.getpid()}.tmp")
        spool = Spool(tmp)
        try:
            for line, record in spool_records(self.errors):
                spool.add(line, record)
            spool.close()
            publish_path(tmp, self.errors_spool)
        except BaseException:
            spool.abandon()
            tmp.unlink(missing_ok=True)
            raise
        self.errors.unlink()

    def discard_if_nothing_done(self) -> None:
        """After a failed attempt: when no row finished in any attempt, remove
        the journal and spools so they stand in no later run's way."""
        if self.nothing_done() and not self.errors.exists():
            self.discard_partial()

    def discard_partial(self) -> None:
        """Remove spools, journal and temporaries of an earlier attempt."""
        runs = [*run_paths(self.spool), *run_paths(self.errors_spool)]
        for path in (self.spool, self.errors_spool, self.journal, self.tmp, self.ordered, self.errors_ordered, *runs):
            path.unlink(missing_ok=True)

    def finish(self, order: OutputOrder = "input", reported: bool = True) -> None:
        """Publish errors, then the output (its rename marks the run complete),
        each in ``order`` (see :func:`bulkinfer.io.spool.publish_spool`), then
        drop the journal, unless a report is still to be written
        (``reported`` false: :meth:`reported` drops it then, so that a
        ``--resume`` of a complete output whose report was never written
        can still check its input and settings against the journal).

        Raises:
            OSError: a file cannot be written; the spools stay for ``--resume``.
        """
        failpoint("before_publish")
        publish_spool(self.errors_spool, self.errors, order)
        failpoint("between_publish")
        publish_spool(self.spool, self.out, order, columns=self.columns)
        failpoint("after_publish")
        if reported:
            self.reported()

    def reported(self) -> None:
        """The run's report is written: its journal goes."""
        self.journal.unlink(missing_ok=True)

    def published(self) -> Published:
        """The rows of the published output and errors files, and the tokens
        of the completed ones (all 0 for a file not there).

        Raises:
            OSError: a file cannot be read.
        """
        completed = prompt = completion = 0
        if self.out.exists():
            for record in read_records(self.out):
                completed += 1
                if (row := parse_output(record)) is not None:
                    prompt, completion = prompt + row.prompt_tokens, completion + row.completion_tokens
        failed = sum(1 for _ in read_records(self.errors)) if self.errors.exists() else 0
        return Published(completed, failed, prompt, completion)


@dataclass(frozen=True, slots=True)
class Published:
    """What a run's published files hold: ``completed`` rows (output records),
    ``failed`` rows (error records), and the completed rows' ``prompt_tokens``
    and ``completion_tokens`` (tokens)."""

    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class RunPaths:
    """Where one run reads and writes."""

    input: Path
    output: Path

    @property
    def errors(self) -> Path:
        return formats.sibling(self.output, ".errors.jsonl")

    @property
    def report(self) -> Path:
        return formats.sibling(self.output, ".report.json")

    @property
    def html(self) -> Path:
        return formats.sibling(self.output, ".report.html")

    @classmethod
    def build(cls, input_path: Path, output: Path | None, default_suffix: str = ".out.jsonl") -> RunPaths:
        """The paths of a run; ``output`` defaults to ``INPUT_STEM`` + ``default_suffix``.

        Raises:
            ConfigError: the output has an unknown suffix, or a path the run
                writes (output, errors, report, spool, journal, lock; see
                :meth:`bulkinfer.io.output_files.OutputFiles.paths`) is the input,
                by name, symlink or hard link.
        """
        out = output if output is not None else formats.default_output(input_path, default_suffix)
        formats.output_format(out)
        for path in OutputFiles(out).paths():
            if same_file(path, input_path):
                what = "output" if path == out else f"the file {path.name} that output {out} writes"
                raise ConfigError(f"{what} would overwrite the input {input_path}; choose another -o")
        return cls(input_path, out)


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same real path, or (both
    existing) the same inode, so symlinks and hard links count."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
