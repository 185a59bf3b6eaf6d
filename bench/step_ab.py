"""Eager against compiled, one decode step at a time, side by side: two
engines (vLLM's ``LLMEngine``, each in a child process of its own, in that
process as bulkinfer runs one CPU engine), both started first, then each
point of the grid run on one and straight after on the other, the order
swapped every round (ABBA), so a wander of the machine's speed lands on both
alike rather than on the difference (the compile choice rests on that
difference; measured minutes apart, on this VM it moved by up to 30%).

A point: B requests of P prompt tokens (token ids distinct across points:
no prefix-cache hits), 48 + B x P / 1,024 tokens each (the first requests
must not finish before the last is prefilled: a step prefills at most
vLLM's ``max_num_batched_tokens``, 2,048 or more), ``ignore_eos``,
temperature 0, added at once (:func:`bench.step_curve.measure_point`); its
figure is the median of its pure decode steps (every request at 2 tokens or
more, none done), their rows' mean context (prompt and tokens so far) about
P + half the tokens.
Beside the compile choice's grid (:data:`bulkinfer.jobs.decode_steps.DECODE_GRID`
goes to 64 rows x 512 tokens) the points reach a full batch (256 rows, as
``max_num_seqs``) and ShareGPT-like contexts (1,024 tokens): whether the
line fitted to the small grid extrapolates to a full job's steps.

Usage: ``python -m bench.step_ab [--dtype bfloat16] [--rounds 2]
[--points 64x512,256x16,256x512,128x1024] [--tag T]``; writes
``bench/results/step-ab[-T].{json,md}``. Two engines on two cores: nothing
else running; one child steps while the other waits on its pipe.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import orjson

from bench.measure import stamp, write_page

ROOT = Path(__file__).resolve().parents[1]
GENERATED = 48
POINTS = "64x512,256x16,256x512,128x1024"
MARK = "@@step_ab "  # a child's answers on stdout, among vLLM's logs


def child(dtype: str, compiled: bool) -> None:
    """Build one engine, say so, then run each ``rows prompt first_id`` line of stdin as a point."""
    from bench.step_curve import build_engine, measure_point
    from bulkinfer.models import resolve_model

    started = time.perf_counter()
    engine = build_engine(resolve_model(None), dtype, compiled, kv_cache_gib=4)  # type: ignore[arg-type]
    print(MARK + orjson.dumps({"start_s": time.perf_counter() - started}).decode(), flush=True)
    for line in sys.stdin:
        rows, prompt, first_id = (int(x) for x in line.split())
        point = measure_point(engine, rows, prompt, generated(rows, prompt), first_id)
        print(MARK + orjson.dumps(point).decode(), flush=True)


def generated(rows: int, prompt: int) -> int:
    """Tokens a point's rows generate (see the module docstring)."""
    return GENERATED + rows * prompt // 1024


def _answer(stdout: IO[str]) -> dict[str, Any]:
    """The next line a child marked (vLLM's own lines skipped)."""
    for line in stdout:
        if line.startswith(MARK):
            return orjson.loads(line[len(MARK) :])
    raise RuntimeError("a step_ab child ended before answering (its log is above)")


def run(dtype: str, rounds: int, points: list[tuple[int, int]]) -> dict[str, Any]:
    """Start both engines, then each point on each, alternating (see the module docstring)."""
    children: dict[str, subprocess.Popen[str]] = {}
    starts = {}
    for variant in ("eager", "compiled"):
        cmd = [sys.executable, "-m", "bench.step_ab", "--child", "--dtype", dtype]
        cmd += ["--compiled"] if variant == "compiled" else []
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        children[variant] = proc
        assert proc.stdout is not None
        starts[variant] = _answer(proc.stdout)["start_s"]
    results: list[dict[str, Any]] = []
    next_id = dict.fromkeys(children, 0)
    try:
        for r in range(rounds):
            order = ["eager", "compiled"] if r % 2 == 0 else ["compiled", "eager"]
            for rows, prompt in points:
                for variant in order:
                    proc = children[variant]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"{rows} {prompt} {next_id[variant]}\n")
                    proc.stdin.flush()
                    point = _answer(proc.stdout)
                    next_id[variant] += rows
                    results.append({"round": r + 1, "variant": variant, **point})
                    line = f"round {r + 1} {variant:8} {rows}x{prompt}: {point['decode_step_s']}"
                    print(line, file=sys.stderr, flush=True)
    finally:
        for proc in children.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=120)
    return {"start_s": starts, "results": results}


def summary(results: list[dict[str, Any]], points: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per point: each variant's median step per round (seconds) and eager over compiled per round."""
    out = []
    for rows, prompt in points:

        def steps(variant: str, rows: int = rows, prompt: int = prompt) -> list[float]:
            return [
                r["decode_step_s"]
                for r in results
                if r["variant"] == variant and (r["rows"], r["prompt_tokens"]) == (rows, prompt)
            ]

        eager, compiled = steps("eager"), steps("compiled")
        out.append(
            {
                "rows": rows,
                "prompt_tokens": prompt,
                "eager_s": eager,
                "compiled_s": compiled,
                "ratio": [e / c for e, c in zip(eager, compiled, strict=True)],
                "saved_ms": statistics.fmean(e - c for e, c in zip(eager, compiled, strict=True)) * 1000,
            }
        )
    return out


def render(doc: dict[str, Any]) -> str:
    """The results page."""
    m = doc["machine"]
    lines = [
        f"# Eager against compiled, step by step, side by side ({doc['date']}; {m['cpu']} ({m['cpu_kind']}), "
        f"{m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; vLLM {doc['versions']['vllm']}, the default model, {doc['dtype']}, "
        f"two engines in child processes (started in {doc['start_s']['eager']:.1f} s eager, "
        f"{doc['start_s']['compiled']:.1f} s compiled), each point on one then the other, the order swapped "
        f"each round. Seconds: the median of a point's pure decode steps ({GENERATED} + rows x prompt / 1,024 "
        "tokens a row).",
        "",
        "| rows | prompt tokens | eager s (rounds) | compiled s (rounds) | eager / compiled | saved ms a step |",
        "| --: | --: | --- | --- | --- | --: |",
    ]
    for p in doc["summary"]:
        lines.append(
            f"| {p['rows']} | {p['prompt_tokens']} | {', '.join(f'{s:.4f}' for s in p['eager_s'])} "
            f"| {', '.join(f'{s:.4f}' for s in p['compiled_s'])} | {', '.join(f'{x:.2f}x' for x in p['ratio'])} "
            f"| {p['saved_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--points", default=POINTS, help="ROWSxPROMPT_TOKENS, comma-separated")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.child:
        child(args.dtype, args.compiled)
        return
    points = [(int(b), int(p)) for b, p in (x.split("x") for x in args.points.split(","))]
    measured = run(args.dtype, args.rounds, points)
    doc = {
        **stamp(),
        "command": " ".join(["python -m bench.step_ab", *sys.argv[1:]]),
        "dtype": args.dtype,
        **measured,
        "summary": summary(measured["results"], points),
    }
    write_page(f"step-ab{'-' + args.tag if args.tag else ''}", doc, render)


if __name__ == "__main__":
    main()
