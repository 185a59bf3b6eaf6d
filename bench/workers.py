"""Subprocess entry points for the systems that `bench.compare` drives in-process code for.

    python -m bench.workers vllm-generate --rows R.jsonl --out RES.json --model DIR --engine-args JSON \
        [--subset-rows S.jsonl]
    python -m bench.workers hf-static --rows R.jsonl --out RES.json --model DIR --order {arrival,bucketed}
    python -m bench.workers run-batch --timing RES.json -- <run_batch arguments>

Each writes a JSON result: seconds (``load``, ``generate``) and token counts
taken from what came back. One engine or model per process; vLLM, torch and
transformers are imported only inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.workload import Row, padding_efficiency, read_token_rows, static_batches
from bulkinfer.engine.starts import engine_start
from bulkinfer.report import threads

# The name of a worker's own process in its CPU by thread (bulkinfer.report.threads.snapshot).
RAW = "raw vLLM"


def _write(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2))


def _vllm_generate_once(llm: Any, rows: Sequence[Row], temperature: float, top_p: float) -> dict[str, Any]:
    """All ``rows`` in one ``LLM.generate`` call, in the given order, as
    ``vllm bench throughput`` does (vllm/benchmarks/throughput.py,
    ``_run_vllm_requests``): TokensPrompt inputs, ``ignore_eos``, each row's
    ``max_tokens``; only ``generate`` is timed; tokens counted from the outputs;
    CPU seconds by thread during it (:mod:`bulkinfer.report.threads`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in rows]
    params = [
        SamplingParams(
            n=1, temperature=temperature, top_p=top_p, ignore_eos=True, max_tokens=r.max_tokens, detokenize=True
        )
        for r in rows
    ]
    threads_before = threads.snapshot(RAW)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    cpu_threads = threads.used(threads_before, threads.snapshot(RAW))
    prompt_tokens = sum(len(out.prompt_token_ids or ()) for out in outputs)
    completion = [sum(len(o.token_ids) for o in out.outputs) for out in outputs]
    return {
        "rows": len(rows),
        "generate_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(completion),
        # prompt tokens vLLM served from its prefix cache
        "cached_tokens": sum(out.num_cached_tokens or 0 for out in outputs),
        "rows_full_length": sum(c == r.max_tokens for c, r in zip(completion, rows, strict=True)),
        # CPU seconds by thread during generate, as bulkinfer's report has them (cpu_seconds.threads)
        "cpu_threads": cpu_threads,
    }


def _engine_config(llm: Any) -> dict[str, Any]:
    """What the engine resolved: dtype, eager or compiled, KV cache blocks and size."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return {
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "enforce_eager": config.model_config.enforce_eager,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }


def vllm_generate(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    from vllm import LLM

    rows = read_token_rows(args.rows)
    with engine_start(args.model, "raw vLLM"):
        llm = LLM(model=args.model, tokenizer=args.model, **json.loads(args.engine_args))
    load_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "load_s": load_s,
        "engine": _engine_config(llm),
        "all": _vllm_generate_once(llm, rows, args.temperature, args.top_p),
    }
    if args.subset_rows is not None:
        # The static baseline's rows, on the same (now warm) engine: its like-for-like reference.
        subset = read_token_rows(args.subset_rows)
        result["subset"] = _vllm_generate_once(llm, subset, args.temperature, args.top_p)
    _write(args.out, result)


def hf_static(args: argparse.Namespace) -> None:
    """transformers ``generate`` over static batches, following vLLM's ``hf``
    benchmark backend (``_run_hf_requests``): batches cut by
    :func:`bench.workload.static_batches`, each tokenized with padding inside
    the timed loop, ``max_new_tokens`` = the batch's longest output, outputs
    decoded inside the loop. Unlike that backend: left padding with an
    attention mask, greedy unless ``--temperature`` > 0, and ``min_new_tokens``
    = ``max_new_tokens`` so that no row stops at EOS (the ``ignore_eos`` of the
    vLLM systems). A row's completion tokens are what came back for it, up to
    its own ``max_tokens``; the rest of the batch's positions are waste."""
    started = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    rows = read_token_rows(args.rows)
    if args.order == "bucketed":
        rows = sorted(rows, key=lambda r: len(r.prompt_token_ids))  # stable: ties keep arrival order
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    load_s = time.perf_counter() - started
    batches = static_batches(rows, args.batch_size)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        if args.temperature > 0
        else {"do_sample": False}
    )
    eos = tokenizer.eos_token_id
    prompt_tokens = completion_tokens = generated_tokens = full_length = prompt_mismatch = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            enc = tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True)
            max_new = max(r.max_tokens for r in batch)
            out = model.generate(
                **enc,
                **sampling,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                use_cache=True,
                pad_token_id=tokenizer.pad_token_id,
            )
            tokenizer.batch_decode(out, skip_special_tokens=True)
            width = enc["input_ids"].shape[1]
            for row, real, seq in zip(
                batch, enc["attention_mask"].sum(dim=1).tolist(), out[:, width:].tolist(), strict=True
            ):
                prompt_mismatch += real != len(row.prompt_token_ids)
                prompt_tokens += real
                came_back = seq.index(eos) + 1 if eos in seq else len(seq)
                generated_tokens += came_back
                completion_tokens += min(came_back, row.max_tokens)
                full_length += came_back >= row.max_tokens
    elapsed = time.perf_counter() - start
    _write(
        args.out,
        {
            "load_s": load_s,
            "order": args.order,
            "batch_size": args.batch_size,
            "torch_threads": torch.get_num_threads(),
            "all": {
                "rows": len(rows),
                "generate_s": elapsed,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "generated_tokens": generated_tokens,
                "rows_full_length": full_length,
                "rows_prompt_tokens_mismatch": prompt_mismatch,
            },
            "padding_efficiency": padding_efficiency(batches),
        },
    )


def run_batch(args: argparse.Namespace) -> None:
    """``python -m vllm.entrypoints.openai.run_batch ARGS``, unchanged, plus two
    clocks: after the endpoints are set up (engine started, chat template
    loaded) and when every response is in, before the output file is written.
    Their difference is run-batch's generation phase (reading the input,
    rendering and tokenizing prompts, generating)."""
    started = time.perf_counter()
    import asyncio

    from vllm.entrypoints.launchers import run_batch as rb

    sys.argv = ["run_batch", *args.run_batch_args]
    parsed = rb.parse_args()
    marks: dict[str, float] = {}
    build_registry, write_file = rb.build_endpoint_registry, rb.write_file
    start = engine_start(str(getattr(parsed, "model", "")), "vLLM run-batch")
    start.__enter__()  # the engine starts inside rb.main; it is ready when the endpoints are built

    async def timed_build_registry(*a: Any, **kw: Any) -> Any:
        registry = await build_registry(*a, **kw)
        marks["ready"] = time.perf_counter()
        start.__exit__(None, None, None)
        return registry

    async def timed_write_file(*a: Any, **kw: Any) -> Any:
        marks["responses_in"] = time.perf_counter()
        return await write_file(*a, **kw)

    rb.build_endpoint_registry = timed_build_registry
    rb.write_file = timed_write_file
    asyncio.run(rb.main(parsed))
    _write(args.timing, {"load_s": marks["ready"] - started, "generate_s": marks["responses_in"] - marks["ready"]})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("vllm-generate", "hf-static"):
        p = sub.add_parser(name)
        p.add_argument("--rows", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--model", required=True)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=0)
    gen = sub.choices["vllm-generate"]
    gen.add_argument("--engine-args", required=True, help="vLLM engine arguments as a JSON object")
    gen.add_argument("--subset-rows", type=Path, default=None, help="then also time these rows alone")
    hf = sub.choices["hf-static"]
    hf.add_argument("--order", choices=("arrival", "bucketed"), default="arrival")
    hf.add_argument("--batch-size", type=int, default=16)
    hf.add_argument("--dtype", default="float32")
    rb = sub.add_parser("run-batch")
    rb.add_argument("--timing", type=Path, required=True)
    rb.add_argument("run_batch_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "run-batch" and args.run_batch_args[:1] == ["--"]:
        args.run_batch_args = args.run_batch_args[1:]
    {"vllm-generate": vllm_generate, "hf-static": hf_static, "run-batch": run_batch}[args.command](args)


if __name__ == "__main__":
    main()
