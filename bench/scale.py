"""Scale series: seconds and peak RSS of `bulkinfer run` for N short prompts with max_tokens 1.

Usage (from the repo root, after `make install`):

    .venv/bin/python -m bench.scale --rows 10000 100000 --out bench/results/scale.json

Each size is a fresh `bulkinfer run` process (one engine start each). Peak RSS
is read by the parent with `resource.getrusage(RUSAGE_CHILDREN)` after each
run, i.e. the largest of the bulkinfer process and its engine processes, and
from the run's own report (`peak_rss_bytes.bulkinfer`: the bulkinfer process
alone, which holds the reader, planner and writer).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

WORDS = "the of and to in is for on that with as by at from this be are it an or was".split()


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` JSONL rows of 4..16 random words each, written in blocks."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        for start in range(0, rows, 10_000):
            block = (
                orjson.dumps({"id": f"r{i}", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 16)))}) + b"\n"
                for i in range(start, min(start + 10_000, rows))
            )
            f.write(b"".join(block))


def run_one(rows: int, workdir: Path) -> dict[str, object]:
    src = workdir / f"scale_{rows}.jsonl"
    write_rows(src, rows)
    out = workdir / f"scale_{rows}.out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "bulkinfer",
        "run",
        str(src),
        "-o",
        str(out),
        "--overwrite",
        "--max-tokens",
        "1",
        "--plain-progress",
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"bulkinfer failed for {rows} rows:\n{proc.stderr[-3000:]}")
    report = orjson.loads((workdir / f"scale_{rows}.out.report.json").read_bytes())
    return {
        "rows": rows,
        "wall_s": wall,
        "seconds": report["seconds"],
        "peak_rss_bytes_bulkinfer": report["peak_rss_bytes"]["bulkinfer"],
        "peak_rss_bytes_engine": report["peak_rss_bytes"]["children"],
        "completed": report["request_counts"]["completed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            result = run_one(rows, Path(tmp))
            print(orjson.dumps(result).decode(), flush=True)
            results.append(result)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps({"machine": machine, "results": results}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
