"""Start-up of a short stream, ``bulkinfer run - -o FILE``, by engine flags,
alternating: a stream has no job to size vLLM's KV cache to (a file run
sizes it to its tokens) and no generation time to weigh transparent huge
pages against, so it starts with vLLM's default CPU cache and huge pages
kept; ``--kv-cache-memory-bytes`` and ``--no-huge-pages-at-start`` shorten
the start at a cost (a cache short of the running rows preempts; 4 KiB
pages step ~2.8% slower: ``bulkinfer/jobs/engine_choice.py``).

Each run pipes the first ``--rows`` rows of ``sample_data/sharegpt.jsonl``
(``--max-tokens`` each, temperature 0) into a fresh ``bulkinfer run -`` and
reads its report: ``seconds.load`` (from the run's start to the engine
ready), ``generate``, and the process's wall time.

Usage: ``python -m bench.stream_start [--rows 20 --max-tokens 16 --rounds 2]
[--out FILE]``; writes ``bench/results/stream-start.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.measure import machine, versions

ROOT = Path(__file__).resolve().parents[1]
# variant -> the `bulkinfer run` flags it adds
VARIANTS: dict[str, list[str]] = {
    "defaults": [],
    "no huge pages at start": ["--no-huge-pages-at-start"],
    "1 GB KV cache": ["--kv-cache-memory-bytes", "1000000000"],
    "both": ["--no-huge-pages-at-start", "--kv-cache-memory-bytes", "1000000000"],
}


def one_run(rows: Path, work: Path, key: str, flags: list[str], max_tokens: int) -> dict[str, Any]:
    """One stream of ``rows`` through a fresh ``bulkinfer run -`` with ``flags``; its timings."""
    out = work / f"{key}.jsonl"
    cmd = [sys.executable, "-m", "bulkinfer", "run", "-", "-o", str(out), "--overwrite"]
    cmd += ["--max-tokens", str(max_tokens), "--temperature", "0", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    with open(rows, "rb") as stdin, open(work / f"{key}.stderr", "wb") as err:
        code = subprocess.run(cmd, stdin=stdin, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{key} exited with {code}: {(work / f'{key}.stderr').read_text()[-2000:]}")
    report = orjson.loads(out.with_name(f"{key}.report.json").read_bytes())
    return {"key": key, "wall_s": wall, "seconds": report["seconds"], "rows": report["request_counts"]["completed"]}


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# Start-up of a {doc['rows']}-row stream by engine flags ({doc['created']}; {m['cpu']}"
        + (f" ({m['cpu_kind']})" if m.get("cpu_kind") else "")
        + f", {m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; `bulkinfer run - -o FILE --max-tokens {doc['max_tokens']} --temperature 0` "
        "fed the rows on standard input, the variants alternating. Seconds: `load` from the run's start to the "
        "engine ready (the report's), `wall` the process's.",
        "",
        "| run | variant | flags | load | generate | wall |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        s = r["seconds"]
        flags = " ".join(VARIANTS[r["variant"]]) or "-"
        lines.append(
            f"| {r['key']} | {r['variant']} | `{flags}` | {s['load']:.1f} | {s['generate']:.1f} | {r['wall_s']:.1f} |"
        )
    lines += ["", "Means by variant:", "", "| variant | load | wall |", "| --- | ---: | ---: |"]
    for variant, mean in doc["means"].items():
        lines.append(f"| {variant} | {mean['load_s']:.1f} | {mean['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stream-start.json")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bulkinfer-stream-start-") as tmp:
        work = Path(tmp)
        rows = work / "rows.jsonl"
        lines = (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines()[: args.rows]
        rows.write_bytes(b"".join(line + b"\n" for line in lines))
        for round_ in range(1, args.rounds + 1):
            for index, (variant, flags) in enumerate(VARIANTS.items()):
                key = f"v{index}-{round_}"
                print(f"stream-start: {key} ({variant})", file=sys.stderr, flush=True)
                runs.append({**one_run(rows, work, key, flags, args.max_tokens), "variant": variant})
    means = {
        variant: {
            "load_s": statistics.mean(r["seconds"]["load"] for r in runs if r["variant"] == variant),
            "wall_s": statistics.mean(r["wall_s"] for r in runs if r["variant"] == variant),
        }
        for variant in VARIANTS
    }
    doc = {
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python -m bench.stream_start " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "versions": versions(),
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "means": means,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    args.out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
