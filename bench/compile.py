"""vLLM's compilation (``--no-enforce-eager``) against eager mode, and what
its compile cache gives back on a second start, alternating
(:mod:`bench.variants`):

- ``eager``: bulkinfer's default on CPU (``enforce_eager``);
- ``compiled-cold``: compiled, with empty caches (a new ``VLLM_CACHE_ROOT``
  and ``TORCHINDUCTOR_CACHE_DIR`` a round: vLLM keeps its torch.compile
  artifacts in the first, torch's inductor some of its own in the second);
- ``compiled-warm``: compiled again with the cache the round's cold run filled.

From the means: the start each compiled variant adds to eager's (``load``
seconds), the generation completion tokens/s of each, and the break-even:
the completion tokens from which compiling pays, ``extra start s / (1 /
eager tok/s - 1 / compiled tok/s)`` (no break-even when compiled is not faster).

Usage: ``python -m bench.compile [--rows 100 --max-tokens 256 --rounds 2]``;
writes ``bench/results/compile.{json,md}``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench.variants import ROOT, Variant, alternate, write

COMPILED = ["--no-enforce-eager"]


def break_even(means: dict[str, dict[str, float]], compiled: str) -> float | None:
    """Completion tokens from which ``compiled`` beats eager end to end (None: it never does)."""
    eager, other = means["eager"], means[compiled]
    saved_per_token = 1 / eager["gen_completion_tok_s"] - 1 / other["gen_completion_tok_s"]
    extra = other["load_s"] - eager["load_s"]
    if saved_per_token <= 0:
        return None
    return max(0.0, extra / saved_per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on each row's max_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compile.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-compile-"))

    def cache(round_: int) -> dict[str, str]:
        # torch's inductor also keeps a cache of its own (by default /tmp/torchinductor_$USER, filled
        # before vLLM points it into its cache root): a cold start needs both empty
        root = work / f"vllm-cache-{round_}"
        return {"VLLM_CACHE_ROOT": str(root), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}

    variants: dict[str, Variant] = {
        "eager": lambda _: ([], {}),
        "compiled-cold": lambda i: (COMPILED, cache(i)),  # the round's cache, empty before this run
        "compiled-warm": lambda i: (COMPILED, cache(i)),  # the same cache, filled by the cold run
    }
    doc = alternate("bench.compile", ["sharegpt"], variants, work, args.rows, args.max_tokens, args.rounds)
    means = doc["means"].get("sharegpt", {})
    result: dict[str, Any] = {}
    for name in ("compiled-cold", "compiled-warm"):
        if "eager" in means and name in means:
            result[name] = {"break_even_completion_tokens": break_even(means, name)}
    doc["break_even"] = result
    lines = [
        f"{name}: break-even {'none' if v is None else f'{v:,.0f} completion tokens'}"
        for name, v in ((n, r["break_even_completion_tokens"]) for n, r in result.items())
    ]
    write(doc, args.out, "Compiled against eager", "; ".join(lines) or "")


if __name__ == "__main__":
    main()
