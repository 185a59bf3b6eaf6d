"""Speculative decoding by n-gram prompt lookup (vLLM's ``speculative_config``
method ``ngram``) against none, alternating (:mod:`bench.variants`): on
``extraction`` (answers that copy spans of their prompts) its speed-up, on
``sharegpt`` (answers that copy little, ``ignore_eos``) its cost; and the
variants below.

``--tail B`` adds a variant ``tailB``, ``bulkinfer run --speculative-tail
B``: speculation only in steps of at most ``B`` running rows (vLLM's
dynamic speculative decoding, :func:`bulkinfer.engine.args.tail_speculation`,
4 draft tokens whatever ``--k``): a job's tail, where a few long rows run
alone and each step costs about its fixed part, checks ``k`` drafts a row
almost for free. Full batches check no draft but still take vLLM's
speculative path (``fixed``, rows that end together, measures that cost;
``bench.step_profile`` where it goes). Greedy decoding: the completions
must be the same with and without it (in float32; bfloat16 rounds the
checking step's other shapes differently). Two variants without
speculation measure that rounding's baseline: ``again`` (the first
variant's flags once more: is a run reproducible?) and ``arrival``
(``--order arrival``: the same rows in other batches, as any change of
feed order, batch size or KV cache makes them). ``--flags`` go to every
variant's run (e.g. ``--no-enforce-eager``).

Usage: ``python -m bench.speculative [--rows 64 --max-tokens 256 --rounds 2 --k 4 --tail 8,32
--variants none,ngram,tail8,again,arrival]``; writes ``bench/results/speculative.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

from bench.variants import ROOT, Variant, alternate, write


def ngram_config(k: int) -> str:
    """The ``--engine-arg`` value: fields of vLLM's ``SpeculativeConfig``
    (vLLM 0.32 ``vllm/config/speculative.py``), ``k`` draft tokens a step."""
    fields = f'method = "ngram", num_speculative_tokens = {k}, prompt_lookup_max = 4, prompt_lookup_min = 2'
    return f"speculative_config={{{fields}}}"


def _flags(flags: list[str]) -> Variant:
    return lambda _: (flags, {})


def _with(common: list[str], variant: Variant) -> Variant:
    def flags(i: int) -> tuple[list[str], dict[str, str]]:
        own, env = variant(i)
        return [*common, *own], env

    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256, help="sharegpt: cap on each row's max_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the ngram variant (tailB: 4)")
    parser.add_argument("--tail", default="", help="comma-separated B: a variant tailB speculating at <= B rows")
    parser.add_argument(
        "--variants", default=None, help="which to run, in order (default: none and the speculative ones)"
    )
    parser.add_argument("--workloads", default="extraction,sharegpt")
    parser.add_argument("--flags", default="", help="flags every variant's run gets, e.g. '--no-enforce-eager'")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculative.json")
    args = parser.parse_args()

    specs = {"ngram": ["--engine-arg", ngram_config(args.k)]}
    specs |= {f"tail{b}": ["--speculative-tail", str(int(b))] for b in args.tail.split(",") if b}
    known: dict[str, Variant] = {"none": _flags([])} | {name: _flags(f) for name, f in specs.items()}
    variants = dict(known)
    known |= {"again": _flags([]), "arrival": _flags(["--order", "arrival"])}
    if args.variants:
        variants = {name: known[name] for name in args.variants.split(",")}
    variants = {name: _with(shlex.split(args.flags), v) for name, v in variants.items()}
    work = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    doc = alternate(
        "bench.speculative", args.workloads.split(","), variants, work, args.rows, args.max_tokens, args.rounds
    )
    doc["speculative_args"] = {name: " ".join(f) for name, f in specs.items() if name in variants}
    note = "; ".join(f"{name}: `{flags}`" for name, flags in doc["speculative_args"].items())
    write(doc, args.out, "n-gram speculative decoding", note + ".")


if __name__ == "__main__":
    main()
