"""Signals and exit: SIGINT, SIGTERM and SIGHUP as the stop token the core checks; errors as exit codes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer

from bulkinfer.errors import BulkinferError, Interrupted
from bulkinfer.stop import StopToken

T = TypeVar("T")


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
    the main thread is; the engine start cleans its processes up. Only the
    CLI installs these handlers (the main thread's): the core never does."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.token = StopToken()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopToken:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self.token

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.token.is_set():
            raise Interrupted(signum, f"stopped at once by a second {name}")
        self.token.stop(f"stopped by {name}", signum)
        if self.token.starting:
            from bulkinfer.engine.watchdog import kill_all_now

            kill_all_now()  # an engine being started dies now, not after vLLM's graceful shutdown
            raise Interrupted(signum, f"stopped by {name} before any row was run")


def invoke(options: dict[str, Any], job: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``job(*args, settings, **kwargs, ...)`` (one of :mod:`bulkinfer`'s
    functions) for a command: its settings from the command's ``options``
    (its ``locals()``: ``--config`` and the flags, see
    :func:`~bulkinfer.cli.options.settings_from_flags`), its invocation's
    choices (``--overwrite``, ``--resume``, ...), SIGINT, SIGTERM and SIGHUP
    as its stop token. A :class:`BulkinferError` ends the command with its
    message and exit code (:func:`fail`)."""
    from bulkinfer.cli.options import invocation, settings_from_flags

    try:
        settings = settings_from_flags(options.get("config"), options)
        with StopSignals() as stop:
            return job(*args, settings, **kwargs, **invocation(options, stop))
    except BulkinferError as exc:
        fail(exc)
