"""The ``bulkinfer`` command line: parses options, installs signal handling,
calls one core function per command (the functions of the Python API), and
maps :class:`~bulkinfer.errors.BulkinferError` to exit codes.

Heavy modules (vLLM, torch, transformers, pyarrow) are imported inside the
commands, so ``bulkinfer --help`` stays fast.
"""

from __future__ import annotations

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

__all__ = ["NEGATIONS", "OVERRIDES", "StopSignals", "app", "main", "run", "settings_from_flags"]


def main() -> None:
    try:
        app()
    except SystemExit:
        if not _stopped_by_signal:
            raise
        # Finished rows are on disk and the engine is shut down: skip the
        # interpreter's shutdown (1-2 s with torch and vLLM loaded), during
        # which a further signal would end the process by that signal.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_stopped_by_signal[0])
