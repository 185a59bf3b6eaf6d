"""What glibc's malloc costs an engine step: raw vLLM ``LLM.generate`` of
``--rows`` ShareGPT prompts x ``--max-tokens`` (``ignore_eos``, greedy,
bfloat16, eager unless ``--compiled``, 6 GiB KV cache, in its caller's
process), one process per run, under each environment in turn. The minor
page faults and the user and system CPU seconds of the generate call come
from ``getrusage`` of the process. Variants (``--variants``):

- ``glibc``: ``GLIBC_TUNABLES`` unset (glibc's defaults; raw vLLM as it comes).
- ``bulkinfer``: the tunables the ``bulkinfer`` console script runs under
  (:data:`bulkinfer.engine.malloc.TUNABLES`: mmap threshold 32 MiB, trim
  threshold 256 MiB, top pad 64 MiB, transparent huge pages).
- ``thresholds``: the same without ``glibc.malloc.hugetlb``.
- ``hugetlb``: ``glibc.malloc.hugetlb=1`` alone.
- ``paused`` (``--first-touch`` only): ``bulkinfer``'s, the block
  allocated inside :func:`bulkinfer.engine.malloc.huge_pages_paused`, as an
  engine in bulkinfer's process allocates its KV cache at its start.

``--first-touch GIB``: instead of generating, each run (a fresh process)
times ``torch.zeros`` of GIB GiB of int8 (what vLLM's ``allocate_kv_cache``
does with the KV cache at the engine's start) and reads the process's
``AnonHugePages`` after it.

Usage: ``python -m bench.malloc [--rows 200 --max-tokens 256 --rounds 2
--variants glibc,bulkinfer,thresholds,hugetlb --compiled]`` or ``python -m
bench.malloc --first-touch 1.76 --variants bulkinfer,paused,thresholds``;
writes ``bench/results/malloc.{json,md}`` (``--out``). Run it alone on the
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.measure import runs_doc, write_doc
from bench.variants import sharegpt_prompts
from bulkinfer.engine.malloc import SWITCH, TUNABLES

ROOT = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "glibc": (),
    "bulkinfer": TUNABLES,
    "thresholds": tuple(t for t in TUNABLES if t[0] != "glibc.malloc.hugetlb"),
    "hugetlb": (("glibc.malloc.hugetlb", "1"),),
    "paused": TUNABLES,
}


# --first-touch: seconds between runs, for the memory a run freed to go back to the host first (Linux's
# page_reporting reports free blocks about 2 s after they are freed).
FREED_S = 5.0


def first_touch(gib: float, paused: bool) -> dict[str, Any]:
    """One block of ``gib`` GiB zeroed in this process: its seconds and the
    process's ``AnonHugePages`` (bytes) after it."""
    import torch

    from bulkinfer.engine.malloc import huge_pages_paused

    with huge_pages_paused(False if paused else None) as was_paused:
        started = time.monotonic()
        block = torch.zeros(int(gib * (1 << 30)), dtype=torch.int8)
        seconds = time.monotonic() - started
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    huge = next((int(line.split()[1]) << 10 for line in rollup if line.startswith("AnonHugePages:")), None)
    del block
    return {"gib": gib, "seconds": round(seconds, 3), "anon_huge_bytes": huge, "paused": was_paused}


def one(rows: int, max_tokens: int, compiled: bool) -> dict[str, Any]:
    """One run in this process: completion tokens, seconds, and the
    process's minor page faults and CPU seconds during ``generate``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from bulkinfer.models import resolve_model

    llm = LLM(
        model=resolve_model(None), dtype="bfloat16", enforce_eager=not compiled, kv_cache_memory_bytes=6 << 30, seed=0
    )
    prompts = sharegpt_prompts(rows)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    seconds, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "completion_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "seconds": round(seconds, 2),
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "system_s": round(after.ru_stime - before.ru_stime, 2),
    }


def environment(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", SWITCH)}
    tunables = ":".join(f"{name}={value}" for name, value in VARIANTS[variant])
    return {**env, **({"GLIBC_TUNABLES": tunables} if tunables else {}), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    touched = bool(doc["runs"]) and "gib" in doc["runs"][0]
    title = "A fresh block's first touch under glibc malloc tunables" if touched else "glibc malloc and an engine step"
    lines = [
        f"# {title} ({doc['created']}; {m.get('cpu')} {m.get('cpu_kind')}, {m.get('logical_cores')} cores)",
        "",
        f"Command: `{doc['command']}`.",
        "",
        (__doc__ or "").split("Usage:")[0].strip().replace("``", "`"),
        "",
    ]
    if touched:
        lines += ["| run | variant | GiB | seconds | AnonHugePages after, MiB |", "|--:|---|--:|--:|--:|"]
    else:
        lines += [
            "| run | variant | completion tok/s | seconds | minor page faults | user s | system s |",
            "|--:|---|--:|--:|--:|--:|--:|",
        ]
    for i, r in enumerate(doc["runs"], 1):
        if touched:
            huge = "" if r["anon_huge_bytes"] is None else f"{r['anon_huge_bytes'] / (1 << 20):,.0f}"
            lines.append(f"| {i} | {r['variant']} | {r['gib']} | {r['seconds']:.2f} | {huge} |")
            continue
        lines.append(
            f"| {i} | {r['variant']} | {r['completion_tokens'] / r['seconds']:.1f} | {r['seconds']:.1f} | "
            f"{r['minor_faults']:,} | {r['user_s']:.1f} | {r['system_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="glibc,bulkinfer,thresholds,hugetlb", help="comma-separated, in order")
    parser.add_argument("--compiled", action="store_true", help="vLLM compiles the model (default: eager)")
    parser.add_argument("--first-touch", type=float, metavar="GIB", help="time a fresh GIB GiB block instead")
    parser.add_argument("--paused", action="store_true", help=argparse.SUPPRESS)  # --first-touch: huge pages paused
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a run, in a child process
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "malloc.json")
    args = parser.parse_args()
    shape = ["--rows", str(args.rows), "--max-tokens", str(args.max_tokens), *(["--compiled"] if args.compiled else [])]
    if args.first_touch:
        shape = ["--first-touch", str(args.first_touch)]
    if args.one:
        touched = args.first_touch
        measured = first_touch(touched, args.paused) if touched else one(args.rows, args.max_tokens, args.compiled)
        print("RESULT " + json.dumps(measured), flush=True)
        return
    runs = []
    for i in range(args.rounds):
        order = args.variants.split(",")
        for variant in order if i % 2 == 0 else order[::-1]:
            paused = ["--paused"] if variant == "paused" else []
            if args.first_touch:  # the memory the last run freed goes back to the host (a VM's page reporting)
                time.sleep(FREED_S)
            cmd = [sys.executable, "-m", "bench.malloc", "--one", *shape, *paused]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=environment(variant))
            result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
            runs.append({"variant": variant, "round": i + 1, **json.loads(result[len("RESULT ") :])})
            print(runs[-1], file=sys.stderr, flush=True)
    write_doc(args.out, runs_doc("bench.malloc", runs), markdown)


if __name__ == "__main__":
    main()
