"""Crash-safe state of one output: its lock, its spools and its journal.

Beside ``OUT`` a run keeps (all hidden, all in the same directory so renames
are atomic):

- ``.OUT.lock``: held with ``fcntl.flock`` for the whole run; the kernel frees
  it when the holder dies, even by ``kill -9``.
- ``.OUT.partial.jsonl`` and ``.OUT.errors.jsonl.partial.jsonl``: the spools,
  one complete JSON line per finished row, appended as rows finish.
- ``.OUT.journal.json``: the input's identity (path, size, mtime) and a
  fingerprint of the settings that shape results, so that ``--resume`` refuses
  to continue with another input or other settings.

The spools are the record of what is done: after a crash, a torn last line is
cut off and every complete line stays done. The final files appear by
``os.replace``: errors first, output last, so an existing final ``OUT`` means
the run is complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bulkinfer import writers
from bulkinfer.config import Settings
from bulkinfer.errors import ConfigError, LockHeldError, OutputExistsError


@dataclass(slots=True)
class Done:
    """What earlier attempts of this run finished, read back from the spools."""

    done_ids: set[str] = field(default_factory=set)
    done_lines: set[int] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def input_identity(path: Path) -> dict[str, Any]:
    """The input's absolute path, size (bytes) and mtime (ns)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def settings_fingerprint(settings: Settings) -> str:
    """SHA-256 over the settings that shape results (model, sampling, engine,
    pass-through); plan settings (order, windows) may change between attempts."""
    data = settings.to_dict()
    data.pop("plan")
    return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()


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

    def __init__(self, out: Path, errors: Path):
        self.out = out
        self.errors = errors
        self.spool = writers.spool_path(out)
        self.errors_spool = writers.spool_path(errors)
        self.journal = out.with_name(f".{out.name}.journal.json")
        self.lock_path = out.with_name(f".{out.name}.lock")

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the output's exclusive lock.

        Raises:
            LockHeldError: another process holds it (exit code 7).
        """
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
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

    def start(self, identity: dict[str, Any], fingerprint: str, resume: bool, overwrite: bool) -> Done:
        """Decide how this run starts; call with the lock held.

        Returns what earlier attempts finished (empty for a fresh start).

        Raises:
            OutputExistsError: the final output exists (without ``overwrite``),
                or a partial one does (without ``resume`` or ``overwrite``).
            ConfigError: ``resume`` with another input or other settings.
        """
        if self.is_complete() and not overwrite:
            raise OutputExistsError(f"output {self.out} already exists; use --overwrite to replace it")
        if self.has_partial() and not (resume or overwrite):
            raise OutputExistsError(
                f"an interrupted run left partial output for {self.out}; "
                "use --resume to continue it or --overwrite to start over"
            )
        if resume and self.journal.exists() and not overwrite:
            journal = orjson.loads(self.journal.read_bytes())
            if journal.get("input") != identity:
                raise ConfigError(
                    f"cannot resume {self.out}: it was started from input {journal.get('input')}, "
                    f"not {identity}; use --overwrite to start over"
                )
            if journal.get("settings_sha256") != fingerprint:
                raise ConfigError(
                    f"cannot resume {self.out}: settings differ from the interrupted run's; "
                    "use the same settings, or --overwrite to start over"
                )
            return self._read_progress()
        self.discard_partial()
        self._write_journal({"input": identity, "settings_sha256": fingerprint})
        return Done()

    def _write_journal(self, data: dict[str, Any]) -> None:
        tmp = self.journal.with_name(self.journal.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.journal)

    def _read_progress(self) -> Done:
        # A crash between the two final renames leaves the errors published
        # and the output still spooled: take the errors back.
        if self.errors.exists() and not self.errors_spool.exists():
            os.replace(self.errors, self.errors_spool)
        progress = Done()
        for path in (self.spool, self.errors_spool):
            if path.exists():
                cut_torn_tail(path)
        if self.spool.exists():
            for chunk in writers.iter_jsonl_chunks(self.spool):
                for record in chunk:
                    progress.completed += 1
                    if "custom_id" in record:
                        progress.done_ids.add(record["custom_id"])
                        usage = record["response"]["body"]["usage"]
                    else:
                        progress.done_ids.add(record["id"])
                        usage = record
                    progress.prompt_tokens += usage["prompt_tokens"]
                    progress.completion_tokens += usage["completion_tokens"]
        if self.errors_spool.exists():
            for chunk in writers.iter_jsonl_chunks(self.errors_spool):
                for record in chunk:
                    progress.failed += 1
                    progress.done_lines.add(record["line"])
        return progress

    def discard_partial(self) -> None:
        """Remove spools, journal and temporaries of an earlier attempt."""
        for path in (self.spool, self.errors_spool, self.journal, self.out.with_name(f".{self.out.name}.tmp")):
            path.unlink(missing_ok=True)

    def finish(self) -> None:
        """Publish errors, then the output (its rename marks the run complete),
        then drop the journal."""
        failpoint("before_publish")
        writers.publish(self.errors_spool, self.errors)
        failpoint("between_publish")
        writers.publish(self.spool, self.out)
        failpoint("after_publish")
        self.journal.unlink(missing_ok=True)


def failpoint(name: str) -> None:
    """Fault injection for the crash tests: ``BULKINFER_FAILPOINT=name`` makes
    the process kill itself with SIGKILL here. Unset in normal use."""
    if os.environ.get("BULKINFER_FAILPOINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
