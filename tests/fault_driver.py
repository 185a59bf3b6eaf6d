"""Runs `bulkinfer run` logic with a slow fake engine in its own process, so
tests can kill it (SIGKILL, SIGTERM) at chosen moments.

Usage: python tests/fault_driver.py INPUT OUTPUT [--resume] [--step-delay S]
Exit code: as `bulkinfer run` (0, 3, 128+N, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.errors import BulkinferError
from bulkinfer.runner import RunPaths, run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("input", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.05)
    args = parser.parse_args()
    settings = load_settings(None, {"plan.max_in_flight": 2})
    try:
        result = run(
            RunPaths.build(args.input, args.output),
            settings,
            resume=args.resume,
            engine_factory=lambda m, s: FakeEngine(step_delay=args.step_delay),
            progress_plain=True,
        )
    except BulkinferError as exc:
        print(f"bulkinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
