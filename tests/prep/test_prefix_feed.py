"""Tests of prefix-aware feeding (bulkinfer.prep.prefix and the planner's use
of it): rows sharing a first KV block are fed together, the longest first;
rows without a shared block keep the plain feed order; the shareable-token
estimate counts whole shared blocks only."""

from __future__ import annotations

import pytest

from bulkinfer.config import PlanSettings
from bulkinfer.prep.planner import Planner, order_for_feed
from bulkinfer.prep.prefix import PrefixStats, prefix_block_tokens, prefix_groups, shared_blocks
from bulkinfer.schema import Request

BLOCK = 4


def req(seq: int, ids: list[int]) -> Request:
    return Request(
        seq=seq,
        line=seq + 1,
        id=f"r{seq}",
        prompt=None,
        messages=None,
        max_tokens=8,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        stop=(),
        prompt_token_ids=ids,
    )


# Two conversations replayed turn by turn (turn k's prompt starts with turn k-1's), and
# single rows: a = 100.. (turns of 6, 14, 10 tokens), b = 200.. (9, 5 tokens); 300.., 400..,
# 500.. share nothing; 600.. is shorter than one block.
A1, A2, A3 = list(range(100, 106)), list(range(100, 114)), list(range(100, 110))
B1, B2 = list(range(200, 209)), list(range(200, 205))
ROWS = [
    req(0, list(range(300, 307))),  # 7 tokens
    req(1, A1),
    req(2, B1),
    req(3, list(range(400, 412))),  # 12 tokens
    req(4, A2),
    req(5, list(range(600, 603))),  # 3 tokens: no full block
    req(6, B2),
    req(7, A3),
    req(8, list(range(500, 505))),  # 5 tokens
]


def seqs(requests: list[Request]) -> list[int]:
    return [r.seq for r in requests]


def test_groups_share_a_first_block_and_the_longest_leads() -> None:
    groups = prefix_groups(ROWS, BLOCK)
    # in the order of each group's first row; leader = the longest (A2: 14 tokens, B1: 9)
    assert [seqs(g) for g in groups] == [[0], [4, 1, 7], [2, 6], [3], [5], [8]]


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # groups by their leader's length, longest first: A (14), 400.. (12), B (9), 300.. (7), 500.. (5), 600.. (3)
        ("descending", [4, 1, 7, 3, 2, 6, 0, 8, 5]),
        ("ascending", [5, 8, 0, 2, 6, 3, 4, 1, 7]),
        ("arrival", [0, 4, 1, 7, 2, 6, 3, 5, 8]),
    ],
)
def test_the_planner_feeds_each_group_together_leader_first(order: str, expected: list[int]) -> None:
    planner = Planner(None, PlanSettings(order=order), max_model_len=1000, block_tokens=BLOCK)  # type: ignore[arg-type]
    assert seqs(planner.order(ROWS)) == expected


@pytest.mark.parametrize("order", ["descending", "ascending", "arrival"])
def test_rows_without_a_shared_block_keep_the_plain_order(order: str) -> None:
    singles = [r for r in ROWS if r.seq in (0, 3, 5, 8)]
    planner = Planner(None, PlanSettings(order=order), max_model_len=1000, block_tokens=BLOCK)  # type: ignore[arg-type]
    assert seqs(planner.order(singles)) == seqs(order_for_feed(singles, order))
    # and within the mixed window, the single rows come in the plain order relative to each other
    mixed = [s for s in seqs(planner.order(ROWS)) if s in (0, 3, 5, 8)]
    assert mixed == seqs(order_for_feed(singles, order))


def test_prefix_aware_off_or_no_prefix_cache_is_the_plain_order() -> None:
    off = Planner(None, PlanSettings(prefix_aware=False), max_model_len=1000, block_tokens=BLOCK)  # type: ignore[arg-type]
    no_cache = Planner(None, PlanSettings(), max_model_len=1000, block_tokens=None)  # type: ignore[arg-type]
    plain = seqs(order_for_feed(ROWS, "descending"))
    assert seqs(off.order(ROWS)) == plain
    assert seqs(no_cache.order(ROWS)) == plain
    assert off.prefix is not None and no_cache.prefix is None  # the estimate is kept either way


def test_shared_blocks_counts_whole_equal_blocks_and_leaves_the_last_token() -> None:
    assert shared_blocks(A2, A1, BLOCK) == 1  # A1 is 6 tokens: block 0 equal, block 1 incomplete
    assert shared_blocks(A2, A3, BLOCK) == 2  # 10 tokens: blocks 0 and 1 (8 tokens), 2 tokens left
    assert shared_blocks(A2, list(range(100, 108)), BLOCK) == 1  # 8 tokens: the last must be computed
    assert shared_blocks(A2, [*range(100, 105), 0, 0, 0, 0, 0], BLOCK) == 1  # differs inside block 1
    assert shared_blocks(A2, [0, *range(101, 114)], BLOCK) == 0


def test_the_estimate_sums_the_siblings_shared_blocks() -> None:
    stats = PrefixStats(BLOCK)
    stats.add_groups(prefix_groups(ROWS, BLOCK))
    report = stats.to_report()
    # A: A1 shares 1 block, A3 2 blocks -> 12 tokens; B: B2 (5 tokens) shares 1 block -> 4 tokens
    assert report["shareable_tokens"] == 16
    assert (report["groups"], report["rows_in_groups"]) == (2, 5)
    total = sum(len(r.prompt_token_ids or ()) for r in ROWS)
    assert report["prompt_tokens"] == total == 71
    assert report["shareable_share"] == pytest.approx(16 / 71)


def test_the_block_size_comes_from_an_engine_with_its_prefix_cache_on() -> None:
    assert prefix_block_tokens({"block_size": 128, "enable_prefix_caching": True}) == 128
    assert prefix_block_tokens({"block_size": 128, "enable_prefix_caching": False}) is None
    assert prefix_block_tokens({"fake": True}) is None
