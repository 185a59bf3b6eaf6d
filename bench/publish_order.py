"""What restoring input order costs at publishing: peak memory and time of
:func:`bulkinfer.io.spool.publish_spool` for spools of growing size, in input
order (the external merge) and in completion order (one streaming pass).

Each case writes a spool of ``rows`` output records of about 230 bytes
each, their input lines shuffled (a seeded permutation: the completion
order of a length-sorted run is no more ordered than that); a fresh Python
process then publishes it to JSONL and reports the growth of its peak
resident memory (``VmHWM`` after publishing minus before) and the
publishing time. The merge's memory bound should not grow with
``rows`` (runs of :data:`~bulkinfer.io.spool.MERGE_RUN_ROWS` records).

Usage: ``python -m bench.publish_order [--rows 200000 1000000]``; writes
``bench/results/publish_order.{json,md}``. No engine: a few seconds per case.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]


def write_spool(path: Path, rows: int) -> int:
    """A spool of ``rows`` records of about 230 bytes, their input lines shuffled (seed 0); its size in bytes."""
    from bulkinfer.io.spool import Spool

    lines = list(range(1, rows + 1))
    random.Random(0).shuffle(lines)
    spool = Spool(path)
    for line in lines:
        spool.add(line, {"id": f"row-{line}", "completion": "x" * 150, "prompt_tokens": 30, "line": line})
    spool.close()
    return path.stat().st_size


def peak_rss_bytes() -> int:
    """This process's peak resident memory, ``VmHWM`` of ``/proc/self/status``
    (not ``ru_maxrss``: Linux carries that over ``exec`` from the forking
    parent, whose spool-writing peak would hide the child's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def one_case(spool_path: Path, order: str) -> dict[str, Any]:
    """Publish ``spool_path`` in ``order``, in this process (nothing else
    held in memory); seconds and the growth of the peak RSS."""
    import time

    from bulkinfer.io.spool import publish_spool

    out = spool_path.with_name("out.jsonl")
    before = peak_rss_bytes()
    started = time.monotonic()
    publish_spool(spool_path, out, order)  # type: ignore[arg-type]
    seconds = time.monotonic() - started
    after = peak_rss_bytes()
    with out.open("rb") as f:
        first = [orjson.loads(next(f))["line"] for _ in range(3)]
    out.unlink()
    return {"publish_s": round(seconds, 2), "peak_rss_growth_bytes": after - before, "first_lines": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "publish_order.json")
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # SPOOL ORDER: one case, in this process
    args = parser.parse_args()
    if args.case:
        print(orjson.dumps(one_case(Path(args.case[0]), args.case[1])).decode())
        return
    from bulkinfer.engine.args import cpu_model

    cases = []
    for rows in args.rows:
        for order in ("input", "completion"):
            with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
                spool = Path(tmp) / ".out.partial.jsonl"
                spool_bytes = write_spool(spool, rows)
                proc = subprocess.run(
                    [sys.executable, "-m", "bench.publish_order", "--case", str(spool), order],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                )
            case = {"rows": rows, "order": order, "spool_bytes": spool_bytes}
            cases.append(case | orjson.loads(proc.stdout.strip().splitlines()[-1]))
            print(cases[-1], flush=True)
    result: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.publish_order", *sys.argv[1:]]),
        "cases": cases,
    }
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    lines = [
        f"# Publishing in input order vs completion order ({result['date'][:10]}; {result['machine']['cpu']}, "
        f"{result['machine']['cores']} cores)",
        "",
        f"Command: `{result['command']}`",
        "",
        "| rows | order | spool MiB | publish s | peak RSS growth MiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        lines.append(
            f"| {case['rows']:,} | {case['order']} | {case['spool_bytes'] / 2**20:.0f} | {case['publish_s']} | "
            f"{case['peak_rss_growth_bytes'] / 2**20:.0f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
