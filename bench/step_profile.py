"""Where an engine step's time goes, raw vLLM against itself with one
thing added: ``LLM.generate`` of ``--rows`` ShareGPT prompts x
``--max-tokens`` (``ignore_eos``, greedy, bfloat16, eager, 2 GiB KV cache,
in its caller's process) under ``cProfile``, the cumulative seconds of
vLLM's per-step functions side by side. Variants (``--variants``):

- ``none``: vLLM as it comes.
- ``tail16``: bulkinfer's tail speculation config
  (:func:`bulkinfer.engine.args.tail_speculation`: drafts only at <= 16
  running rows, so a batch of 200 rows never gets one): what speculative
  decoding costs in steps that check no draft (K = 0).
- ``bulkinfer``: what bulkinfer adds to every CPU engine it generates with:
  its step hook (``worker_extension_cls``
  :data:`bulkinfer.engine.batch_order.EXTENSION`, installed and sorting)
  and its nucleus logits processor
  (:data:`bulkinfer.engine.args.NUCLEUS_PROCESSOR`), which greedy rows
  never use.

Usage: ``python -m bench.step_profile [--rows 200 --max-tokens 128 --rounds 1
--variants none,tail16,bulkinfer]``; writes
``bench/results/step-profile.{json,md}`` (``--out``). Each run is a process
of its own, one at a time, the variants in turn each round.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.measure import runs_doc, write_doc
from bench.variants import sharegpt_prompts

ROOT = Path(__file__).resolve().parents[1]

# vLLM 0.32 functions (file suffix, function name) whose cumulative seconds are compared.
FUNCTIONS = {
    "engine core step": ("v1/engine/core.py", "step"),
    "model forward": ("v1/worker/gpu_model_runner.py", "_model_forward"),
    "sample_tokens": ("v1/worker/gpu_model_runner.py", "sample_tokens"),
    "rejection sampler": ("v1/sample/rejection_sampler.py", "forward"),
    "sampler": ("v1/sample/sampler.py", "forward"),
    "n-gram propose": ("v1/spec_decode/ngram_proposer.py", "propose"),
    "_prepare_inputs": ("v1/worker/gpu_model_runner.py", "_prepare_inputs"),
    "bulkinfer's step hook": ("bulkinfer/engine/batch_order.py", "reorder"),
    "logits processors": ("v1/sample/sampler.py", "apply_logits_processors"),
    "scheduler.schedule": ("v1/core/sched/scheduler.py", "schedule"),
}


def one(variant: str, rows: int, max_tokens: int) -> dict[str, Any]:
    """One variant in this process: its completion tokens, seconds and the
    :data:`FUNCTIONS`' cumulative seconds and calls."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from bulkinfer.engine.args import NUCLEUS_PROCESSOR, tail_speculation
    from bulkinfer.engine.batch_order import EXTENSION
    from bulkinfer.models import resolve_model

    kw: dict[str, Any] = {"dtype": "bfloat16", "enforce_eager": True, "kv_cache_memory_bytes": 2 << 30, "seed": 0}
    if variant == "tail16":
        kw["speculative_config"] = tail_speculation(16)
    if variant == "bulkinfer":
        kw |= {"worker_extension_cls": EXTENSION, "logits_processors": [NUCLEUS_PROCESSOR]}
    llm = LLM(model=resolve_model(None), **kw)
    if variant == "bulkinfer":
        assert all(llm.collective_rpc("bulkinfer_batch_order_install", args=(True,)))
    prompts = sharegpt_prompts(rows)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    profile = cProfile.Profile()
    started = time.monotonic()
    profile.enable()
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    profile.disable()
    seconds = time.monotonic() - started
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    found: dict[str, dict[str, float]] = {}
    for (path, _, name), (_, calls, _, cumulative, _) in stats.items():
        for label, (suffix, function) in FUNCTIONS.items():
            if name == function and path.endswith(suffix):
                found[label] = {"seconds": round(cumulative, 3), "calls": calls}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"variant": variant, "completion_tokens": tokens, "seconds": round(seconds, 2), "functions": found}


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    runs = doc["runs"]
    lines = [
        f"# Where an engine step's time goes ({doc['created']}; "
        f"{m.get('cpu')} {m.get('cpu_kind')}, {m.get('logical_cores')} cores)",
        "",
        f"Command: `{doc['command']}`.",
        "",
        (__doc__ or "").split("Usage:")[0].strip().replace("``", "`"),
        "",
        "| | " + " | ".join(f"{r['variant']} ({r['round']})" for r in runs) + " |",
        "|---|" + "--:|" * len(runs),
        "| completion tok/s (profiled) | "
        + " | ".join(f"{r['completion_tokens'] / r['seconds']:.1f}" for r in runs)
        + " |",
    ]
    for label in FUNCTIONS:
        cells = [r["functions"].get(label) for r in runs]
        lines.append(
            f"| {label} s (calls) | "
            + " | ".join(f"{c['seconds']:.2f} ({c['calls']})" if c else "—" for c in cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default="none,tail16,bulkinfer", help="comma-separated, in order")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant, in a child process
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "step-profile.json")
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.rows, args.max_tokens)), flush=True)
        return
    runs = []
    for i in range(args.rounds):
        for variant in args.variants.split(","):
            cmd = [sys.executable, "-m", "bench.step_profile", "--one", variant]
            cmd += ["--rows", str(args.rows), "--max-tokens", str(args.max_tokens)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
            result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
            runs.append({**json.loads(result[len("RESULT ") :]), "round": i + 1})
            print(runs[-1], file=sys.stderr, flush=True)
    write_doc(args.out, runs_doc("bench.step_profile", runs), markdown)


if __name__ == "__main__":
    main()
