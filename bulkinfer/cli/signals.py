"""Signals and exit: SIGINT, SIGTERM and SIGHUP as the stop token the core checks; errors as exit codes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import typer

from bulkinfer.engine.watchdog import kill_all_now  # imported here, never inside the handler
from bulkinfer.errors import BulkinferError, EngineError, Interrupted
from bulkinfer.stop import StopToken


class JobResult(Protocol):
    """What every job of :mod:`bulkinfer` returns: its report and exit code."""

    @property
    def report(self) -> dict[str, Any]: ...
    @property
    def exit_code(self) -> int: ...


T = TypeVar("T", bound=JobResult)


def fail(exc: BulkinferError) -> NoReturn:
    """Print ``exc`` as ``bulkinfer: error: ...`` and exit with its code; after a
    stop (:class:`Interrupted`) a further signal ends the process at once."""
    typer.echo(f"bulkinfer: error: {exc}", err=True)
    if isinstance(exc, Interrupted):
        # The spools are closed and the engine is shut down: a further signal
        # while the process winds down ends it at once, with 128 + N.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, exit_at_once)
        _stopped_by_signal.append(exc.exit_code)
    raise typer.Exit(code=exc.exit_code)


def exit_at_once(signum: int, frame: object) -> None:
    """A signal handler: end the process now, with exit code 128 + ``signum``."""
    os._exit(128 + signum)


# Set by fail when a stop signal ended the command: main() then leaves at once.
_stopped_by_signal: list[int] = []


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP, while a command runs, as calls to a
    :class:`~bulkinfer.stop.StopToken` the job checks: a stop finishes
    cleanly (no new requests, finished rows flushed and fsync'd, exit code
    128 + N). A second signal stops at once.

    While the job is ``starting`` (model load and engine start: nothing to
    flush yet) the first signal raises :class:`Interrupted` at once, wherever
    the main thread is; the engine start cleans its processes up. So it does
    while a stream writes to its reader (:meth:`StopToken.blocking_write`):
    a reader that stopped reading would block the stop forever. Only the
    CLI installs these handlers (the main thread's): the core never does.
    A signal the process was started ignoring stays ignored (``nohup``:
    SIGHUP; a script's ``cmd &``: SIGINT), as the caller asked.

    The job's load deadline (:meth:`StopToken.loading`,
    ``plan.start_timeout_s``) is enforced here, by a thread: past it, it
    writes the error (and ``textfile``'s ending), kills the engine's
    processes and ends this one with exit 5 (:class:`EngineError`'s). Not
    by raising in the main thread from a signal handler: such an exception, raised wherever the main thread
    was, once left the interpreter to crash later in its garbage collector
    (a segmentation fault, in a test), and a main thread blocked inside a C
    call would never run the handler. Nothing is lost: no row has run yet,
    and the lock goes with the process."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, textfile: OutcomeFile | None = None) -> None:
        self.textfile = textfile
        self.token = StopToken()
        self._previous: dict[int, Any] = {}
        self._done = threading.Event()

    def __enter__(self) -> StopToken:
        # a signal the process was started ignoring (nohup: SIGHUP; `cmd &` in a script: SIGINT) stays ignored
        asked = [s for s in self.SIGNALS if signal.getsignal(s) != signal.SIG_IGN]
        self._previous = {s: signal.signal(s, self._handle) for s in asked}
        threading.Thread(target=self._watch_load, name="bulkinfer-load-deadline", daemon=True).start()
        return self.token

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.token.is_set():
            raise Interrupted(signum, f"stopped at once by a second {name}")
        self.token.stop(f"stopped by {name}", signum)
        if self.token.starting:
            kill_all_now()  # an engine being started dies now, not after vLLM's graceful shutdown
            raise Interrupted(signum, f"stopped by {name} before any row was run")
        if self.token.writing:  # blocked on a reader that does not read: the write is abandoned
            raise Interrupted(signum, f"stopped by {name} while the output's reader was not reading")

    def _watch_load(self) -> None:
        """Polls the job's load deadline every 0.5 s while the command runs;
        past it, ends the process (see the class)."""
        while not self._done.wait(0.5):
            deadline = self.token.load_deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            from bulkinfer.engine.log import terminal
            from bulkinfer.engine.watchdog import kill_all_now

            stuck = EngineError(
                f"the model load and engine start took over {self.token.load_timeout_s:g} s "
                "(plan.start_timeout_s): stopped before any row was run; if the model needs longer, "
                "raise --start-timeout-s, else see the engine's log"
            )
            if self.token.load_deadline is None:  # the load ended meanwhile
                continue
            # to the terminal and, while it captures standard error, the engine's log; straight to the file
            # descriptors: a main thread stuck while writing would hold a stream's lock
            for fd in {2, terminal().fileno()}:
                os.write(fd, f"bulkinfer: error: {stuck}\n".encode())
            kill_all_now()
            if self.textfile is not None:
                self.textfile.write(stuck.exit_code)
            os._exit(stuck.exit_code)


def invoke(options: dict[str, Any], job: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``job(*args, settings, **kwargs, ...)`` (one of :mod:`bulkinfer`'s
    functions) for a command: its settings from the command's ``options``
    (its ``locals()``: ``--config`` and the flags, see
    :func:`~bulkinfer.cli.options.settings_from_flags`), its invocation's
    choices (``--overwrite``, ``--resume``, ...), SIGINT, SIGTERM and SIGHUP
    as its stop token. A :class:`BulkinferError` ends the command with its
    message and exit code (:func:`fail`). With ``--metrics-textfile``, the
    ending is written there first, whatever it is (:class:`OutcomeFile`).

    Raises:
        typer.BadParameter: a bad ``--metrics-textfile`` (exit 2).
    """
    from bulkinfer.cli.options import invocation, settings_from_flags

    textfile = OutcomeFile.of(options, job.__name__, args[0])
    try:
        settings = settings_from_flags(options.get("config"), options)
        with StopSignals(textfile) as stop:
            result = job(*args, settings, **kwargs, **invocation(options, stop))
    except BulkinferError as exc:
        textfile.write(exc.exit_code)
        fail(exc)
    except Exception as exc:  # a bad flag value (click's exit 2), or a bug (exit 1, with its traceback)
        textfile.write(getattr(exc, "exit_code", 1))
        raise
    textfile.write(result.exit_code, result.report)
    return result


class OutcomeFile:
    """``--metrics-textfile``: the command's outcome written there as it ends
    (:mod:`bulkinfer.report.textfile`), whatever the ending; a file that cannot
    be written is a warning, never another exit code (the job's own stands,
    and the file's age tells a watcher)."""

    COMMANDS = {"evaluate": "eval", "evaluate_rank": "eval-rank"}  # the function's name -> the command's

    def __init__(self, path: Path | None, command: str, input_path: str) -> None:
        self.path, self.command, self.input = path, command, input_path
        self.started = time.time()

    @classmethod
    def of(cls, options: dict[str, Any], job_name: str, input_path: Any) -> OutcomeFile:
        """The command's file (none without ``--metrics-textfile``), checked before the job starts.

        Raises:
            typer.BadParameter: no ``.prom`` name (the collector reads no other), no such
                directory or one this process cannot write (exit 2).
        """
        path = options.get("metrics_textfile")
        if path is not None:
            if path.suffix != ".prom":
                raise typer.BadParameter(
                    f"{path}: node_exporter's textfile collector reads only *.prom files",
                    param_hint="--metrics-textfile",
                )
            if not path.absolute().parent.is_dir():
                raise typer.BadParameter(f"{path}: no such directory", param_hint="--metrics-textfile")
            if not os.access(path.absolute().parent, os.W_OK | os.X_OK):  # known now, not after the run
                raise typer.BadParameter(f"{path}: its directory is not writable", param_hint="--metrics-textfile")
        shown = str(input_path) if str(input_path) == "-" else str(Path(input_path).absolute())
        return cls(path, cls.COMMANDS.get(job_name, job_name), shown)

    def write(self, exit_code: int, report: dict[str, Any] | None = None) -> None:
        """Replace the file with this ending (nothing without the flag)."""
        if self.path is None:
            return
        from bulkinfer.report.textfile import Outcome, write_textfile

        outcome = Outcome(self.command, self.input, self.started, time.time(), exit_code, report)
        try:
            write_textfile(self.path, outcome)
        except OSError as exc:
            typer.echo(f"bulkinfer: warning: --metrics-textfile {self.path}: not written: {exc}", err=True)
