"""Compare bulkinfer with raw vLLM, vLLM run-batch and static transformers batches on one workload.

Usage (from the repo root, after `make install`; the full run takes roughly 30-40 min on 2 CPU cores):

    .venv/bin/python -m bench.compare --workload sharegpt --n 200
    .venv/bin/python -m bench.compare --workload fixed --n 200      # control: 128-token prompts, 64 tokens out
    .venv/bin/python -m bench.compare --workload fixed --n 4 --max-output 4 --hf-subset 4 --orders descending

Systems (``--systems``, letters or names), each in its own subprocess, in this order:

    b  vllm       raw vLLM LLM.generate, all prompts at once, arrival order (the reference)
    a  bulkinfer  `bulkinfer run`, once per --orders entry (arrival, ascending, descending)
    c  run-batch  vLLM's OpenAI batch runner on the same rows
    d  hf         transformers generate, static batches (B=16), arrival and length-bucketed,
                  on the first --hf-subset rows; compared with b on those rows (b-subset)

Every system gets the same rows, prompt tokens and per-row max_tokens, generates with
ignore_eos (so each produces the same completion tokens), the same model, dtype, seed
and sampling, and the vLLM ones the same engine arguments. Results:
bench/results/compare-<workload>-n<N>-<time>.json and .md. See bench/README.md.
The scale series (1k..100k rows, seconds and memory) is bench/scale.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench import measure, systems, table, workload

SYSTEM_NAMES = {"a": "a", "bulkinfer": "a", "b": "b", "vllm": "b", "c": "c", "run-batch": "c", "d": "d", "hf": "d"}
ORDERS = ("arrival", "ascending", "descending")
HF_ORDERS = ("arrival", "bucketed")
GiB = 1024**3

NOTES = [
    "Generation = bulkinfer's `seconds.generate` (first request in to last result out); for raw vLLM the "
    "`LLM.generate` call; for run-batch from endpoints ready to every response in (input reading, prompt "
    "rendering and tokenizing included, output writing not); for transformers the batch loop (tokenize, "
    "generate, decode), as vLLM's `hf` backend times it.",
    "End to end = wall time of the system's process from start to exit: interpreter, imports, model load, "
    "engine start, generation, writing, shutdown.",
    "Tokens are counted from what came back (bulkinfer's report, vLLM's outputs, run-batch's `usage`, "
    "the transformers output ids up to each row's max_tokens). Total = prompt + completion.",
    "Peak RSS is sampled every 0.5 s with psutil over the system's process tree: the sum over its processes "
    "(shared library pages counted once per process) / the largest single process.",
    "Padding efficiency: bulkinfer's plan reports what static batches of B would waste on prompts in arrival "
    "vs sorted order (vLLM itself does not pad); the static runs report the prompt positions and generated "
    "positions they really spent (real / padded).",
    "Ratio = completion tokens/s of the system / the reference's, for generation and end to end. The static "
    "baseline is compared with b-subset (raw vLLM on the same rows, in b's process after b's run, engine warm), "
    "and only for generation: its end-to-end time spreads model load over fewer rows.",
]


def parse_systems(text: str) -> list[str]:
    out: list[str] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item not in SYSTEM_NAMES:
            raise argparse.ArgumentTypeError(f"unknown system {item!r}; choose from {', '.join(SYSTEM_NAMES)}")
        if SYSTEM_NAMES[item] not in out:
            out.append(SYSTEM_NAMES[item])
    return out


def parse_orders(text: str) -> list[str]:
    orders = [o.strip() for o in text.split(",") if o.strip()]
    for o in orders:
        if o not in ORDERS:
            raise argparse.ArgumentTypeError(f"unknown order {o!r}; choose from {', '.join(ORDERS)}")
    return orders


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", choices=("sharegpt", "fixed"), default="sharegpt")
    p.add_argument("--n", type=int, default=200, help="rows (sharegpt: the first N of sample_data/sharegpt.jsonl)")
    p.add_argument("--systems", type=parse_systems, default=["a", "b", "c", "d"], help="e.g. a,b,c,d (default)")
    p.add_argument("--orders", type=parse_orders, default=list(ORDERS), help="bulkinfer --order values to run")
    p.add_argument("--hf-subset", type=int, default=32, help="rows for the static baseline: the first K (0: all)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-output", type=int, default=None, help="cap every row's max_tokens (tiny runs)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="vLLM kv_cache_memory_bytes, in GiB")
    p.add_argument("--seed", type=int, default=0, help="engine / torch seed (and the fixed workload's prompts)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--model", default=None, help="model directory (default: bulkinfer's default model)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--work-dir", type=Path, default=None, help="inputs, outputs and logs (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per system before it is killed")
    p.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the untimed import of vllm/torch/transformers"
    )
    return p


def describe_workload(args: argparse.Namespace, rows: Sequence[workload.Row]) -> dict[str, Any]:
    cap = f", capped at {args.max_output}" if args.max_output is not None else ""
    if args.workload == "sharegpt":
        text = (
            f"the first {len(rows)} rows of sample_data/sharegpt.jsonl (ShareGPT first turns through vLLM's filter: "
            "prompt 4..1024 tokens, prompt + reply <= 2048; shuffled with seed 0); max_tokens = the reply's "
            f"length in tokens, capped so prompt + output <= 2048{cap}"
        )
    else:
        text = (
            f"{len(rows)} prompts of {workload.FIXED_PROMPT_TOKENS} tokens (random common words, seed {args.seed}), "
            f"max_tokens {workload.FIXED_OUTPUT_TOKENS}{cap}"
        )
    k = len(rows) if args.hf_subset <= 0 else min(args.hf_subset, len(rows))
    subset = (
        f"all {k} rows" if k == len(rows) else f"the first {k} rows (compared with b-subset: raw vLLM on those rows)"
    )
    return {
        "name": args.workload,
        "n": args.n,
        "max_output": args.max_output,
        "description": text,
        "hf_subset": f"{subset}, batches of {args.hf_batch_size}, arrival order and sorted by prompt length",
        "hf_subset_rows": k,
        **workload.describe(rows),
    }


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each result's completion tokens/s over its reference's (``b`` or ``b-subset``)."""
    by_key = {r["key"]: r for r in results if "error" not in r}
    for r in results:
        ref = by_key.get(r.get("reference", ""))
        if "error" in r or ref is None:
            continue

        def ratio(kind: str, r: dict[str, Any] = r, ref: dict[str, Any] = ref) -> float | None:
            mine, theirs = r[kind], ref[kind]
            if not mine or not theirs:
                return None
            return float(mine["completion_tokens_per_s"] / theirs["completion_tokens_per_s"])

        r["ratio"] = {
            "reference": ref["key"],
            "generate": ratio("throughput_generate"),
            "end_to_end": ratio("throughput_end_to_end"),
        }


def run(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], bool]:
    """Run the chosen systems; return the results document and whether all succeeded."""
    from bulkinfer.models import resolve_model

    model = resolve_model(args.model)
    rows = workload.build(args.workload, workload.load_tokenizer(model), args.n, args.max_output, args.seed)
    hf_subset = args.hf_subset if 0 < args.hf_subset < len(rows) else 0
    settings = systems.BenchSettings(
        model=model,
        workdir=workdir,
        kv_cache_memory_bytes=int(args.kv_cache_gib * GiB),
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        hf_batch_size=args.hf_batch_size,
        hf_subset=hf_subset,
        timeout_s=args.timeout,
    )
    doc: dict[str, Any] = {
        "benchmark": "bench.compare",
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python", "-m", "bench.compare", *sys.argv[1:]]),
        "loadavg_before": list(os.getloadavg()),
        "machine": measure.machine(),
        "versions": measure.versions(),
        "settings": {
            "model": model,
            **settings.engine_args(),
            "temperature": args.temperature,
            "top_p": args.top_p,
            "ignore_eos": True,
            "hf_batch_size": args.hf_batch_size,
            "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"},
        },
        "workload": describe_workload(args, rows),
        "memory": f"psutil every {measure.SAMPLE_INTERVAL_S} s over each system's process tree: "
        "peak_rss_bytes = largest sum of RSS, peak_rss_largest_process_bytes = largest single process",
        "notes": NOTES,
        "results": [],
    }
    jobs: list[tuple[str, Any]] = []
    if "b" in args.systems:
        jobs.append(("b", lambda: systems.run_vllm_generate(rows, settings)))
    if "a" in args.systems:
        jobs += [(f"a-{o}", lambda o=o: systems.run_bulkinfer(rows, o, settings)) for o in args.orders]
    if "c" in args.systems:
        jobs.append(("c", lambda: systems.run_vllm_run_batch(rows, settings)))
    if "d" in args.systems:
        jobs += [(f"d-{o}", lambda o=o: systems.run_hf_static(rows, o, settings)) for o in HF_ORDERS]
    if args.warmup:
        # Untimed: read vLLM's, torch's and transformers' files into the page cache once, so that the
        # first system measured does not pay a cold disk the others do not.
        measured = measure.run_measured(
            [sys.executable, "-c", "import torch, transformers, vllm"], workdir / "warmup.log", env=settings.env()
        )
        doc["warmup_s"] = measured.wall_s
    ok = True
    for key, job in jobs:
        try:
            out = job()
        except Exception as exc:  # one failing system must not lose the others' measurements
            print(f"[bench] {key} failed: {exc}", file=sys.stderr, flush=True)
            doc["results"].append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
            ok = False
            continue
        doc["results"] += out if isinstance(out, list) else [out]
    add_ratios(doc["results"])
    doc["work_dir"] = str(workdir)
    return doc, ok


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.n < 1:
        raise SystemExit("--n must be >= 1")
    stem = f"compare-{args.workload}-n{args.n}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        doc, ok = run(args, args.work_dir.resolve())
    else:
        workdir = Path(tempfile.mkdtemp(prefix=f"{stem}-"))
        doc, ok = run(args, workdir)
        if ok:
            for path in sorted(workdir.iterdir()):
                path.unlink()
            workdir.rmdir()
            doc["work_dir"] = None
        else:
            print(f"[bench] logs kept in {workdir}", file=sys.stderr)
    json_path = args.out_dir / f"{stem}.json"
    md_path = args.out_dir / f"{stem}.md"
    json_path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    md_path.write_text(table.render(doc))
    print(md_path.read_text())
    print(f"[bench] wrote {json_path} and {md_path}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
