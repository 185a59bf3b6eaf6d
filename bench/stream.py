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

``--max-chars N`` keeps the prompts of at most N characters (short prompts:
a decode-bound stream; the ShareGPT prompts' prefill dominates on a CPU).

``--duration S`` (memory over a long stream): the rows repeat (fresh ids)
for S seconds at ``--rate``, one stream per ``--max-wait``; the process
tree's resident memory (psutil, the sum over bulkinfer's processes) is
sampled every ``RSS_INTERVAL_S`` seconds and the result must still hold
every row once. No file run.

``python -m bench.stream --rows 300 --rate 2 --max-wait 0.1 1 5 --tag T``
writes ``bench/results/stream-T.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil

from bench.measure import bulkinfer_job, machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SUMMARY = re.compile(rb"stream ended: .*?([\d.]+) tok/s\), (\d+) windows")
RSS_INTERVAL_S = 10.0


def endless_rows(max_tokens: int, max_chars: int | None = None) -> Iterator[dict[str, Any]]:
    """Rows from the ShareGPT sample's prompts (those of at most ``max_chars``
    characters), cycled without end, each distinct (a numbered prefix once cycled)."""
    prompts = [
        orjson.loads(line)["prompt"] for line in (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines()
    ]
    prompts = [p for p in prompts if max_chars is None or len(p) <= max_chars]
    for k in itertools.count():
        prefix = f"{k // len(prompts)}. " if k >= len(prompts) else ""
        yield {"id": f"s{k}", "prompt": prefix + prompts[k % len(prompts)], "max_tokens": max_tokens, "temperature": 0}


def make_rows(n: int, max_tokens: int, max_chars: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` rows of :func:`endless_rows`."""
    return list(itertools.islice(endless_rows(max_tokens, max_chars), n))


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and its descendants (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def stream_run(
    rows: Iterator[dict[str, Any]] | list[dict[str, Any]],
    rate: float,
    max_wait: float,
    duration: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One ``bulkinfer run -`` fed ``rows`` at ``rate`` rows/s (for ``duration``
    seconds at most; ``env`` added to its environment); latencies, figures and the RSS samples."""
    cmd = [sys.executable, "-m", "bulkinfer", "run", "-", "--max-wait", str(max_wait), "--plain-progress"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    written: dict[str, float] = {}
    arrived: dict[str, float] = {}
    errors: list[bytes] = []
    stderr: list[bytes] = []
    rss: list[tuple[float, int]] = []
    started = time.monotonic()
    ended = threading.Event()

    def produce() -> None:
        stdin = proc.stdin
        assert stdin is not None
        for k, row in enumerate(rows):
            time.sleep(max(0.0, started + k / rate - time.monotonic()))
            if duration is not None and time.monotonic() - started >= duration:
                break
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

    def sample() -> None:
        while not ended.wait(RSS_INTERVAL_S):
            rss.append((round(time.monotonic() - started, 1), tree_rss(proc.pid)))

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    threads.append(threading.Thread(target=lambda: stderr.append(proc.stderr.read())))  # type: ignore[union-attr]
    for thread in threads:
        thread.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for thread in threads:
        thread.join()
    code = proc.wait()
    ended.set()
    text = b"".join(stderr)
    if code != 0 or arrived.keys() != written.keys() or errors:
        raise SystemExit(f"bulkinfer run - exited {code}, {len(arrived)}/{len(written)} rows, {len(errors)} errors:\n"
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
        "rows": len(arrived),
        "rss_bytes": rss,
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
    source = f"{doc['rows']} ShareGPT prompts" if doc.get("duration_s") is None else (
        f"ShareGPT prompts repeated (fresh ids) for {doc['duration_s']:g} s")  # fmt: skip
    if doc.get("max_chars"):
        source += f" (those of at most {doc['max_chars']} characters)"
    heaps = {
        "flat": "; the stream's heap fixed (bulkinfer/engine/heap.py)",
        "glibc": "; glibc's own heap",
        "arenas": "; the default heap, glibc's arenas capped (bulkinfer/engine/heap.py)",
    }
    heap = heaps.get(doc.get("heap", ""), "")
    head = (
        f"# bulkinfer run - (a stream) against --max-wait and a file\n\n{source} written at "
        f"{doc['rate']:g} rows/s, `max_tokens` {doc['max_tokens']}, temperature 0; {where}{heap}. "
        f"`{doc['command']}`\n\n"
        "| run | rows | latency p50 / p99 s (all rows) | warm p50 / p99 s | first result s | completion tok/s "
        "| windows |\n"
        "| --- | --: | --: | --: | --: | --: | --: |"
    )
    lines = [head]
    for r in doc["streams"]:
        warm = r["warm_latency_s"]
        lines.append(
            f"| `--max-wait {r['max_wait_s']:g}` | {r['rows']} | {r['latency_s']['p50']:.1f} / "
            f"{r['latency_s']['p99']:.1f} | {warm['p50'] or 0:.1f} / {warm['p99'] or 0:.1f} ({warm['rows']} rows) "
            f"| {r['first_result_s']:.1f} | {r['completion_tokens_per_s'] or 0:.1f} | {r['windows']} |"
        )
    if doc.get("file") is not None:
        f = doc["file"]
        rate = f["completion_tokens_per_s"]
        lines.append(f"| the same rows from a file | {doc['rows']} | - | - | - | {rate:.1f} | - |")
    for r in doc["streams"]:
        if doc.get("duration_s") is not None and r["rss_bytes"]:
            lines.append(f"\nResident memory of bulkinfer's process tree, `--max-wait {r['max_wait_s']:g}` "
                         f"(psutil every {RSS_INTERVAL_S:g} s; MiB at each 5 minutes):\n")  # fmt: skip
            minutes = range(5, int(r["wall_s"] // 60) + 1, 5)
            lines.append("| minute | " + " | ".join(str(t) for t in minutes) + " | max |")
            samples = r["rss_bytes"]
            marks = [next((b for t, b in samples if t >= 60 * t_min), samples[-1][1]) for t_min in minutes]
            lines.append("| --- |" + " --: |" * (len(marks) + 1))
            peak = max(b for _, b in r["rss_bytes"])
            lines.append("| MiB | " + " | ".join(f"{b / 2**20:.0f}" for b in marks) + f" | {peak / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--rate", type=float, default=2.0, help="rows written per second")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=None, help="only prompts of at most this many characters")
    parser.add_argument("--max-wait", type=float, nargs="+", default=[0.1, 1.0, 5.0])
    parser.add_argument("--duration", type=float, default=None, help="seconds of a repeating source (no file run)")
    parser.add_argument("--tag", default="default")
    parser.add_argument(
        "--heap",
        choices=("arenas", "flat", "glibc"),
        default="arenas",
        help="BULKINFER_HEAP for the stream (bulkinfer/engine/heap.py; arenas is the default)",
    )
    parser.add_argument("--no-file", action="store_true", help="no run of the same rows from a file")
    args = parser.parse_args(argv)
    env = {"BULKINFER_HEAP": args.heap}
    streams = []
    for wait in args.max_wait:
        print(f"bench.stream: --max-wait {wait:g}", file=sys.stderr, flush=True)
        if args.duration is not None:
            rows = endless_rows(args.max_tokens, args.max_chars)
            streams.append(stream_run(rows, args.rate, wait, args.duration, env))
        else:
            streams.append(stream_run(make_rows(args.rows, args.max_tokens, args.max_chars), args.rate, wait, env=env))
        print(f"  {streams[-1]['summary']}", file=sys.stderr, flush=True)
    baseline = None
    if args.duration is None and not args.no_file:
        with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
            print("bench.stream: the file", file=sys.stderr, flush=True)
            baseline = file_run(make_rows(args.rows, args.max_tokens, args.max_chars), Path(tmp))
    command = " ".join(["python -m bench.stream", *(argv if argv is not None else sys.argv[1:])])
    doc = {
        "command": command,
        "rows": args.rows if args.duration is None else None,
        "duration_s": args.duration,
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "max_chars": args.max_chars,
        "heap": args.heap,
        "malloc_arena_max_env": os.environ.get("MALLOC_ARENA_MAX"),  # the user's own, which stands over the heap's
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
