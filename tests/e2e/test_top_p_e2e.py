"""End to end: nucleus sampling (``top_p`` < 1) through bulkinfer's nucleus
processor samples what vLLM's own sort samples.

Two CLI runs of the same sampled rows (temperature 0.8, ``top_p`` 0.9, the
same engine seed), float32 (bfloat16 logits tie at the nucleus's edge, and
either sampler keeps an arbitrary one of two equal tokens: see
tests/engine/test_nucleus.py), one with ``top_p_sampler = "vllm"``: the
completions must be the same, token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import SAMPLE, bulkinfer, read_jsonl, read_report, write_jsonl

from bulkinfer.engine.sampling import NUCLEUS_PROCESSOR

pytestmark = pytest.mark.e2e


def test_the_nucleus_processor_samples_the_tokens_vllms_sort_samples(tmp_path: Path) -> None:
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in read_jsonl(SAMPLE / "sharegpt.jsonl")[:12]]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, rows)
    flags = ["--dtype", "float32", "--temperature", "0.8", "--top-p", "0.9", "--max-tokens", "32", "--ignore-eos"]
    completions, processors = {}, {}
    for sampler in ("auto", "vllm"):
        out = tmp_path / f"{sampler}.jsonl"
        proc = bulkinfer("run", str(src), "-o", str(out), *flags, "--top-p-sampler", sampler)
        assert proc.returncode == 0, proc.stderr[-3000:]
        completions[sampler] = {r["id"]: r["completion"] for r in read_jsonl(out)}
        processors[sampler] = read_report(out.with_name(f"{sampler}.report.json"))["engine"].get("logits_processors")
    assert processors == {"auto": [NUCLEUS_PROCESSOR], "vllm": None}
    assert len(completions["auto"]) == len(rows)
    # vLLM's run applied top_p 0.9 itself; had the processor not (vLLM sees top_p 1.0 in that run), a token
    # outside the nucleus (about one in ten at temperature 0.8) would have parted the runs within 384 tokens
    assert completions["auto"] == completions["vllm"]
