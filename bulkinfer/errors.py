"""The exception hierarchy of bulkinfer and the process exit codes.

Every error the core raises on purpose is a :class:`BulkinferError`; each class
knows its exit code. Only the CLI turns them into ``sys.exit`` codes.

Exit codes (also in the README and ``bulkinfer run --help``):

====  ==========================================================
0     every row completed
2     usage or configuration error (bad flag, bad TOML, bad path)
3     the run finished but some rows failed (see ``*.errors.jsonl``)
4     a file the command reads is missing (``... not found: PATH``: input,
      golden, predictions, --compare, --config, report) or cannot be read
      (not JSONL/Parquet/JSON, bad schema, no row with a ``reference``)
5     the model cannot be prepared or loaded, or the engine failed
6     the output already exists (use ``--overwrite``), or an interrupted
      run's partial output does (use ``--resume`` or ``--overwrite``)
7     another run holds the lock on this output
8     ``bulkinfer eval``: a metric fell below its ``--fail-under`` bar
9     a file of the run cannot be written (disk full, read-only file
      system, permission denied, a path component that is not a
      directory); finished rows are kept: fix it, then ``--resume``
128+N the run was stopped by signal N
====  ==========================================================
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_INPUT = 4
EXIT_ENGINE = 5
EXIT_OUTPUT_EXISTS = 6
EXIT_LOCKED = 7
EXIT_BELOW_BAR = 8
EXIT_WRITE = 9


class BulkinferError(Exception):
    """Base class: a failure of the whole command, with a message for the user."""

    exit_code: int = 1


class ConfigError(BulkinferError):
    """A bad flag, config file or setting value."""

    exit_code = EXIT_USAGE


class InputFileError(BulkinferError):
    """A file the command reads (input, golden, predictions, config, saved
    report) is missing or cannot be read as a whole (not a single bad row)."""

    exit_code = EXIT_INPUT


class ModelError(BulkinferError):
    """The model cannot be found, prepared or loaded."""

    exit_code = EXIT_ENGINE


class EngineError(BulkinferError):
    """The inference engine failed to start or crashed during the run."""

    exit_code = EXIT_ENGINE


class OutputExistsError(BulkinferError):
    """The final output already exists and no ``--overwrite`` was given."""

    exit_code = EXIT_OUTPUT_EXISTS


class LockHeldError(BulkinferError):
    """Another bulkinfer run is writing the same output."""

    exit_code = EXIT_LOCKED


class OutputWriteError(BulkinferError):
    """A file of the run (output, errors, report, spool, journal, lock) cannot
    be written: ENOSPC, EDQUOT, EROFS, EACCES, EPERM, ENOTDIR, EISDIR, EFBIG."""

    exit_code = EXIT_WRITE

    def __init__(self, message: str, what: str | None = None):
        super().__init__(message)
        self.what = what or message  # the failure without the CLI's advice (a server logs this)


class Interrupted(BulkinferError):
    """The run was stopped (by a signal, or a caller's stop token); finished
    rows were flushed to disk. Exit code 128 + the signal's number (130, as
    for SIGINT, when no signal asked)."""

    def __init__(self, signum: int | None, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + (signum if signum is not None else 2)


def closest(name: str, known: Iterable[str], otherwise: str = "") -> str:
    """``"; did you mean a or b?"`` for the known names closest to ``name``
    (:func:`difflib.get_close_matches`, at most 3), else ``otherwise``: the
    tail of an "unknown name" error."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=3)
    return f"; did you mean {' or '.join(close)}?" if close else otherwise


# errno -> what to do, for the OSErrors that mean "this file cannot be written"
_WRITE_HINTS = {
    "ENOSPC": "the disk is full: free some space, then continue with --resume",
    "EDQUOT": "the disk quota is exceeded: free some space, then continue with --resume",
    "EFBIG": "the file is too large for this file system: choose another -o",
    "EROFS": "the file system is read-only: choose another -o",
    "EACCES": "permission denied: fix the permissions or choose another -o",
    "EPERM": "operation not permitted: fix the permissions or choose another -o",
    "ENOTDIR": "a component of the path is not a directory: choose another -o",
    "EISDIR": "it is a directory: choose another -o",
}


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost
    first (at most 8: a chain, never a cycle)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from or during, says a
    disk is full: an OSError ENOSPC or EDQUOT, or SQLite's "database or disk
    is full" (``sqlite3.OperationalError``, which carries no errno)."""
    return any(
        (isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT))
        or (type(seen).__name__ == "OperationalError" and "disk is full" in str(seen))
        for seen in causes(exc)
    )


def write_reason(exc: BaseException) -> str:
    """What could not be written, in a server's words (no CLI hint): an
    :class:`OutputWriteError`'s ``what`` (``"cannot write /data/x.jsonl: No
    space left on device (ENOSPC)"``), else the innermost OSError's file and
    reason, SQLite's message, or ``exc``'s type and message."""
    chain = causes(exc)
    for seen in chain:
        if isinstance(seen, OutputWriteError):
            return seen.what
    for seen in reversed(chain):
        if isinstance(seen, OSError):
            return f"{os.fsdecode(seen.filename)}: {os_reason(seen)}" if seen.filename else os_reason(seen)
        if type(seen).__name__ == "OperationalError":
            return f"the state database: {seen}"
    return f"{type(exc).__name__}: {exc}"


def os_reason(exc: OSError) -> str:
    """``"REASON (ERRNO)"`` of an OSError: ``"Read-only file system (EROFS)"``
    (``OSError`` where it has no errno)."""
    return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, 'OSError')})"


def write_error(exc: OSError, path: object = None) -> OutputWriteError:
    """An :class:`OutputWriteError` for ``exc`` naming the file (``path``, else
    ``exc.filename``), the errno's name and what to do (a plainer hint for an
    errno outside ENOSPC, EDQUOT, EFBIG, EROFS, EACCES, EPERM, ENOTDIR, EISDIR)."""
    where = path if path is not None else exc.filename
    hint = _WRITE_HINTS.get(
        errno.errorcode.get(exc.errno or 0, ""), "finished rows are kept: continue with --resume once it is fixed"
    )
    what = f"cannot write {where}: {os_reason(exc)}"
    return OutputWriteError(f"{what}; {hint}", what)


# What a file that is no regular file is, by its stat mode.
_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str | None:
    """What a file of stat ``mode`` is when it is no regular file (``"a
    directory"``, ``"a named pipe (FIFO)"``, ...); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _NOT_REGULAR if test(mode)), "a special file")


def check_readable(path: Path, what: str) -> None:
    """Check that ``path`` is a regular file, by ``os.stat`` (a FIFO is never
    opened: that would block until a writer appears); ``what`` names it in
    errors (``"config file"``).

    Raises:
        InputFileError: ``WHAT not found: PATH``; it cannot be stat'ed
            (permission, a loop); it is a directory, FIFO, socket or device.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputFileError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise InputFileError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    kind = file_kind(mode)
    if kind is not None:
        raise InputFileError(f"the {what} {path} is {kind}, not a file")


def read_whole(path: Path, what: str) -> bytes:
    """The bytes of ``path``, a small file read whole (a config, a saved
    report, a JSON schema), after :func:`check_readable`.

    Raises:
        InputFileError: as :func:`check_readable`; the read fails.
    """
    check_readable(path, what)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InputFileError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
