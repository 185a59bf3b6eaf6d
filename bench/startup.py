"""Start-up of a small job: vLLM's engine in bulkinfer's process (the default
for one CPU engine) against vLLM's own layout (engine core and worker in
child processes, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), alternating.

Each run is ``bulkinfer run`` as a user runs it (its own dtype choice, KV cache
sized to the job) on the first ``--rows`` rows of ``sample_data/sharegpt.jsonl``
(or of ``--input FILE``) with ``--max-tokens`` tokens each, on a machine that ran the model before
(the dtype probe is stored: run ``bulkinfer calibrate`` or one job first).
Per run: the report's ``seconds.start`` (tokenizer, engine choice, engine
start, first token: from the run's start), ``load``, ``generate``, ``total``;
the process's wall time, and ``wall - total`` (interpreter, imports and the
command line before the run; summary and exit after it).

``--base REF`` compares this checkout with the commit REF instead (both in
bulkinfer's process, alternating; REF checked out in a temporary git
worktree): a change to the start or the exit, measured side by side.
``--cold-inductor-cache`` gives each run an empty ``TORCHINDUCTOR_CACHE_DIR``
of its own: what a run compiles costs it as on a machine's first run.

Usage: ``python -m bench.startup [--rows 300 --max-tokens 16 --rounds 2]
[--base REF] [--flags "-dp 2"] [--cold-inductor-cache] [--input FILE] [--out FILE]``;
writes ``bench/results/startup.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.measure import machine, run_measured, tail, versions

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "in-process": {},  # bulkinfer's default for one CPU engine
    "processes": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},  # vLLM's default layout
}


def one_run(
    src: Path, work: Path, key: str, env: dict[str, str], max_tokens: int, root: Path = ROOT, flags: Sequence[str] = ()
) -> dict[str, Any]:
    """One ``bulkinfer run`` of ``src`` (with ``flags``) by the checkout at ``root``; its timings."""
    import os

    out = work / f"{key}.jsonl"
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--overwrite", "--plain-progress"]
    cmd += ["--max-tokens", str(max_tokens), "--temperature", "0", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root), **env}
    measured = run_measured(cmd, work / f"{key}.log", env=env, cwd=root)
    if measured.returncode != 0:
        raise SystemExit(f"{key} exited with {measured.returncode}:\n{tail(work / f'{key}.log')}")
    report = orjson.loads(out.with_name(f"{key}.report.json").read_bytes())
    seconds = report["seconds"]
    return {
        "key": key,
        "wall_s": measured.wall_s,
        "outside_run_s": measured.wall_s - seconds["total"],
        "seconds": seconds,
        "engine": {
            k: report["engine"].get(k) for k in ("dtype", "in_process", "kv_cache_memory_bytes", "data_parallel_size")
        },
        "cpu_s": measured.cpu_s,
        "completion_tokens": report["tokens"]["completion"],
    }


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# Start-up of a {doc['rows']}-row job ({doc['created']}; {m['cpu']}"
        + (f" ({m['cpu_kind']})" if m.get("cpu_kind") else "")
        + f", {m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; `bulkinfer run` at its defaults, `--max-tokens {doc['max_tokens']}`"
        + "".join(f" `{flag}`" for flag in doc.get("flags", ()))
        + (", each run with an empty `TORCHINDUCTOR_CACHE_DIR`" if doc.get("cold_inductor_cache") else "")
        + ", "
        "alternating. Seconds; `first token` from the run's start; `outside` = wall - the report's total "
        "(interpreter, imports, command line; summary, exit).",
        "",
        "| run | layout | dtype | tokenizer | engine choice | engine start | load | first token | generate | total "
        "| outside | wall |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        s, st = r["seconds"], r["seconds"]["start"]
        lines.append(
            f"| {r['key']} | {r['layout']} | {r['engine']['dtype']} | {st['tokenizer']:.1f} "
            f"| {st['engine_choice']:.1f} | {st['engine']:.1f} | {s['load']:.1f} | {st['first_token']:.1f} "
            f"| {s['generate']:.1f} "
            f"| {s['total']:.1f} | {r['outside_run_s']:.1f} | {r['wall_s']:.1f} |"
        )
    lines += [
        "",
        "Means by layout:",
        "",
        "| layout | engine start | first token | outside | wall |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for layout, mean in doc["means"].items():
        outside = mean.get("outside_s")
        lines.append(
            f"| {layout} | {mean['engine_s']:.1f} | {mean['first_token_s']:.1f} "
            f"| {'-' if outside is None else f'{outside:.1f}'} | {mean['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup.json")
    parser.add_argument("--base", help="a commit to compare this checkout with (both in bulkinfer's process)")
    parser.add_argument("--flags", default="", help='more `bulkinfer run` flags for every run, e.g. "-dp 2"')
    parser.add_argument("--input", type=Path, default=ROOT / "sample_data" / "sharegpt.jsonl", help="JSONL rows")
    parser.add_argument(
        "--cold-inductor-cache", action="store_true", help="each run an empty TORCHINDUCTOR_CACHE_DIR of its own"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    layouts: dict[str, tuple[dict[str, str], Path]] = {name: (env, ROOT) for name, env in LAYOUTS.items()}
    if args.base:
        base = work / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True)
        layouts = {f"base {args.base}": ({}, base), "this checkout": ({}, ROOT)}
    src = work / "in.jsonl"
    with open(args.input, "rb") as f:
        src.write_bytes(b"".join(line for _, line in zip(range(args.rows), f, strict=False)))
    flags = shlex.split(args.flags)
    runs = []
    for i in range(1, args.rounds + 1):
        for layout, (env, root) in layouts.items():
            key = f"{layout.split()[0]}-{i}"
            print(f"[bench.startup] {key}", file=sys.stderr, flush=True)
            if args.cold_inductor_cache:
                env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{key}")}
            runs.append({**one_run(src, work, key, env, args.max_tokens, root, flags), "layout": layout})
    if args.base:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "base")], check=True)
    means = {
        layout: {
            "engine_s": statistics.mean(r["seconds"]["start"]["engine"] for r in runs if r["layout"] == layout),
            "first_token_s": statistics.mean(
                r["seconds"]["start"]["first_token"] for r in runs if r["layout"] == layout
            ),
            "wall_s": statistics.mean(r["wall_s"] for r in runs if r["layout"] == layout),
            "outside_s": statistics.mean(r["outside_run_s"] for r in runs if r["layout"] == layout),
        }
        for layout in layouts
    }
    doc = {
        "benchmark": "bench.startup",
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "-m", "bench.startup", *sys.argv[1:]]),
        "machine": machine(),
        "versions": versions(),
        "rows": args.rows,
        "input": os.path.relpath(args.input, ROOT),
        "max_tokens": args.max_tokens,
        "flags": flags,
        "cold_inductor_cache": args.cold_inductor_cache,
        "runs": runs,
        "means": means,
    }
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    text = markdown(doc)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
