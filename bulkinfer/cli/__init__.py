"""The ``bulkinfer`` command line: parses options, installs signal handling,
calls one core function per command (the functions of the Python API), and
maps :class:`~bulkinfer.errors.BulkinferError` to exit codes.

Heavy modules (vLLM, torch, transformers, pyarrow) are imported inside the
commands, so ``bulkinfer --help`` stays fast.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from bulkinfer.cli.app import app

# isort: off
# The @app.command decorators register the commands; `bulkinfer --help` lists them in this order.
from bulkinfer.cli.run_command import run
from bulkinfer.cli import encoder_commands  # noqa: F401
from bulkinfer.cli import commands  # noqa: F401
from bulkinfer.cli import serve_command  # noqa: F401

# isort: on
from bulkinfer.cli.options import NEGATIONS, OVERRIDES, settings_from_flags
from bulkinfer.cli.signals import StopSignals, _stopped_by_signal
from bulkinfer.engine.log import open_closed_stdio, tolerate_readers_gone
from bulkinfer.engine.malloc import restart_tuned

__all__ = ["NEGATIONS", "OVERRIDES", "StopSignals", "app", "main", "run", "settings_from_flags"]


# The exit code of the command that finished normally (see _exit_without_teardown).
_exit_code: list[int] = []


def _exit_without_teardown() -> None:
    """The process's last exit handler once a command loaded torch: ends it
    with the command's exit code before the interpreter tears down its
    modules one by one (3.6 to 4.2 s with torch, vLLM and transformers
    loaded, measured on a 2-core AMD EPYC Zen 3: a 5-row run took 33.7 s
    wall instead of 29.9 s). Every other exit handler has run by then
    (vLLM's, multiprocessing's, ``weakref.finalize``'s: they were
    registered after this one), and the command's files are closed;
    ``logging``'s, registered before, is called here."""
    if not _exit_code or "torch" not in sys.modules:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(_exit_code[0])


def main() -> None:
    """The ``bulkinfer`` console script. A command first restarts itself
    under glibc malloc tunables that spare each engine step its page
    faults (:mod:`bulkinfer.engine.malloc`; ``BULKINFER_MALLOC_TUNABLES=0``:
    glibc's defaults)."""
    open_closed_stdio()  # first: a file opened while one is closed would take its number
    restart_tuned()
    tolerate_readers_gone()  # a closed pipe on the terminal's streams loses lines, never the run or its exit code
    atexit.register(_exit_without_teardown)
    try:
        app()
    except SystemExit as exc:
        if not _stopped_by_signal:
            if exc.code is None or isinstance(exc.code, int):
                _exit_code.append(exc.code or 0)
            raise
        # Finished rows are on disk and the engine is shut down: skip the
        # interpreter's shutdown (1-2 s with torch and vLLM loaded), during
        # which a further signal would end the process by that signal.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_stopped_by_signal[0])
