"""The driver's ceiling: how many rows and tokens per second one bulkinfer
process reads, tokenizes, plans, feeds and writes when the engine costs
nothing, and so how many replicas of a given speed one driver keeps busy.

An instant engine (:class:`InstantEngine`) finishes every request at its
next step with ``max_tokens`` completion tokens and a completion text of
the same length in words; everything else is the real run
(:func:`bulkinfer.run`: the reader, the planner with the default model's
real tokenizer and chat template, the feed loop, the spools, the publishing,
the report). Rows: the 300 ShareGPT prompts of ``sample_data/sharegpt.jsonl``
repeated under new ids up to ``--rows`` (default 20,000), ``max_tokens``
``--max-tokens`` (default 128).

The figure that matters is completion tokens/s through the driver (the
report's ``throughput.completion_tokens_per_s``, generation phase): a
replica generating S completion tokens/s on its own keeps up with the
driver while N x S stays below it; past it the driver, not the GPUs, sets
the pace. The results list N for a few replica speeds S.

Usage: ``python -m bench.driver_ceiling [--rows 20000] [--max-tokens 128]``;
writes ``bench/results/driver_ceiling.{json,md}``. No model engine: a
minute or two; run it on a quiet machine (it measures this process's speed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]

# Completion tokens/s of one replica, for the "replicas one driver keeps busy" column.
REPLICA_SPEEDS = (1_000, 5_000, 10_000, 20_000)


class InstantEngine:
    """An engine that costs nothing: each step finishes every request added
    since the last, with ``max_tokens`` completion tokens."""

    max_model_len = 8192
    max_num_seqs = 256

    def __init__(self) -> None:
        self.queue: deque[tuple[str, Any]] = deque()
        self.generated_tokens = self.prefilled_tokens = self.cached_tokens = 0
        self.settings: dict[str, Any] = {"engine": "instant (bench.driver_ceiling)"}

    def add(self, request_id: str, request: Any) -> None:
        self.queue.append((request_id, request))

    def step(self, wait: float | None = None) -> list[Any]:
        from bulkinfer.schema import Completion

        done = []
        while self.queue:
            request_id, request = self.queue.popleft()
            prompt = len(request.prompt_token_ids or ())
            done.append(Completion(request_id, " word" * request.max_tokens, "length", prompt, request.max_tokens))
            self.prefilled_tokens += prompt
            self.generated_tokens += request.max_tokens
        return done

    running_prompt_tokens = ended_sequences = 0

    def running_lengths(self) -> list[int]:
        return []

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def abort_unfinished(self) -> None:
        self.queue.clear()

    def close(self) -> None:
        pass


def write_rows(path: Path, rows: int) -> None:
    """``rows`` rows cycling through the sample ShareGPT prompts, each with its own id."""
    prompts = [
        orjson.loads(line)["prompt"] for line in (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines()
    ]
    with path.open("wb") as f:
        for i in range(rows):
            f.write(orjson.dumps({"id": f"row-{i}", "prompt": prompts[i % len(prompts)]}) + b"\n")


def measure(rows: int, max_tokens: int) -> dict[str, Any]:
    """One run through the instant engine; the report's figures."""
    from bulkinfer import load_settings
    from bulkinfer.io.output_files import RunPaths
    from bulkinfer.jobs.context import RunContext
    from bulkinfer.jobs.run import run

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "rows.jsonl"
        write_rows(src, rows)
        settings = load_settings(None, {"sampling.max_tokens": max_tokens})
        report = run(
            RunPaths.build(src, Path(tmp) / "out.jsonl"),
            settings,
            RunContext(engine_factory=lambda m, s: InstantEngine()),
        ).report
    tput, seconds = report["throughput"], report["seconds"]
    return {
        "rows": report["request_counts"]["completed"],
        "prompt_tokens": report["tokens"]["prompt"],
        "completion_tokens": report["tokens"]["completion"],
        "seconds": {k: round(v, 3) for k, v in seconds.items() if k != "start"},
        "rows_per_s": round(tput["requests_per_s"], 1),
        "prompt_tokens_per_s": round(tput["prompt_tokens_per_s"], 1),
        "completion_tokens_per_s": round(tput["completion_tokens_per_s"], 1),
        "replicas_kept_busy": {
            str(speed): round(tput["completion_tokens_per_s"] / speed, 1) for speed in REPLICA_SPEEDS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    from bulkinfer.engine.args import cpu_model

    result = measure(args.rows, args.max_tokens)
    data: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": f"python -m bench.driver_ceiling --rows {args.rows} --max-tokens {args.max_tokens}",
        "result": result,
    }
    out = ROOT / "bench" / "results" / "driver_ceiling.json"
    out.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    machine = f"{data['machine']['cpu']}, {data['machine']['cores']} cores"
    lines = [
        f"# The driver's ceiling ({data['date']}; {machine})",
        "",
        f"Command: `{data['command']}`; an instant engine, the default model's tokenizer and chat template.",
        "",
        "| rows | prompt tokens | completion tokens | plan s | generate s | write s "
        "| rows/s | prompt tok/s | completion tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {result['rows']:,} | {result['prompt_tokens']:,} | {result['completion_tokens']:,} "
        f"| {result['seconds']['plan']:.1f} | {result['seconds']['generate']:.1f} | {result['seconds']['write']:.1f} "
        f"| {result['rows_per_s']:,} | {result['prompt_tokens_per_s']:,} | {result['completion_tokens_per_s']:,} |",
        "",
        "Replicas of a given speed one driver keeps busy (driver completion tok/s / replica completion tok/s):",
        "",
        "| replica completion tok/s | replicas |",
        "| --- | --- |",
        *(f"| {int(speed):,} | {n} |" for speed, n in result["replicas_kept_busy"].items()),
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
