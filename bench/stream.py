"""Latency and throughput of ``bulkinfer run -`` fed at a fixed rate, for
several ``--max-wait`` values, against the same rows from a file.

For each ``--max-wait`` W: ``bulkinfer run - -o - --max-wait W`` starts; a
producer thread writes the rows to its standard input at ``--rate`` rows per
second (starting at once: rows written while the engine starts wait for it);
a consumer thread timestamps each result line as it arrives. A row's latency
is its result's arrival less its write. Reported: latency p50/p99 over all
rows and over the rows written after the first result arrived (the engine
warm), completion tokens/s over the stream's generate phase (from the
summary line on standard error) and the windows planned. The file run:
``bulkinfer run rows.jsonl -o out.jsonl`` with the same rows and settings,
its report's completion tokens/s. Every row must come back once.

Rows: the prompts of ``sample_data/sharegpt.jsonl`` cycled with a numbered
prefix to ``--rows`` rows, each with ``max_tokens`` ``--max-tokens``,
temperature 0. One engine at a time (two cores): the runs are sequential.

``python -m bench.stream --rows 300 --rate 2 --max-wait 0.1 1 5 --tag T``
writes ``bench/results/stream-T.{json,md}``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from bench.measure import bulkinfer_job, machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SUMMARY = re.compile(rb"stream ended: .*?([\d.]+) tok/s\), (\d+) windows")


def make_rows(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """``n`` rows from the ShareGPT sample's prompts, each distinct (a numbered prefix once cycled)."""
    prompts = [
        orjson.loads(line)["prompt"] for line in (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines()
    ]
    return [
        {"id": f"s{k}", "prompt": (f"{k // len(prompts)}. " if k >= len(prompts) else "") + prompts[k % len(prompts)],
         "max_tokens": max_tokens, "temperature": 0}
        for k in range(n)
    ]  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def stream_run(rows: list[dict[str, Any]], rate: float, max_wait: float) -> dict[str, Any]:
    """One ``bulkinfer run -`` fed at ``rate`` rows/s; latencies and figures."""
    cmd = [sys.executable, "-m", "bulkinfer", "run", "-", "--max-wait", str(max_wait), "--plain-progress"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    written: dict[str, float] = {}
    arrived: dict[str, float] = {}
    errors: list[bytes] = []
    stderr: list[bytes] = []
    started = time.monotonic()

    def produce() -> None:
        stdin = proc.stdin
        assert stdin is not None
        for k, row in enumerate(rows):
            time.sleep(max(0.0, started + k / rate - time.monotonic()))
            written[row["id"]] = time.monotonic()
            stdin.write(orjson.dumps(row) + b"\n")
            stdin.flush()
        stdin.close()

    def consume() -> None:
        stdout = proc.stdout
        assert stdout is not None
        for line in stdout:
            record = orjson.loads(line)
            if "error" in record and record.get("error"):
                errors.append(line)
            else:
                arrived[record["id"]] = time.monotonic()

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    threads.append(threading.Thread(target=lambda: stderr.append(proc.stderr.read())))  # type: ignore[union-attr]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    code = proc.wait()
    text = b"".join(stderr)
    if code != 0 or len(arrived) != len(rows) or errors:
        raise SystemExit(f"bulkinfer run - exited {code}, {len(arrived)}/{len(rows)} rows, {len(errors)} errors:\n"
                         f"{text[-3000:].decode(errors='replace')}")  # fmt: skip
    first = min(arrived.values())
    latency = [arrived[i] - written[i] for i in arrived]
    warm = [arrived[i] - written[i] for i in arrived if written[i] >= first]
    found = SUMMARY.search(text)
    return {
        "max_wait_s": max_wait,
        "latency_s": {"p50": percentile(latency, 50), "p99": percentile(latency, 99), "rows": len(latency)},
        "warm_latency_s": {
            "p50": percentile(warm, 50) if warm else None,
            "p99": percentile(warm, 99) if warm else None,
            "rows": len(warm),
        },
        "first_result_s": first - started,
        "completion_tokens_per_s": float(found.group(1)) if found else None,
        "windows": int(found.group(2)) if found else None,
        "wall_s": time.monotonic() - started,
        "summary": text.strip().splitlines()[-1].decode(errors="replace") if text.strip() else "",
    }


def file_run(rows: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """The same rows from a file: ``bulkinfer run``'s report."""
    src, out = work / "rows.jsonl", work / "out.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    args = ["run", str(src), "-o", str(out), "--plain-progress", "--overwrite"]
    measured, report = bulkinfer_job(args, work / "out.report.json", work / "file.log", ROOT)
    return {
        "completion_tokens_per_s": report["throughput"]["completion_tokens_per_s"],
        "wall_s": measured.wall_s,
        "seconds": report["seconds"],
    }


def render(doc: dict[str, Any]) -> str:
    """The Markdown summary of one bench run."""
    m = doc["machine"]
    where = f"{m['cpu']} ({m.get('cpu_kind', '')}), {m['logical_cores']} logical cores"
    head = (
        f"# bulkinfer run - (a stream) against --max-wait and a file\n\n{doc['rows']} ShareGPT prompts written at "
        f"{doc['rate']:g} rows/s, `max_tokens` {doc['max_tokens']}, temperature 0; {where}. `{doc['command']}`\n\n"
        "| run | latency p50 / p99 s (all rows) | warm p50 / p99 s | first result s | completion tok/s | windows |\n"
        "| --- | --: | --: | --: | --: | --: |"
    )
    lines = [head]
    for r in doc["streams"]:
        warm = r["warm_latency_s"]
        lines.append(
            f"| `--max-wait {r['max_wait_s']:g}` | {r['latency_s']['p50']:.1f} / {r['latency_s']['p99']:.1f} "
            f"| {warm['p50'] or 0:.1f} / {warm['p99'] or 0:.1f} ({warm['rows']} rows) | {r['first_result_s']:.1f} "
            f"| {r['completion_tokens_per_s'] or 0:.1f} | {r['windows']} |"
        )
    f = doc["file"]
    lines.append(f"| the same rows from a file | - | - | - | {f['completion_tokens_per_s']:.1f} | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--rate", type=float, default=2.0, help="rows written per second")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-wait", type=float, nargs="+", default=[0.1, 1.0, 5.0])
    parser.add_argument("--tag", default="default")
    args = parser.parse_args(argv)
    rows = make_rows(args.rows, args.max_tokens)
    streams = []
    for wait in args.max_wait:
        print(f"bench.stream: --max-wait {wait:g}", file=sys.stderr, flush=True)
        streams.append(stream_run(rows, args.rate, wait))
        print(f"  {streams[-1]['summary']}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        print("bench.stream: the file", file=sys.stderr, flush=True)
        baseline = file_run(rows, Path(tmp))
    command = " ".join(["python -m bench.stream", *(argv if argv is not None else sys.argv[1:])])
    doc = {
        "command": command,
        "rows": args.rows,
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "machine": machine(),
        "versions": versions(),
        "streams": streams,
        "file": baseline,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"stream-{args.tag}.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (RESULTS / f"stream-{args.tag}.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
