"""Runs `bulkinfer run` logic with a slow fake engine in its own process, so
tests can kill it (SIGKILL, SIGTERM) at chosen moments.

Usage: python tests/fault_driver.py INPUT|- OUTPUT|- [--resume] [--step-delay S] [--hang-at N] [--slow-start S]
[--start-timeout S]
(--hang-at: from step N on no step finishes; --slow-start: the engine takes S seconds to start, like a model load;
--start-timeout: plan.start_timeout_s)
Exit code: as `bulkinfer` (0, 3, 128+N, ...), through the CLI's own exit path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from fakes import FakeEngine, without_native_bfloat16

from bulkinfer.cli import StopSignals
from bulkinfer.config import load_settings
from bulkinfer.errors import BulkinferError
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.jobs.stream import StreamPaths, stream


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("input", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--slow-start", type=float, default=0.0)
    parser.add_argument("--start-timeout", type=float)
    args = parser.parse_args()
    without_native_bfloat16()
    overrides: dict[str, object] = {"plan.max_in_flight": 2}
    if args.start_timeout is not None:
        overrides["plan.start_timeout_s"] = args.start_timeout
    settings = load_settings(None, overrides)

    def factory(model: str, s: object) -> FakeEngine:
        time.sleep(args.slow_start)
        return FakeEngine(step_delay=args.step_delay, hang_at=args.hang_at)

    try:
        with StopSignals() as stop:  # as the CLI does
            context = RunContext(resume=args.resume, engine_factory=factory, progress_plain=True, stop=stop)
            if str(args.input) == "-":  # a stream: rows from standard input, records to standard output
                result = stream(sys.stdin.buffer, StreamPaths.build(None), settings, context)
            else:
                result = run(RunPaths.build(args.input, args.output), settings, context)
    except BulkinferError as exc:
        print(f"bulkinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return result.exit_code


if __name__ == "__main__":
    code = main()
    # as the console script ends after a signal (bulkinfer.cli.main): without the interpreter's teardown, here of
    # the torch a SIGTERM may have stopped importing halfway (the tokenizer's load); one CI run waited over 30 s
    # for this driver to end after such a SIGTERM
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
