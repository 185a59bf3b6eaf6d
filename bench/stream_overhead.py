"""What streaming the tokens costs: the same requests through one engine,
returned once at the end (vLLM's ``RequestOutputKind.FINAL_ONLY``, bulkinfer
before live progress) or every step (``DELTA``, what lets the progress line
count unfinished rows), alternating, three rounds each.

Each round: ``--rows`` short questions (:func:`bench.eta.short_prompts`,
the chat template applied), ``--max-tokens`` completion tokens each with
``ignore_eos`` (same work every round), fed all at once and stepped until
done; the time is from the first ``add`` to the last completion. Short
prompts keep the rounds decode-bound: every step returns one output per
running request, which is where streaming costs.

Usage: ``python -m bench.stream_overhead [--rows 256 --max-tokens 48]``;
writes ``bench/results/stream_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]


def one_round(engine: Any, requests: list[Any], stream: bool) -> dict[str, float]:
    """Feed ``requests``, step until all finished; seconds and tokens."""
    engine.stream_tokens = stream
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stream_overhead.json")
    args = parser.parse_args()

    from bench.eta import short_prompts
    from bulkinfer.config import load_settings
    from bulkinfer.engine.args import cpu_model
    from bulkinfer.engine.vllm import VllmEngine
    from bulkinfer.models import load_tokenizer, resolve_model
    from bulkinfer.prep.rows import parse_row

    settings = load_settings(None, {"sampling.max_tokens": args.max_tokens, "sampling.ignore_eos": True})
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
        results: dict[str, list[dict[str, float]]] = {"final_only": [], "delta": []}
        for _ in range(args.rounds):
            for stream in (False, True):
                results["delta" if stream else "final_only"].append(one_round(engine, requests, stream))
    finally:
        engine.close()
    summary = {kind: statistics.median(r["tokens_per_s"] for r in runs) for kind, runs in results.items()}
    doc: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": f"python -m bench.stream_overhead --rows {args.rows} --max-tokens {args.max_tokens}",
        "engine": engine.settings,
        "rounds": results,
        "median_completion_tokens_per_s": summary,
        "delta_vs_final_only": summary["delta"] / summary["final_only"] - 1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    lines = [
        f"# Streaming tokens (DELTA) vs one output per request (FINAL_ONLY) ({doc['date']}; "
        f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores)",
        "",
        f"Command: `{doc['command']}`; {args.rounds} alternating rounds, one engine.",
        "",
        "| output kind | completion tok/s per round | median |",
        "| --- | --- | --- |",
    ]
    for kind, runs in results.items():
        per_round = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs)
        lines.append(f"| {kind} | {per_round} | {summary[kind]:.1f} |")
    lines += ["", f"DELTA vs FINAL_ONLY: {doc['delta_vs_final_only']:+.1%}"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
