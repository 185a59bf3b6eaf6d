"""Speculative decoding by n-gram prompt lookup (vLLM's ``speculative_config``
method ``ngram``) against none, alternating (:mod:`bench.variants`): on
``extraction`` (answers that copy spans of their prompts) its speed-up, on
``sharegpt`` (answers that copy little, ``ignore_eos``) its cost. Greedy
decoding: the completions must be the same with and without it.

Usage: ``python -m bench.speculative [--rows 64 --max-tokens 256 --rounds 2 --k 4]``;
writes ``bench/results/speculative.{json,md}``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.variants import ROOT, Variant, alternate, write


def ngram_config(k: int) -> str:
    """The ``--engine-arg`` value: fields of vLLM's ``SpeculativeConfig``
    (vLLM 0.32 ``vllm/config/speculative.py``), ``k`` draft tokens a step."""
    fields = f'method = "ngram", num_speculative_tokens = {k}, prompt_lookup_max = 4, prompt_lookup_min = 2'
    return f"speculative_config={{{fields}}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256, help="sharegpt: cap on each row's max_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--workloads", default="extraction,sharegpt")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculative.json")
    args = parser.parse_args()

    spec = ngram_config(args.k)
    variants: dict[str, Variant] = {"none": lambda _: ([], {}), "ngram": lambda _: (["--engine-arg", spec], {})}
    work = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    doc = alternate(
        "bench.speculative", args.workloads.split(","), variants, work, args.rows, args.max_tokens, args.rounds
    )
    doc["speculative_arg"] = spec
    write(doc, args.out, "n-gram speculative decoding", f"ngram: `--engine-arg '{spec}'`.")


if __name__ == "__main__":
    main()
