"""Ray Data LLM (``ray.data.llm.build_processor`` with ``vLLMEngineProcessorConfig``)
on CPU: the first ``--rows`` rows of ``sample_data/sharegpt.jsonl`` as one-message
chats (the model's chat template applied by Ray's ChatTemplateStage), greedy
(temperature 0), ``--max-tokens`` each, float32, ``enforce_eager``, the default
model, one vLLM engine on a local Ray cluster started by this script.

Prints one JSON line: rows, completion tokens, wall seconds and completion
tokens/s. Wall seconds run from the start of the pipeline to the last row, so they
include starting Ray Data's actors and the vLLM engine (Ray Data starts them lazily
inside the pipeline; there is no separate load phase to subtract): compare them
with other systems' wall times, not with a generation-phase throughput.

CPU-only needs two settings Ray's defaults do not give: ``placement_group_config``
with a CPU-only bundle (without it the engine actor asks for ``num_gpus=1`` and is
never placed), and small ``num_cpus`` for the light stages (four 1-CPU actor pools
do not fit on 2 cores). vLLM's CPU backend turns the ``"uni"`` executor Ray picks
into ``"mp"``, so the model runs in a worker process whose OpenMP threads vLLM binds
to the cores itself (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: all of them, as in
``bench.compare``), whatever Ray's logical CPUs say.

``--compare ROUNDS`` runs Ray Data LLM and ``bulkinfer run --ray local -dp 1``
(the same rows, chat template, greedy, ``--ignore-eos`` so both generate the
same tokens) alternating, each a process of its own timed from start to exit
(Ray's start, the engine's load and writing included), and writes
``bench/results/ray_data_llm.{json,md}``.

Usage (from the repository root, nothing else running on the machine):

    .venv/bin/python -m bench.ray_data_llm --rows 50 --max-tokens 128 [--ignore-eos]
    .venv/bin/python -m bench.ray_data_llm --rows 100 --max-tokens 128 --compare 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "sample_data" / "sharegpt.jsonl"
GiB = 1 << 30
# Logical CPUs of the chat-template, tokenize and detokenize actors and of the
# pre/postprocess tasks: light work, and they must fit beside the engine's 1 CPU.
LIGHT_CPUS = 0.1
# Every Ray worker's environment (the engine actor's engine-core and worker inherit it).
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Ray Data LLM on CPU: completion tokens/s over ShareGPT rows")
    p.add_argument("--rows", type=int, default=50, help="the first N rows of the source")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every row")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens for every row")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch sent to the engine")
    p.add_argument("--kv-cache-gib", type=float, default=6.0, help="vLLM kv_cache_memory_bytes, in GiB")
    p.add_argument("--source", type=Path, default=SOURCE, help="JSONL with id and prompt fields")
    p.add_argument("--compare", type=int, default=0, metavar="ROUNDS", help="alternate with bulkinfer --ray local")
    return p.parse_args(argv)


def read_rows(path: Path, n: int) -> list[dict[str, str]]:
    """The first ``n`` rows of ``path``, keeping ``id`` and ``prompt``."""
    rows: list[dict[str, str]] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if len(rows) == n:
                break
            row = json.loads(line)
            rows.append({"id": row["id"], "prompt": row["prompt"]})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the processor, run it over the rows, and return the measurements."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from bulkinfer.default_model import prepare_default_model

    model = str(prepare_default_model())
    rows = read_rows(args.source, args.rows)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env={"env_vars": ENV})
    config = vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs={
            "dtype": "float32",
            "enforce_eager": True,
            "seed": 0,
            "kv_cache_memory_bytes": int(args.kv_cache_gib * GiB),
        },
        batch_size=args.batch_size,
        concurrency=1,
        accelerator_type=None,
        # A CPU-only bundle: the engine actor then asks for num_cpus=1 and no GPU.
        placement_group_config={"bundle_per_worker": {"CPU": 1}},
        runtime_env={"env_vars": ENV},
        log_engine_metrics=False,
        chat_template_stage={"num_cpus": LIGHT_CPUS},
        tokenize_stage={"num_cpus": LIGHT_CPUS},
        detokenize_stage={"num_cpus": LIGHT_CPUS},
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "id": row["id"],
            "messages": [{"role": "user", "content": row["prompt"]}],
            "sampling_params": sampling,
        },
        postprocess=lambda row: {"id": row["id"], "completion_tokens": row["num_generated_tokens"]},
        preprocess_map_kwargs={"num_cpus": LIGHT_CPUS},
        postprocess_map_kwargs={"num_cpus": LIGHT_CPUS},
    )

    started = time.perf_counter()
    out = processor(ray.data.from_items(rows)).take_all()
    wall_s = time.perf_counter() - started
    ray.shutdown()

    if sorted(r["id"] for r in out) != sorted(r["id"] for r in rows):
        raise SystemExit(f"expected {len(rows)} rows back, got {len(out)}")
    completion_tokens = sum(int(r["completion_tokens"]) for r in out)
    return {
        "rows": len(out),
        "completion_tokens": completion_tokens,
        "wall_s": round(wall_s, 3),
        "completion_tokens_per_s": round(completion_tokens / wall_s, 2),
    }


def timed(cmd: list[str]) -> tuple[float, str]:
    """Seconds from start to exit of ``cmd`` (run from the repository root), and its standard output."""
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return time.perf_counter() - started, proc.stdout


def compare(args: argparse.Namespace) -> None:
    """Ray Data LLM and bulkinfer on a local Ray cluster, alternating; writes bench/results/ray_data_llm.*."""
    from bulkinfer.engine.args import cpu_model

    rows = read_rows(args.source, args.rows)
    common = ["--max-tokens", str(args.max_tokens), "--ignore-eos"]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for round_ in range(1, args.compare + 1):
            cmd = [sys.executable, "-m", "bench.ray_data_llm", "--rows", str(args.rows), "--source", str(src), *common]
            wall, stdout = timed(cmd)
            inner = json.loads(stdout.strip().splitlines()[-1])
            results.append({"round": round_, "system": "Ray Data LLM", "process_s": round(wall, 1), **inner})
            dest = Path(tmp) / f"b{round_}.jsonl"
            cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(dest), "--ray", "local"]
            wall, _ = timed([*cmd, "--temperature", "0", "--plain-progress", *common])
            report = json.loads(dest.with_name(f"b{round_}.report.json").read_text())
            results.append(
                {
                    "round": round_,
                    "system": "bulkinfer --ray local",
                    "process_s": round(wall, 1),
                    "rows": report["request_counts"]["completed"],
                    "completion_tokens": report["tokens"]["completion"],
                    "generate_completion_tokens_per_s": round(report["throughput"]["completion_tokens_per_s"], 1),
                }
            )
            for r in results[-2:]:
                r["completion_tokens_per_process_s"] = round(r["completion_tokens"] / r["process_s"], 2)
                print(f"bench.ray_data_llm: {r}", file=sys.stderr)
    command = f"python -m bench.ray_data_llm --rows {args.rows} --max-tokens {args.max_tokens} --compare {args.compare}"
    machine = {"cpu": cpu_model(), "cores": os.cpu_count()}
    data = {"machine": machine, "command": command, "results": results}
    out = ROOT / "bench" / "results" / "ray_data_llm.json"
    out.write_text(json.dumps(data, indent=2))
    lines = [
        f"# Ray Data LLM vs bulkinfer --ray local ({machine['cpu']}, {machine['cores']} cores)",
        "",
        f"Command: `{command}`; the first {args.rows} rows of sample_data/sharegpt.jsonl, chat template, "
        f"temperature 0, {args.max_tokens} tokens each (ignore_eos), float32, eager; runs in this order, "
        "each a process timed from start to exit.",
        "",
        "| round | system | rows | completion tokens | process s | completion tok / process s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['round']} | {r['system']} | {r['rows']} | {r['completion_tokens']} | {r['process_s']} "
            f"| {r['completion_tokens_per_process_s']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.compare:
        compare(arguments)
    else:
        print(json.dumps(run(arguments)))
