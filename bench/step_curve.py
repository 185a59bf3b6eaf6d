"""What one decode step of vLLM's engine costs by the number of rows it
decodes and the context they attend over: the curve the ETA's step model
(:mod:`bulkinfer.report.step_cost`) approximates with a line,
``scale * (decoded + overhead_tokens + context_weight * context)``.

A designed experiment, not a fit to a job's steps (where every step of the
first 90% of a run decodes the same 256 rows, so the fixed cost and the
per-row cost cannot be told apart): for each batch size B and prompt length
P, B requests of P prompt tokens (fixed token ids), ``max_tokens`` 24 (48
for the long prompts, whose prefill takes more steps), ``ignore_eos``,
temperature 0, are added at once to one engine (vLLM's ``LLMEngine``, in
this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as bulkinfer runs one
CPU engine; the default model, float32 on CPU (``--dtype``), eager
(``--compiled``: vLLM's compiled model), vLLM's scheduler
defaults, 256 sequences); each ``step()`` is timed with ``time.perf_counter``. A pure
decode step is one after every request has at least 2 tokens and before
any has all of them: B rows decoded, nothing prefilled. Per point: the
median seconds of its pure decode steps.

Derived (in the results page): the cost of one more row, s (seconds per
decoded row: the slope between the two largest batches), and for every B
the fixed cost the step model's line would need there in decoded-token
equivalents (its ``overhead_tokens``: t_B / s - B; one figure for every B
if the line held); the context weight from the long prompts against the
short at the same B: (t_long - t_short) / (B x (P_long - P_short)) / s.

Usage: ``python -m bench.step_curve [--dtype D] [--compiled] [--tag T]``; writes
``bench/results/step-curve[-T].{json,md}``. One engine: a quiet machine, a
few minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

import orjson

from bench.measure import stamp, write_page

DType = Literal["float32", "bfloat16", "float16"]
ROOT = Path(__file__).resolve().parents[1]
SHORT, LONG = 16, 512
GRID = [(b, SHORT) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] + [(b, LONG) for b in (1, 2, 4, 8, 16, 32, 64)]


def build_engine(model: str, dtype: DType = "float32", compiled: bool = False, kv_cache_gib: int = 3) -> Any:
    """vLLM's ``LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    as bulkinfer runs one CPU engine) at ``dtype``, eager or (``compiled``)
    vLLM's compiled model, 256 sequences, a KV cache of ``kv_cache_gib`` GiB."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs, LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype=dtype,
            enforce_eager=not compiled,
            kv_cache_memory_bytes=kv_cache_gib << 30,
            max_num_seqs=256,  # vLLM's LLM class default and bulkinfer's; LLMEngine's own is 128 on CPU
            seed=0,
            disable_log_stats=True,
        )
    )


def measure_point(engine: Any, rows: int, prompt: int, generated: int, first_id: int) -> dict[str, Any]:
    """``rows`` requests of ``prompt`` fixed token ids (distinct from
    ``first_id`` on: no prefix-cache hits between points), ``generated``
    tokens each, ``ignore_eos``, temperature 0, added at once and stepped to
    the end; returns the point with its pure decode steps (every request at 2
    tokens or more and none done): their count, median and every one (seconds)."""
    from vllm import RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=generated, ignore_eos=True, temperature=0)
    for rid in range(first_id, first_id + rows):
        ids = [(1000 + 7 * (rid + j)) % 40000 + 100 for j in range(prompt)]
        engine.add_request(str(rid), TokensPrompt(prompt_token_ids=ids), params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        steps.append(
            (
                time.perf_counter() - start,
                [len(o.outputs[0].token_ids) for o in outputs if isinstance(o, RequestOutput)],
            )
        )
    decode = [s for s, n in steps if len(n) == rows and min(n) >= 2 and max(n) < generated]
    return {
        "rows": rows,
        "prompt_tokens": prompt,
        "steps": len(steps),
        "decode_steps": len(decode),
        "decode_step_s": statistics.median(decode) if decode else None,
        "decode_steps_s": decode,
    }


def measure(model: str, dtype: DType = "float32", compiled: bool = False) -> list[dict[str, Any]]:
    """The median pure-decode step (seconds) of each point of :data:`GRID`,
    the engine at ``dtype``, eager or (``compiled``) vLLM's compiled model."""
    engine = build_engine(model, dtype, compiled)
    points, rid = [], 0
    for rows, prompt in GRID:
        point = measure_point(engine, rows, prompt, 24 if prompt == SHORT else 48, rid)
        del point["decode_steps_s"]
        points.append(point)
        rid += rows
        print(orjson.dumps(points[-1]).decode(), file=sys.stderr, flush=True)
    return points


def derive(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The slope s (seconds per decoded row), the overhead each batch implies, the context weight (keyed by rows)."""
    short = {p["rows"]: p["decode_step_s"] for p in points if p["prompt_tokens"] == SHORT and p["decode_step_s"]}
    long = {p["rows"]: p["decode_step_s"] for p in points if p["prompt_tokens"] == LONG and p["decode_step_s"]}
    below, largest = sorted(short)[-2:]
    slope = (short[largest] - short[below]) / (largest - below)
    overhead = {str(b): t / slope - b for b, t in short.items()}
    context = {str(b): (long[b] - short[b]) / (b * (LONG - SHORT)) / slope for b in long if b in short}
    return {"slope_s": slope, "slope_rows": [below, largest], "overhead_tokens": overhead, "context_weight": context}


def render(doc: dict[str, Any]) -> str:
    """The results page."""
    m, d = doc["machine"], doc["derived"]
    doc = {"dtype": "float32", "compiled": False, **doc}  # recorded before --dtype and --compiled
    lines = [
        f"# One decode step by rows and context ({doc['date']}; {m['cpu']} ({m['cpu_kind']}), "
        f"{m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; vLLM {doc['versions']['vllm']}, the default model, {doc['dtype']}, "
        f"{'compiled' if doc['compiled'] else 'eager'}, "
        "one engine in this process. Seconds: the median of a point's pure decode steps.",
        "",
        "| rows | prompt tokens | decode steps | step s | ms per row | overhead it implies (tokens) | context weight |",
        "| --: | --: | --: | --: | --: | --: | --: |",
    ]
    for p in doc["points"]:
        t, b = p["decode_step_s"], p["rows"]
        if t is None:
            continue
        implied = d["overhead_tokens"].get(str(b)) if p["prompt_tokens"] == SHORT else None
        weight = d["context_weight"].get(str(b)) if p["prompt_tokens"] == LONG else None
        lines.append(
            f"| {b} | {p['prompt_tokens']} | {p['decode_steps']} | {t:.3f} | {1000 * t / b:.2f} "
            f"| {'-' if implied is None else f'{implied:.0f}'} | {'-' if weight is None else f'{weight:.4f}'} |"
        )
    lines += [
        "",
        f"One more decoded row (the slope between {d['slope_rows'][0]} and {d['slope_rows'][1]} rows): "
        f"{1000 * d['slope_s']:.2f} ms. Overhead: the fixed cost, in decoded-token equivalents, that a line "
        "of that slope needs to pass through the point (one figure for every row count if the step model's "
        "line held); context weight: per context token, in decoded-token equivalents (long prompts against "
        "short at the same rows).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled model (enforce_eager=False)")
    args = parser.parse_args()
    from bulkinfer.models import resolve_model

    points = measure(resolve_model(None), args.dtype, args.compiled)
    doc = {
        **stamp(),
        "command": "python -m bench.step_curve"
        + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
        + (" --compiled" if args.compiled else "")
        + (f" --tag {args.tag}" if args.tag else ""),
        "dtype": args.dtype,
        "compiled": args.compiled,
        "points": points,
        "derived": derive(points),
    }
    write_page(f"step-curve{'-' + args.tag if args.tag else ''}", doc, render)


if __name__ == "__main__":
    main()
