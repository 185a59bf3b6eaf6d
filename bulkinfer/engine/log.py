"""The engine's log: what vLLM, torch, transformers and gguf print goes to a
file beside the output (``OUT.log``), and the terminal keeps bulkinfer's own
lines (progress, summary, warnings, errors).

The capture is at the file-descriptor level: file descriptors 1 and 2 point
at the log while :class:`EngineLog` is active, so the engine's processes
(which inherit them), C extensions, Python ``logging`` handlers, warnings and
progress bars all land there; bulkinfer writes to :func:`terminal`, a stream
on the original standard error. vLLM logs at ``INFO`` there
(``VLLM_LOGGING_LEVEL``, which a user's environment overrides).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import IO, cast

from bulkinfer.errors import BulkinferError

# Where bulkinfer's own lines go while a capture is active (None: sys.stderr).
_terminal: IO[str] | None = None
# One capture at a time: the check that none is active and the file descriptors
# it moves are the process's, so two threads' runs must not interleave them.
_CAPTURE = threading.Lock()
# The last line of a Python traceback: "SomeError: message" (vLLM prefixes its
# worker processes' lines with "(EngineCore pid=N) ").
_EXCEPTION_LINE = re.compile(r"^(?:\([^)]*\) )?(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b:? .*")
# How much of the log's end is searched for the engine's last error (bytes).
TAIL_BYTES = 64 * 1024


class ReaderGone:
    """A text stream for bulkinfer's own lines (progress, summary, warnings)
    that a reader which went away cannot stop: once a write or flush meets
    a closed pipe (``bulkinfer run ... 2>&1 | head``, a log consumer that
    died), this and every later line is dropped and the run goes on; the
    data files are what the run is for. Everything else is ``stream``'s."""

    def __init__(self, stream: IO[str]):
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self.gone = True

    def close(self) -> None:
        try:
            self._stream.close()
        except BrokenPipeError:  # the last lines' flush
            self.gone = True

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def tolerate_readers_gone() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`ReaderGone` (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ReaderGone):
            setattr(sys, name, ReaderGone(stream))


# The standard file descriptors that were closed when bulkinfer started (``>&-``), by number,
# comma-separated: kept in the environment across the malloc restart (bulkinfer.engine.malloc).
CLOSED_STDIO_ENV = "BULKINFER_CLOSED_STDIO"


def open_closed_stdio() -> None:
    """Give a standard file descriptor closed at start (``<&-``, ``>&-``)
    ``/dev/null``, and ``sys.stdin``/``stdout``/``stderr`` (None then) a
    stream on it: else the next file opened takes its number, and what vLLM
    or a library prints to standard output lands in that file. Which were
    closed is kept in :data:`CLOSED_STDIO_ENV` (see :func:`closed_stdio`)."""
    closed = set(closed_stdio())
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:  # the lowest free number: fd itself unless a lower one was closed too
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)
            closed.add(fd)
    if closed:
        os.environ[CLOSED_STDIO_ENV] = ",".join(map(str, sorted(closed)))
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115 (the process's)


def closed_stdio() -> frozenset[int]:
    """The standard file descriptors closed when bulkinfer started (:func:`open_closed_stdio`)."""
    value = os.environ.get(CLOSED_STDIO_ENV, "")
    return frozenset(int(fd) for fd in value.split(",") if fd in ("0", "1", "2"))


def terminal() -> IO[str]:
    """The stream for bulkinfer's own lines: the real standard error, also
    while an :class:`EngineLog` captures file descriptor 2."""
    return _terminal or sys.stderr


def warn(message: str) -> None:
    """``bulkinfer: warning: MESSAGE`` on :func:`terminal`."""
    print(f"bulkinfer: warning: {message}", file=terminal())


class EngineLog:
    """Sends file descriptors 1 and 2 to ``path`` for the ``with`` block.

    Args:
        path: the log file; created, or appended to with ``append``
            (a resumed run keeps the interrupted run's log), else truncated;
            never truncated when standard output or error is that file
            (they are shared, see :meth:`_open`).
        verbose: capture nothing: the engine's log stays on the terminal.

    A capture inside an active one does nothing (``eval`` runs ``run``), as
    does one while another thread's is active (two runs of the Python API:
    the second's engine writes where the process's output goes); the check
    and the move are one step (:data:`_CAPTURE`).
    """

    def __init__(self, path: Path, verbose: bool = False, append: bool = False):
        self.path = path
        self.active = False  # file descriptors 1 and 2 point at the log now
        self.captured = False  # they did during this block
        self.shared = False  # the log is the file standard output or error already wrote to
        self._verbose, self._append = verbose, append
        self._saved: tuple[int, int] | None = None
        self._start = 0

    def __enter__(self) -> EngineLog:
        with _CAPTURE:
            return self._capture()

    def _capture(self) -> EngineLog:
        global _terminal
        if self._verbose or _terminal is not None:
            return self
        fd = self._open()
        self._start = os.fstat(fd).st_size if self._append or self.shared else 0
        _flush_std()
        try:
            self._saved = (os.dup(1), os.dup(2))
        except OSError:  # standard output or error closed (a daemon): nothing to keep apart
            os.close(fd)
            return self
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        stream = os.fdopen(os.dup(self._saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
        _terminal = cast(IO[str], ReaderGone(stream))
        self.active = self.captured = True
        return self

    def _open(self) -> int:
        """A descriptor of the log: where standard output or error already
        write to this very file (``run ... -o out.jsonl >> out.log 2>&1``
        from cron), a duplicate of that one (:attr:`shared`): the engine's
        lines and bulkinfer's share its offset and go in order, where a new
        descriptor would truncate the file and overwrite them; else the
        file opened anew (appended to with ``append``, else truncated)."""
        try:
            log = os.stat(self.path)
            for std in (1, 2):
                found = os.fstat(std)
                if (found.st_dev, found.st_ino) == (log.st_dev, log.st_ino):
                    self.shared = True
                    return os.dup(std)
        except OSError:  # no such log yet, or a standard stream closed
            pass
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if self._append else os.O_TRUNC)
        return os.open(self.path, flags, 0o644)

    def __exit__(self, *exc: object) -> None:
        with _CAPTURE:
            self._release()

    def _release(self) -> None:
        global _terminal
        if not self.active or self._saved is None:
            return
        _flush_std()
        assert _terminal is not None
        _terminal.close()
        _terminal = None
        out, err = self._saved
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        self._saved = None
        self.active = False

    def last_error(self) -> str | None:
        """The last exception line (``SomeError: message``) this capture
        wrote to the log, if any: the engine's own account of a failure."""
        if not self.path.exists():
            return None
        with open(self.path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(self._start, end - TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
        found = [line.strip() for line in text.splitlines() if _EXCEPTION_LINE.match(line.strip())]
        return found[-1] if found else None

    def explain(self, exc: BulkinferError) -> BulkinferError:
        """``exc`` of the same type with the engine's last error and the
        log's path added to its message (when this capture was active)."""
        if not self.captured:
            return exc
        detail = self.last_error()
        extra = f"\n  the engine's log says: {detail}" if detail and detail not in str(exc) else ""
        extra += f"\n  engine log: {self.path}"
        return type(exc)(f"{exc}{extra}")


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
