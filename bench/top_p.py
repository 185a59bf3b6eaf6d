"""Nucleus sampling (``top_p`` < 1) on CPU: bulkinfer's nucleus processor
(``[engine] top_p_sampler = "auto"``, :mod:`bulkinfer.engine.nucleus`)
against vLLM's own sort (``"vllm"``), alternating (:mod:`bench.variants`),
on ShareGPT prompts (``ignore_eos``) at each ``--sampling`` setting
(temperature:top_p; ``make demo``'s 0.7:0.9 first). The same engine seed for
both: with float32 logits the completions must be the same; with bfloat16
logits equal values at the nucleus's edge are common and either sampler
keeps an arbitrary one of them (torch.sort on CPU is not stable), so the
completions part where that happens.

Usage: ``python -m bench.top_p [--rows 256 --max-tokens 256 --rounds 2
--sampling 0.7:0.9,1.0:0.95] [--dtype float32]``; writes
``bench/results/top-p.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.variants import ROOT, Variant, alternate, write

# variant -> top_p_sampler
SAMPLERS = {"vllm": "vllm", "bulkinfer": "auto"}


def constant(flags: list[str]) -> Variant:
    """A variant with the same ``flags`` every round."""
    return lambda _: (flags, {})


def sampler(name: str) -> list[str]:
    """The flags of one sampler: ``top_p_sampler``, bulkinfer's setting."""
    return ["--engine-arg", f'top_p_sampler="{name}"']


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on each row's max_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sampling", default="0.7:0.9,1.0:0.95", help="temperature:top_p, comma-separated")
    parser.add_argument("--dtype", default=None, help="--dtype for every run (default: bulkinfer's choice)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "top-p.json")
    args = parser.parse_args()

    dtype = ["--dtype", args.dtype] if args.dtype else []
    doc: dict = {}
    for setting in args.sampling.split(","):
        temperature, top_p = setting.split(":")
        flags = ["--temperature", temperature, "--top-p", top_p, *dtype]
        variants: dict[str, Variant] = {name: constant([*flags, *sampler(arg)]) for name, arg in SAMPLERS.items()}
        work = Path(tempfile.mkdtemp(prefix="bench-top-p-"))
        one = alternate("bench.top_p", ["sharegpt"], variants, work, args.rows, args.max_tokens, args.rounds)
        label = f"sharegpt T={temperature} top_p={top_p}"
        for run in one["runs"]:
            run["workload"] = label
        one["means"] = {label: one["means"]["sharegpt"]}
        one["workloads"] = {label: one["workloads"]["sharegpt"]}
        if not doc:
            doc = one
        else:
            doc["runs"] += one["runs"]
            doc["means"].update(one["means"])
            doc["workloads"].update(one["workloads"])
    note = 'Variants: `--engine-arg top_p_sampler="vllm"` (vLLM\'s sort) and `"auto"` (bulkinfer\'s processor).'
    write(
        doc,
        args.out,
        "top_p: bulkinfer's nucleus processor against vLLM's sort",
        note,
        "the workload's temperature and top_p",
    )


if __name__ == "__main__":
    main()
