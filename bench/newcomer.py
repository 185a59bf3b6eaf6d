"""A newcomer's first run: ``bulkinfer run`` with no flags on 100 real
ShareGPT prompts that are not in ``sample_data/`` (``bench/data/newcomer100.jsonl``,
built by ``bench/newcomer_data.py``). Counts the empty completions (target:
at most 3) and the finish reasons, and keeps three answers to read.

Usage: ``python -m bench.newcomer [--out bench/results/newcomer100.json]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import orjson

from bulkinfer.engine.args import cpu_model

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data" / "newcomer100.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "newcomer100.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "newcomer100.out.jsonl"
        cmd = [sys.executable, "-m", "bulkinfer", "run", str(DATA), "-o", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        rows = [orjson.loads(line) for line in out.read_bytes().splitlines()] if out.exists() else []
        report = orjson.loads(out.with_name("newcomer100.out.report.json").read_bytes())
    empty = [row["id"] for row in rows if not row["completion"].strip()]
    result = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": "bulkinfer run bench/data/newcomer100.jsonl (no other flags)",
        "exit_code": proc.returncode,
        "rows": len(rows),
        "empty_completions": len(empty),
        "empty_ids": empty,
        "finish_reasons": dict(Counter(row["finish_reason"] for row in rows)),
        "chat_template_applied": report["chat_template_applied"],
        "sampling": report["sampling"],
        "examples": [{"id": row["id"], "completion": row["completion"][:400]} for row in rows[:3]],
        "stderr_lines": proc.stderr.splitlines()[-5:],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps({k: v for k, v in result.items() if k != "examples"}, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
