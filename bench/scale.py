"""Scale series: seconds and peak RSS of `bulkinfer run` for N short prompts with max_tokens 1.

Usage (from the repo root, after `make install`; ~25 min for the default sizes on 2 CPU cores):

    .venv/bin/python -m bench.scale                       # 1k, 10k, 100k rows -> bench/results/scale.json
    .venv/bin/python -m bench.scale --rows 1000 10000 --out /tmp/scale.json

Each size is a fresh `bulkinfer run` process (one engine start each) on rows of
4..16 random common words (seed 0), `--max-tokens 1`: the cost of reading,
tokenizing, planning, feeding and writing many rows, with as little generation
as vLLM allows (a prefill and one token per row).

Memory, per size: ``peak_rss_bytes_bulkinfer`` is the run's own report
(``getrusage(RUSAGE_SELF)``: the bulkinfer process alone, which holds the
reader, planner, spool and writer: the part that could grow with the file);
``peak_rss_tree_bytes`` samples the whole process tree (bulkinfer and any
engine processes of vLLM's; on CPU one engine runs in bulkinfer's own
process) with psutil every 0.5 s (:func:`bench.measure.run_measured`), so
it can miss the exact peak ``getrusage`` gives: neither bounds the other.
Where the engine runs in bulkinfer's process (``engine.in_process`` in the
report: on CPU by default) that peak includes its KV cache, which a run
sizes to its job's tokens up to the CPU default (1-8 GiB): so
``kv_cache_bytes`` (the report's ``engine.kv_cache_memory_bytes``) is
kept, and the peak less it (:func:`own_rss`) is what must not grow with
the file.

Growth, against the smallest size that is at least 10k rows (so that the
engine start does not dominate): ``rss_ratio`` = peak RSS / its peak RSS, and
``rss_less_kv_cache_ratio`` the same less the KV cache, and
``seconds_per_row_ratio`` = (generation seconds / row) / its value; linear
scaling is 1.0. The JSON file and its markdown page (same name, ``.md``) are
rewritten after every size.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench import measure

WORDS = "the of and to in is for on that with as by at from this be are it an or was".split()
BASELINE_MIN_ROWS = 10_000


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


def run_one(rows: int, workdir: Path) -> dict[str, Any]:
    """One ``bulkinfer run`` over ``rows`` generated rows; raises SystemExit on failure."""
    src = workdir / f"scale_{rows}.jsonl"
    write_rows(src, rows)
    out = workdir / f"scale_{rows}.out.jsonl"
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out)]
    cmd += ["--overwrite", "--max-tokens", "1", "--plain-progress", "--raw-prompts"]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    measured = measure.run_measured(cmd, workdir / f"scale_{rows}.log", env=env)
    if measured.returncode != 0:
        raise SystemExit(f"bulkinfer failed for {rows} rows:\n{measure.tail(workdir / f'scale_{rows}.log')}")
    report = orjson.loads((workdir / f"scale_{rows}.out.report.json").read_bytes())
    src.unlink()
    return {
        "rows": rows,
        "completed": report["request_counts"]["completed"],
        "prompt_tokens": report["tokens"]["prompt"],
        "completion_tokens": report["tokens"]["completion"],
        "wall_s": measured.wall_s,
        "seconds": report["seconds"],
        "generate_ms_per_row": 1000 * report["seconds"]["generate"] / rows,
        "peak_rss_bytes_bulkinfer": report["peak_rss_bytes"]["bulkinfer"],
        "kv_cache_bytes": report["engine"].get("kv_cache_memory_bytes"),
        "engine_in_process": report["engine"].get("in_process"),
        "peak_rss_tree_bytes": measured.peak_rss_bytes,
        "peak_rss_largest_process_bytes": measured.peak_rss_largest_process_bytes,
        "loadavg_before": list(measured.loadavg_before),
    }


def add_growth(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Ratios of each result to the baseline (see the module docstring); None without one."""
    base = next((r for r in sorted(results, key=lambda r: r["rows"]) if r["rows"] >= BASELINE_MIN_ROWS), None)
    if base is None:
        return None
    for r in results:
        r["growth"] = {
            "baseline_rows": base["rows"],
            "rows_ratio": r["rows"] / base["rows"],
            "rss_ratio": r["peak_rss_bytes_bulkinfer"] / base["peak_rss_bytes_bulkinfer"],
            "rss_less_kv_cache_ratio": own_rss(r) / own_rss(base),
            "seconds_per_row_ratio": r["generate_ms_per_row"] / base["generate_ms_per_row"],
            "total_seconds_ratio": r["seconds"]["total"] / base["seconds"]["total"],
        }
    return {"baseline_rows": base["rows"]}


def own_rss(result: dict[str, Any]) -> int:
    """The bulkinfer process's peak RSS less the KV cache when the engine ran
    in that process (bytes): the cache is sized to the job (its tokens,
    capped at the CPU default), so it grows with the file up to the cap,
    while what could grow without bound (reader, planner, spool, writer)
    should not."""
    kv = result.get("kv_cache_bytes") if result.get("engine_in_process") else None
    return int(result["peak_rss_bytes_bulkinfer"] - (kv or 0))


def render(doc: dict[str, Any]) -> str:
    """The markdown page of one scale series: machine, command and a row per size."""
    m, v = doc["machine"], doc["versions"]
    gpus = ", ".join(m["gpus"]) or "none"
    lines = [
        f"# bench.scale ({doc['created']})",
        "",
        f"- Machine: {m['cpu']}, {m['logical_cores']} logical / {m['physical_cores']} physical cores, "
        f"{m['memory_bytes'] / 2**30:.1f} GiB, GPU: {gpus}",
        f"- Versions: vllm {v['vllm']}, torch {v['torch']}, transformers {v['transformers']}, python {m['python']}",
        f"- Workload: {doc['workload']}",
        f"- Command: `{doc['command']}`",
        "",
        "| rows | total s | load s | plan s | generate s | ms per row (generate) | bulkinfer peak RSS MB "
        "| KV cache MB | less the KV cache MB | process tree peak RSS MB | RSS vs baseline | less the KV cache "
        "vs baseline | s/row vs baseline |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in doc["results"]:
        s, g = r["seconds"], r.get("growth")
        kv = r.get("kv_cache_bytes") if r.get("engine_in_process") else None
        own = f"{kv / 1e6:.0f} | {own_rss(r) / 1e6:.0f}" if kv else "— | —"
        ratios = "— | — | —"
        if g:
            less = g.get("rss_less_kv_cache_ratio")
            ratios = (
                f"{g['rss_ratio']:.2f}x | {f'{less:.2f}x' if kv and less else '—'} | {g['seconds_per_row_ratio']:.2f}x"
            )
        lines.append(
            f"| {r['rows']:,} | {s['total']:.1f} | {s['load']:.1f} | {s['plan']:.1f} | {s['generate']:.1f} "
            f"| {r['generate_ms_per_row']:.2f} | {r['peak_rss_bytes_bulkinfer'] / 1e6:.0f} | {own} "
            f"| {r['peak_rss_tree_bytes'] / 1e6:.0f} | {ratios} |"
        )
    if doc.get("growth"):
        lines += [
            "",
            f"Baseline: the {doc['growth']['baseline_rows']:,}-row run. Linear scaling = 1.00x seconds per row; "
            "the KV cache (in bulkinfer's process where the engine runs there) is sized to the job's tokens up to "
            "the CPU default, so the peak less it is what could grow with the file.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    args = parser.parse_args(argv)
    doc: dict[str, Any] = {
        "benchmark": "bench.scale",
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python", "-m", "bench.scale", *(sys.argv[1:] if argv is None else argv)]),
        "machine": measure.machine(),
        "versions": measure.versions(),
        "workload": "rows of 4..16 random common words (seed 0), bulkinfer run --max-tokens 1, default settings",
        "results": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            result = run_one(rows, Path(tmp))
            doc["results"].append(result)
            doc["growth"] = add_growth(doc["results"])
            args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
            args.out.with_suffix(".md").write_text(render(doc))
            print(
                f"[scale] {rows} rows: {result['wall_s']:.1f} s wall, {result['seconds']['generate']:.1f} s generate "
                f"({result['generate_ms_per_row']:.2f} ms/row), bulkinfer peak RSS "
                f"{result['peak_rss_bytes_bulkinfer'] / 1e6:.0f} MB, tree {result['peak_rss_tree_bytes'] / 1e6:.0f} MB",
                flush=True,
            )
    for r in doc["results"]:
        g = r.get("growth")
        if g:
            print(
                f"[scale] {r['rows']} rows vs {g['baseline_rows']}: RSS x{g['rss_ratio']:.2f}, "
                f"generation seconds per row x{g['seconds_per_row_ratio']:.2f}"
            )
    print(f"[scale] wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
