"""What streaming the tokens costs: the same requests through one engine,
returned once at the end (vLLM's ``RequestOutputKind.FINAL_ONLY``, bulkinfer
before live progress) or every step (``DELTA``, what lets the progress line
count unfinished rows), alternating, three rounds each. With ``--raw``, a
third variant per round: the same engine driven as ``LLM.generate`` drives
it (``LLMEngine.step`` in a plain loop, ``FINAL_ONLY``, no bulkinfer wrapper
or step thread hand-off), so the wrapper's own cost shows at the engine's
step rate (``--dtype``, ``--compiled``: bfloat16 compiled steps are ~2x
shorter than float32 eager ones on an AVX-512-BF16 CPU).

Each round: ``--rows`` short questions (:func:`bench.eta.short_prompts`,
the chat template applied), ``--max-tokens`` completion tokens each with
``ignore_eos`` (same work every round), fed all at once and stepped until
done (greedy); the time is from the first ``add`` to the last completion. Short
prompts keep the rounds decode-bound: every step returns one output per
running request, which is where streaming costs.

With ``--no-overlap``, a variant that streams with the engine's next step
started only after this thread handled the last one's outputs (the two in
turn, not side by side). Each round runs the variants one later than the
round before.

Usage: ``python -m bench.stream_overhead [--rows 256 --max-tokens 48]
[--dtype bfloat16 --compiled --raw --no-overlap --tag zen4-bf16-compiled]``; writes
``bench/results/stream_overhead[-TAG].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]


def one_round(
    engine: Any, requests: list[Any], stream: bool, interval: int = 1, overlap: bool = True
) -> dict[str, float]:
    """Feed ``requests``, step until all finished; seconds and tokens.
    ``interval``: streamed outputs every that many tokens (vLLM's ``stream_interval``);
    ``overlap``: the next step runs while this thread handles the last one's outputs
    (:attr:`VllmEngine.overlap_steps`), else the two take turns."""
    engine.stream_tokens = stream
    engine.stream_interval = interval
    engine.overlap_steps = overlap
    started = time.monotonic()
    for i, request in enumerate(requests):
        rejected = engine.add(f"{int(stream)}-{time.monotonic_ns()}-{i}", request)
        assert rejected is None, rejected
    tokens = steps = finished = 0
    while finished < len(requests):
        done = engine.step()
        steps += 1
        finished += len(done)
        tokens += sum(c.completion_tokens for c in done)
    seconds = time.monotonic() - started
    return {"seconds": seconds, "completion_tokens": tokens, "steps": steps, "tokens_per_s": tokens / seconds}


def raw_round(engine: Any, requests: list[Any]) -> dict[str, float]:
    """``requests`` through the same vLLM engine as ``LLM.generate`` runs them
    (vLLM 0.32 ``LLM._run_engine``): every request added with ``FINAL_ONLY``,
    then ``LLMEngine.step`` in a loop until none is unfinished, in the
    thread that started the engine (vLLM binds its OpenMP threads there)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm_engine = engine._engine
    params = [
        SamplingParams(
            max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        for r in requests
    ]

    def run() -> dict[str, float]:
        started = time.monotonic()
        for i, (request, p) in enumerate(zip(requests, params, strict=True)):
            llm_engine.add_request(f"raw-{time.monotonic_ns()}-{i}", engine._tokens_input(request.prompt_token_ids), p)
        tokens = steps = 0
        while llm_engine.has_unfinished_requests():
            outputs = llm_engine.step()
            steps += 1
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        seconds = time.monotonic() - started
        return {"seconds": seconds, "completion_tokens": tokens, "steps": steps, "tokens_per_s": tokens / seconds}

    return engine._stepper.call(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: bulkinfer's choice)")
    parser.add_argument("--compiled", action="store_true", help="enforce_eager false (default: eager)")
    parser.add_argument("--raw", action="store_true", help="add vLLM's own step loop (LLM.generate's) per round")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="add DELTA every N tokens (vLLM's stream_interval) per round"
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="add DELTA with the engine step and output handling in turn"
    )
    parser.add_argument("--tag", default="", help="results file suffix: stream_overhead-TAG.json")
    args = parser.parse_args()
    out = ROOT / "bench" / "results" / (f"stream_overhead-{args.tag}.json" if args.tag else "stream_overhead.json")

    from bench.eta import short_prompts
    from bulkinfer.config import load_settings
    from bulkinfer.engine.args import cpu_model
    from bulkinfer.engine.vllm import VllmEngine
    from bulkinfer.models import load_tokenizer, resolve_model
    from bulkinfer.prep.rows import parse_row

    overrides: dict[str, Any] = {
        "sampling.max_tokens": args.max_tokens,
        "sampling.ignore_eos": True,
        "sampling.temperature": 0.0,
    }
    if args.dtype:
        overrides["engine.dtype"] = args.dtype
    if args.compiled:
        overrides["engine.enforce_eager"] = False
    settings = load_settings(None, overrides)
    model = resolve_model(settings.model)
    tokenizer = load_tokenizer(model)
    requests = []
    for seq, row in enumerate(short_prompts(args.rows)):
        request = parse_row({"id": row["id"], "prompt": row["prompt"]}, seq, seq + 1, settings.sampling)
        chat = [{"role": "user", "content": request.prompt}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        request.prompt_token_ids = tokenizer(text, add_special_tokens=False).input_ids
        requests.append(request)
    engine = VllmEngine(model, settings.engine)
    try:
        one_round(engine, requests[:16], stream=True)  # warm-up
        variants: dict[str, Callable[[], dict[str, float]]] = {
            "final_only": lambda: one_round(engine, requests, False),
            "delta": lambda: one_round(engine, requests, True),
        }
        if args.stream_interval > 1:
            every = args.stream_interval
            variants[f"delta_every_{every}"] = lambda: one_round(engine, requests, True, every)
        if args.no_overlap:
            variants["delta_no_overlap"] = lambda: one_round(engine, requests, True, overlap=False)
        if args.raw:
            variants["vllm_loop"] = lambda: raw_round(engine, requests)
            raw_round(engine, requests[:16])  # warm-up
        results: dict[str, list[dict[str, float]]] = {kind: [] for kind in variants}
        order = list(variants)
        for k in range(args.rounds):  # each round starts one variant later: no variant always runs first
            for kind in order[k % len(order) :] + order[: k % len(order)]:
                results[kind].append(variants[kind]())
    finally:
        engine.close()
    summary = {kind: statistics.median(r["tokens_per_s"] for r in runs) for kind, runs in results.items()}
    command = f"python -m bench.stream_overhead --rows {args.rows} --max-tokens {args.max_tokens}"
    for flag, value in (
        ("--dtype", args.dtype),
        ("--tag", args.tag),
        ("--stream-interval", args.stream_interval > 1 and args.stream_interval),
    ):
        command += f" {flag} {value}" if value else ""
    command += " --compiled" * args.compiled + " --raw" * args.raw + " --no-overlap" * args.no_overlap
    doc: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": command,
        "engine": engine.settings,
        "rounds": results,
        "median_completion_tokens_per_s": summary,
        "delta_vs_final_only": summary["delta"] / summary["final_only"] - 1,
    }
    for kind in summary:
        doc[f"{kind}_vs_final_only"] = summary[kind] / summary["final_only"] - 1
    if args.raw:
        doc["delta_vs_vllm_loop"] = summary["delta"] / summary["vllm_loop"] - 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    lines = [
        f"# Streaming tokens (DELTA) vs one output per request (FINAL_ONLY) ({doc['date']}; "
        f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores)",
        "",
        f"Command: `{doc['command']}`; {args.rounds} alternating rounds, one engine "
        f"({doc['engine']['dtype']}, enforce_eager {doc['engine']['enforce_eager']}).",
        "",
        "| output kind | completion tok/s per round | median |",
        "| --- | --- | --- |",
    ]
    for kind, runs in results.items():
        per_round = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs)
        lines.append(f"| {kind} | {per_round} | {summary[kind]:.1f} |")
    lines += ["", f"DELTA vs FINAL_ONLY: {doc['delta_vs_final_only']:+.1%}"]
    if args.stream_interval > 1:
        every = f"delta_every_{args.stream_interval}"
        lines += [f"DELTA every {args.stream_interval} tokens vs FINAL_ONLY: {doc[every + '_vs_final_only']:+.1%}"]
    if args.no_overlap:
        in_turn = doc["delta_no_overlap_vs_final_only"]
        lines += [f"DELTA, step and output handling in turn, vs FINAL_ONLY: {in_turn:+.1%}"]
    if args.raw:
        lines += [f"DELTA (bulkinfer's engine wrapper) vs vLLM's own step loop: {doc['delta_vs_vllm_loop']:+.1%}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
