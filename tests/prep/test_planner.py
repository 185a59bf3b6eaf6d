"""Tests of bulkinfer.prep.planner: buckets, padding accounting and feed order.

A tiny fake tokenizer stands in for the model's: this is planning logic only
(the real tokenizer and chat template are exercised end to end).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from bulkinfer.config import DEFAULT_BUCKETS, PlanSettings, SamplingDefaults
from bulkinfer.prep.planner import (
    PaddingStats,
    Planner,
    bucket_index,
    bucket_label,
    efficiency,
    order_for_feed,
    static_batch_tokens,
)
from bulkinfer.prep.rows import parse_row
from bulkinfer.schema import CHAT_URL, Request

# --- buckets --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "index", "label"),
    [
        (1, 0, "1-16"),
        (16, 0, "1-16"),
        (17, 1, "17-32"),
        (32, 1, "17-32"),
        (33, 2, "33-64"),
        (4096, 8, "2049-4096"),
        (8192, 9, "4097-8192"),
        (8193, 10, "8193+"),
        (100_000, 10, "8193+"),
    ],
)
def test_bucket_index_and_label_at_boundaries(tokens: int, index: int, label: str) -> None:
    assert bucket_index(tokens, DEFAULT_BUCKETS) == index
    assert bucket_label(index, DEFAULT_BUCKETS) == label


def test_bucket_labels_with_custom_bounds() -> None:
    bounds = (4, 8)
    assert [bucket_label(i, bounds) for i in range(3)] == ["1-4", "5-8", "9+"]
    assert [bucket_index(n, bounds) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_static_batch_tokens_hand_computed() -> None:
    # B=2: [3, 10] -> 2x10, [2, 7] -> 2x7, [5] -> 1x5
    assert static_batch_tokens([3, 10, 2, 7, 5], 2) == (27, 20 + 14 + 5)
    # B=3: [4, 1, 1] -> 3x4, [9] -> 9
    assert static_batch_tokens([4, 1, 1, 9], 3) == (15, 12 + 9)
    assert static_batch_tokens([], 4) == (0, 0)
    assert static_batch_tokens([5, 5, 5], 1) == (15, 15)


def test_efficiency() -> None:
    assert efficiency(27, 39) == pytest.approx(27 / 39)
    assert efficiency(0, 0) == 1.0


# --- padding statistics ---------------------------------------------------------------------------


def naive_padded(lengths: list[int], batch_size: int) -> int:
    """Padded positions of static batches cut in the given order (written independently)."""
    total = 0
    i = 0
    while i < len(lengths):
        batch = lengths[i : i + batch_size]
        total += max(batch) * len(batch)
        i += batch_size
    return total


def naive_sorted_buckets(windows: list[list[int]], bounds: tuple[int, ...], batch_size: int) -> dict[str, list[int]]:
    """label -> [rows, real, padded]: each window sorted, split by bucket, batched within the bucket."""
    out: dict[str, list[int]] = {}
    edges = [0, *bounds, float("inf")]
    for window in windows:
        for k in range(len(edges) - 1):
            low, high = edges[k], edges[k + 1]
            members = sorted((n for n in window if low < n <= high), reverse=True)  # longest first, as fed
            if not members:
                continue
            label = f"{low + 1}+" if high == float("inf") else f"{low + 1}-{high}"
            acc = out.setdefault(label, [0, 0, 0])
            acc[0] += len(members)
            acc[1] += sum(members)
            acc[2] += naive_padded(members, batch_size)
    return out


def test_arrival_batches_span_windows() -> None:
    one = PaddingStats((4, 8), 2)
    one.add_window([5, 1, 3, 8, 2, 2, 7])
    one.finish()
    two = PaddingStats((4, 8), 2)
    two.add_window([5, 1, 3])  # 3 is not a multiple of B: [3] waits for the next window
    two.add_window([8, 2, 2, 7])
    two.finish()
    # [5, 1] -> 10, [3, 8] -> 16, [2, 2] -> 4, [7] -> 7
    assert (one.arrival_real, one.arrival_padded) == (28, 37)
    assert (two.arrival_real, two.arrival_padded) == (28, 37)


def test_arrival_totals_random_windows_match_one_call() -> None:
    rng = random.Random(1234)
    lengths = [rng.randint(1, 300) for _ in range(257)]
    cuts = sorted(rng.sample(range(1, len(lengths)), 6))
    windows = [lengths[a:b] for a, b in zip([0, *cuts], [*cuts, len(lengths)], strict=True)]
    assert any(len(w) % 5 for w in windows)
    split = PaddingStats(DEFAULT_BUCKETS, 5)
    for w in windows:
        split.add_window(w)
    split.finish()
    whole = PaddingStats(DEFAULT_BUCKETS, 5)
    whole.add_window(lengths)
    whole.finish()
    assert (split.arrival_real, split.arrival_padded) == (whole.arrival_real, whole.arrival_padded)
    assert split.arrival_real == sum(lengths)
    assert split.arrival_padded == naive_padded(lengths, 5)


def test_partial_arrival_batch_waits_for_finish() -> None:
    stats = PaddingStats((4, 8), 4)
    stats.add_window([1, 2, 3, 4, 9])
    assert (stats.arrival_real, stats.arrival_padded) == (10, 16)
    stats.finish()
    assert (stats.arrival_real, stats.arrival_padded) == (19, 25)
    stats.finish()  # idempotent
    assert (stats.arrival_real, stats.arrival_padded) == (19, 25)


def test_sorted_bucket_numbers_hand_computed() -> None:
    stats = PaddingStats((4, 8), 2)
    stats.add_window([1, 9, 3, 5, 12, 2, 6, 4, 8, 7])
    stats.finish()
    report = stats.to_report()
    rows = {b["range"]: (b["rows"], b["real_tokens"], b["padded_tokens"]) for b in report["buckets"]}
    # 1-4: [1,2] [3,4] -> 4 + 8; 5-8: [5,6] [7,8] -> 12 + 16; 9+: [9,12] -> 24
    assert rows == {"1-4": (4, 10, 12), "5-8": (4, 26, 28), "9+": (2, 21, 24)}
    assert report["padding_efficiency"]["sorted"] == pytest.approx(57 / 64)
    # arrival: [1,9] [3,5] [12,2] [6,4] [8,7] -> 18 + 10 + 24 + 12 + 16
    assert report["padding_efficiency"]["arrival"] == pytest.approx(57 / 80)


def test_sorted_bucket_numbers_against_naive_computation() -> None:
    rng = random.Random(99)
    bounds = (16, 32, 64, 128)
    windows = [[rng.choice([rng.randint(1, 20), rng.randint(1, 200)]) for _ in range(n)] for n in (37, 50, 3, 21)]
    stats = PaddingStats(bounds, 4)
    for w in windows:
        stats.add_window(w)
    stats.finish()
    report = stats.to_report()
    got = {b["range"]: [b["rows"], b["real_tokens"], b["padded_tokens"]] for b in report["buckets"]}
    expected = naive_sorted_buckets(windows, bounds, 4)
    assert got == expected
    # buckets are listed shortest first
    order = ["1-16", "17-32", "33-64", "65-128", "129+"]
    assert [b["range"] for b in report["buckets"]] == [r for r in order if r in expected]
    for b in report["buckets"]:
        assert b["padding_efficiency"] == pytest.approx(b["real_tokens"] / b["padded_tokens"])
    real = sum(v[1] for v in expected.values())
    padded = sum(v[2] for v in expected.values())
    assert report["padding_efficiency"]["sorted"] == pytest.approx(real / padded)
    flat = [n for w in windows for n in w]
    assert report["padding_efficiency"]["arrival"] == pytest.approx(sum(flat) / naive_padded(flat, 4))


def test_to_report_keys() -> None:
    stats = PaddingStats((4,), 3)
    empty = stats.to_report()
    assert empty == {"buckets": [], "padding_efficiency": {"batch_size": 3, "arrival": 1.0, "sorted": 1.0}}
    stats.add_window([2, 6])
    stats.finish()
    report = stats.to_report()
    assert set(report) == {"buckets", "padding_efficiency"}
    assert set(report["padding_efficiency"]) == {"batch_size", "arrival", "sorted"}
    assert set(report["buckets"][0]) == {"range", "rows", "real_tokens", "padded_tokens", "padding_efficiency"}


# --- Planner with a fake tokenizer ----------------------------------------------------------------


class FakeTokenizer:
    """One token per whitespace-separated word, plus one BOS with special tokens.

    The chat template prefixes each message with a role marker word and ends
    with an assistant marker; content containing "BOOM" makes it raise.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], bool]] = []

    def __call__(self, texts: list[str], add_special_tokens: bool) -> dict[str, Any]:
        self.calls.append((list(texts), add_special_tokens))
        ids = []
        for text in texts:
            words = [100 + len(w) for w in text.split()]
            ids.append(([1] if add_special_tokens else []) + words)
        return {"input_ids": ids}

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        parts = []
        for m in messages:
            if "BOOM" in m["content"]:
                raise ValueError("template exploded")
            parts.append(f"<|{m['role']}|> {m['content']}")
        return " ".join(parts) + " <|assistant|>"


DEFAULTS = SamplingDefaults(max_tokens=4)


def prompt_row(seq: int, words: int, **extra: Any) -> Request:
    return parse_row({"id": f"r{seq}", "prompt": " ".join(["w"] * words), **extra}, seq, seq + 1, DEFAULTS)


def chat_row(seq: int, content: str, **extra: Any) -> Request:
    return parse_row(
        {"id": f"r{seq}", "messages": [{"role": "user", "content": content}], **extra}, seq, seq + 1, DEFAULTS
    )


def planner(
    order: str = "descending", max_model_len: int = 1000, bounds: tuple[int, ...] = (4, 8), batch_size: int = 2
) -> tuple[Planner, FakeTokenizer]:
    tok = FakeTokenizer()
    return Planner(
        tok,
        PlanSettings(buckets=bounds, order=order, padding_batch_size=batch_size),  # type: ignore[arg-type]
        max_model_len,
    ), tok


def window() -> list[Request]:
    # prompt tokens (words + BOS): 4, 2, 4, 6, 2
    return [prompt_row(0, 3), prompt_row(1, 1), prompt_row(2, 3), prompt_row(3, 5), prompt_row(4, 1)]


def test_token_ids_set_and_text_dropped() -> None:
    plan, tok = planner("arrival")
    fed, errors = plan.plan_window(window())
    assert errors == []
    assert [len(r.prompt_token_ids or []) for r in fed] == [4, 2, 4, 6, 2]
    assert fed[0].prompt_token_ids == [1, 101, 101, 101]
    assert all(r.prompt is None and r.messages is None for r in fed)
    assert tok.calls == [(["w w w", "w", "w w w", "w w w w w", "w"], True)]


@pytest.mark.parametrize(
    ("order", "ids"),
    [
        ("descending", ["r3", "r0", "r2", "r1", "r4"]),
        ("ascending", ["r1", "r4", "r0", "r2", "r3"]),
        ("arrival", ["r0", "r1", "r2", "r3", "r4"]),
    ],
)
def test_feed_order_is_stable(order: str, ids: list[str]) -> None:
    plan, _ = planner(order)
    fed, errors = plan.plan_window(window())
    assert errors == []
    assert [r.id for r in fed] == ids


def test_chat_rows_get_the_template_and_no_special_tokens() -> None:
    plan, tok = planner("arrival")
    rows = [prompt_row(0, 2), chat_row(1, "a b c"), prompt_row(2, 1)]
    fed, errors = plan.plan_window(rows)
    assert errors == []
    # arrival order survives the split into plain and chat groups
    assert [r.id for r in fed] == ["r0", "r1", "r2"]
    # "<|user|> a b c <|assistant|>" = 5 words, no BOS
    assert [len(r.prompt_token_ids or []) for r in fed] == [3, 5, 2]
    assert (["<|user|> a b c <|assistant|>"], False) in tok.calls
    assert (["w w", "w"], True) in tok.calls


def test_context_length_exceeded() -> None:
    plan, _ = planner("arrival", max_model_len=10)
    rows = [
        prompt_row(0, 5, max_tokens=5),  # 6 + 5 = 11 > 10
        prompt_row(1, 5),  # 6 + 4 = 10: fits exactly
        chat_row(2, "x " * 8, max_tokens=1),  # 10 + 1 = 11 > 10
    ]
    fed, errors = plan.plan_window(rows)
    assert [r.id for r in fed] == ["r1"]
    assert [(e.line, e.id, e.type) for e in errors] == [
        (1, "r0", "context_length_exceeded"),
        (3, "r2", "context_length_exceeded"),
    ]
    assert "6 tokens" in errors[0].message
    assert "max_tokens is 5" in errors[0].message
    assert "11 > " in errors[0].message and "10 tokens" in errors[0].message
    assert "10 tokens" in errors[1].message and "max_tokens is 1" in errors[1].message
    assert errors[0].openai is False


def test_template_error_is_invalid_field() -> None:
    plan, _ = planner("arrival")
    line = {"custom_id": "c9", "url": CHAT_URL, "body": {"messages": [{"role": "user", "content": "BOOM"}]}}
    openai = parse_row(line, 3, 4, DEFAULTS)
    rows = [chat_row(0, "fine"), chat_row(1, "BOOM now"), prompt_row(2, 1), openai]
    fed, errors = plan.plan_window(rows)
    assert [r.id for r in fed] == ["r0", "r2"]
    assert [(e.line, e.id, e.type, e.openai) for e in errors] == [
        (2, "r1", "invalid_field", False),
        (4, "c9", "invalid_field", True),
    ]
    assert "messages" in errors[0].message and "template exploded" in errors[0].message


def test_padding_stats_count_planned_rows_only() -> None:
    plan, _ = planner("descending", max_model_len=8, bounds=(4, 8), batch_size=2)
    rows = [
        prompt_row(0, 3),  # 4 tokens
        prompt_row(1, 6),  # 7 + 4 > 8: error
        chat_row(2, "BOOM"),  # template error
        prompt_row(3, 1),  # 2 tokens
        prompt_row(4, 2),  # 3 tokens
    ]
    fed, errors = plan.plan_window(rows)
    assert len(errors) == 2
    assert [len(r.prompt_token_ids or []) for r in fed] == [4, 3, 2]
    plan.padding.finish()
    report = plan.padding.to_report()
    # arrival over planned rows only: [4, 2] -> 8, [3] -> 3
    assert (plan.padding.arrival_real, plan.padding.arrival_padded) == (9, 11)
    # sorted: bucket 1-4 holds [2, 3, 4] -> [2,3] -> 6, [4] -> 4
    assert report["buckets"] == [
        {"range": "1-4", "rows": 3, "real_tokens": 9, "padded_tokens": 10, "padding_efficiency": pytest.approx(0.9)}
    ]


def test_two_windows_accumulate() -> None:
    plan, _ = planner("ascending", bounds=(4, 8), batch_size=2)
    first, _ = plan.plan_window([prompt_row(0, 3), prompt_row(1, 9), prompt_row(2, 1)])
    second, _ = plan.plan_window([prompt_row(3, 4), prompt_row(4, 2)])
    assert [r.id for r in first] == ["r2", "r0", "r1"]
    assert [r.id for r in second] == ["r4", "r3"]
    plan.padding.finish()
    # arrival 4, 10, 2, 5, 3: [4,10] -> 20, [2,5] -> 10, [3] -> 3
    assert (plan.padding.arrival_real, plan.padding.arrival_padded) == (24, 33)
    rows = {b["range"]: b["rows"] for b in plan.padding.to_report()["buckets"]}
    assert rows == {"1-4": 3, "5-8": 1, "9+": 1}


def test_order_for_feed_without_token_ids_keeps_arrival_for_ties() -> None:
    rows = window()
    assert [r.id for r in order_for_feed(rows, "descending")] == [r.id for r in rows]


def test_pass_through_fields_are_counted_and_near_misses_and_replaced_ones_flagged() -> None:
    plan, _ = planner()
    rows = [prompt_row(i, 2, lang="en", source="web") for i in range(3)]
    rows += [prompt_row(3, 2, lang="fr", source="web", max_token=5), prompt_row(4, 2, temprature=0.1)]
    rows += [prompt_row(5, 2, completion="an earlier run's", finish_reason="stop")]  # an output fed back in
    plan.plan_window(rows)
    assert plan.passthrough_fields() == [
        {"name": "lang", "rows": 4, "did_you_mean": None, "replaced": False},
        {"name": "source", "rows": 4, "did_you_mean": None, "replaced": False},
        {"name": "completion", "rows": 1, "did_you_mean": None, "replaced": True},
        {"name": "finish_reason", "rows": 1, "did_you_mean": None, "replaced": True},
        {"name": "max_token", "rows": 1, "did_you_mean": "max_tokens", "replaced": False},
        {"name": "temprature", "rows": 1, "did_you_mean": "temperature", "replaced": False},
    ]
