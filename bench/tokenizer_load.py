"""The tokenizer's load in a fresh process, and ``bulkinfer plan`` (a command
that loads the tokenizer and no engine), in this checkout against the commit
``--base`` (checked out in a temporary git worktree), alternating.

Per process: the wall time from the shell, and for the load alone the
seconds inside the process from before ``bulkinfer.models`` is imported to
the tokenizer returned, and whether torch was imported. Run it on a machine
that loaded the default model before (prepared in ``BULKINFER_HOME``); this
checkout's first load there chooses the class and remembers it
(:mod:`bulkinfer.tokenizer_choice`), so one warm-up load of each checkout
runs before the timed rounds.

Usage: ``python -m bench.tokenizer_load --base REF [--rounds 3] [--out FILE]``;
writes ``bench/results/tokenizer-load.{json,md}`` by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.measure import run_measured, runs_doc, tail, write_doc

ROOT = Path(__file__).resolve().parents[1]
LOAD = (
    "import sys, time; t = time.perf_counter(); from bulkinfer.models import load_tokenizer, resolve_model; "
    "tokenizer = load_tokenizer(resolve_model(None)); "
    "print('LOAD', time.perf_counter() - t, 'torch' in sys.modules, type(tokenizer).__name__)"
)


def one(kind: str, root: Path, work: Path, key: str) -> dict[str, Any]:
    """One fresh process of ``kind`` (``load`` or ``plan``) run by the checkout at ``root``."""
    if kind == "load":
        cmd = [sys.executable, "-c", LOAD]
    else:
        cmd = [sys.executable, "-m", "bulkinfer", "plan", str(ROOT / "sample_data" / "sharegpt.jsonl")]
    log = work / f"{key}.log"
    measured = run_measured(cmd, log, env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    if measured.returncode != 0:
        raise SystemExit(f"{key} exited {measured.returncode}:\n{tail(log)}")
    run: dict[str, Any] = {"key": key, "kind": kind, "wall_s": round(measured.wall_s, 2)}
    if kind == "load":
        _, seconds, torch, cls = next(line for line in log.read_text().splitlines() if line.startswith("LOAD")).split()
        run |= {"load_s": round(float(seconds), 2), "torch_imported": torch == "True", "class": cls}
    return run


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# The tokenizer's load in a fresh process ({doc['created']}; {m['cpu']}"
        + (f" ({m['cpu_kind']})" if m.get("cpu_kind") else "")
        + f", {m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; alternating, after one warm-up of each checkout. Seconds. `load`: "
        "`load_tokenizer(resolve_model(None))` in `python -c` (inside: from the import of bulkinfer.models "
        "to the tokenizer); `plan`: `bulkinfer plan sample_data/sharegpt.jsonl` (no engine).",
        "",
        "| run | checkout | kind | inside | torch imported | wall |",
        "| --- | --- | --- | ---: | --- | ---: |",
    ]
    for r in doc["runs"]:
        inside = f"{r['load_s']:.2f}" if "load_s" in r else "-"
        torch = str(r.get("torch_imported", "-")).lower()
        lines.append(f"| {r['key']} | {r['checkout']} | {r['kind']} | {inside} | {torch} | {r['wall_s']:.2f} |")
    lines += ["", "Medians:", "", "| checkout | kind | inside | wall |", "| --- | --- | ---: | ---: |"]
    for median in doc["medians"]:
        inside = "-" if median["inside_s"] is None else f"{median['inside_s']:.2f}"
        lines.append(f"| {median['checkout']} | {median['kind']} | {inside} | {median['wall_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tokenizer-load.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-tokenizer-load-"))
    base = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True)
    checkouts = {f"base {args.base}": base, "this checkout": ROOT}
    try:
        for name, root in checkouts.items():
            one("load", root, work, f"warm-up {name}")
        runs = []
        for i in range(args.rounds):
            for kind in ("load", "plan"):
                for name, root in checkouts.items():
                    runs.append({**one(kind, root, work, f"{kind}{i + 1} {name.split()[0]}"), "checkout": name})
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    medians = []
    for name in checkouts:
        for kind in ("load", "plan"):
            mine = [r for r in runs if r["checkout"] == name and r["kind"] == kind]
            inside = [r["load_s"] for r in mine if "load_s" in r]
            medians.append(
                {
                    "checkout": name,
                    "kind": kind,
                    "inside_s": statistics.median(inside) if inside else None,
                    "wall_s": statistics.median(r["wall_s"] for r in mine),
                }
            )
    doc = {**runs_doc("bench.tokenizer_load", runs), "base": args.base, "rounds": args.rounds, "medians": medians}
    write_doc(args.out, doc, markdown)
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
