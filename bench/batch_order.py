"""Raw vLLM ``LLM.generate`` on one workload with the running batch in
vLLM's own order and in KV-block order (bulkinfer's
:mod:`bulkinfer.engine.batch_order`, installed with ``collective_rpc``),
alternating (ABBA), each run an engine of its own in a child process.

The same engine otherwise (the default model, ``--dtype``, eager, a 6 GiB
KV cache, the engine in the caller's process as bulkinfer runs it, all rows
at once in the workload's order, ``ignore_eos``, temperature 0). Per run:
load and generate seconds, generation completion tokens/s, prompt tokens
from the prefix cache, the rows moved (``swaps``) and seconds spent sorting,
and how many rows' first 64 completion tokens equal the first run's.

Usage: ``python -m bench.batch_order [--workload shared-prefix --n 200
--rounds 2 --dtype bfloat16 --tag T]``; writes
``bench/results/batch-order-{workload}[-T].{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.measure import stamp, write_page

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("vllm", "kv-blocks")
COMPARED_TOKENS = 64


def child(variant: str, rows_path: Path, out: Path, model: str, dtype: Any) -> None:
    """One run (in its own process: ``python -m bench.batch_order --child ...``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.workload import read_token_rows
    from bulkinfer.engine import batch_order

    rows = read_token_rows(rows_path)
    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=6 << 30, seed=0)
    if variant == "kv-blocks":
        assert all(llm.llm_engine.collective_rpc(batch_order.install))
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in rows]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.max_tokens) for r in rows]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    tallies = llm.llm_engine.collective_rpc(batch_order.tally)
    result = {
        "variant": variant,
        "load_s": load_s,
        "generate_s": generate_s,
        "completion_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
        "sorting": tallies[0],
        "heads": [list(o.outputs[0].token_ids[:COMPARED_TOKENS]) for o in outputs],
    }
    out.write_bytes(orjson.dumps(result))
    os._exit(0)  # the engine's teardown is not measured


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# The running batch in vLLM's order and in KV-block order ({doc['date']}; {m['cpu']} "
        f"({m['cpu_kind']}), {m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; raw vLLM {doc['versions']['vllm']} `LLM.generate`, {doc['dtype']}, eager, "
        f"6 GiB KV cache, the engine in the caller's process, each run in a process of its own, ABBA. "
        f"Workload: {doc['workload']['name']}, {doc['workload']['rows']} rows, "
        f"{doc['workload']['prompt_tokens']} prompt tokens, {doc['workload']['completion_tokens']} completion tokens.",
        "",
        "| round | batch order | load s | generate s | gen. completion tok/s | prompt tokens from the prefix cache "
        f"| rows moved (sorting s) | rows whose first {COMPARED_TOKENS} tokens equal run 1's |",
        "| --: | --- | --: | --: | --: | --: | --: | --: |",
    ]
    for r in doc["runs"]:
        sorting = r["sorting"]
        moved = "-" if sorting is None else f"{sorting['swaps']} ({sorting['seconds']:.2f})"
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['load_s']:.1f} | {r['generate_s']:.1f} "
            f"| {r['tok_s']:.1f} | {r['cached_tokens']} | {moved} | {r['same_as_first']} |"
        )
    means = {v: statistics.fmean(r["tok_s"] for r in doc["runs"] if r["variant"] == v) for v in VARIANTS}
    lines += [
        "",
        f"Means: vLLM's order {means['vllm']:.1f}, KV-block order {means['kv-blocks']:.1f} completion tokens/s "
        f"({means['kv-blocks'] / means['vllm']:.2f}x).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="shared-prefix")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=str(Path.home() / ".cache/bulkinfer/models/smollm2-135m-instruct"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "ROWS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]), args.model, args.dtype)
        return

    from bench import workload

    rows = workload.build(args.workload, workload.load_tokenizer(args.model), args.n)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-order-"))
    workload.write_token_rows(rows, work / "rows.jsonl")
    runs: list[dict[str, Any]] = []
    first: list[list[int]] | None = None
    for i in range(args.rounds):
        for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            out = work / f"{variant}-{i}.json"
            cmd = [sys.executable, "-m", "bench.batch_order", "--model", args.model, "--dtype", args.dtype]
            subprocess.run([*cmd, "--child", variant, str(work / "rows.jsonl"), str(out)], cwd=ROOT, check=True)
            run = orjson.loads(out.read_bytes())
            heads = run.pop("heads")
            first = first or heads
            run.update(
                round=i + 1,
                tok_s=run["completion_tokens"] / run["generate_s"],
                same_as_first=sum(a == b for a, b in zip(first, heads, strict=True)),
            )
            runs.append(run)
            print(orjson.dumps(run).decode(), file=sys.stderr, flush=True)
    doc = {
        **stamp(),
        "command": " ".join(["python", "-m", "bench.batch_order", *sys.argv[1:]]),
        "dtype": args.dtype,
        "workload": {"name": args.workload, **workload.describe(rows)},
        "runs": runs,
    }
    write_page(f"batch-order-{args.workload}" + (f"-{args.tag}" if args.tag else ""), doc, render)


if __name__ == "__main__":
    main()
