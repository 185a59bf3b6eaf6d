"""The report's prefix-cache hit rate: vLLM's ``num_cached_tokens`` of each
finished request (taken from its last streamed output) summed over the
prompt tokens of the rows this run finished, with the planner's estimate of
the shareable tokens and the feed used; the terminal summary prints it."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
from fakes import FakeEngine
from rich.console import Console

from bulkinfer.config import load_settings
from bulkinfer.engine.sampling import StreamedOutputs
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.report.terminal import print_summary
from bulkinfer.schema import Completion

BLOCK = 4


class CachingEngine(FakeEngine):
    """Says its prefix cache is on with blocks of 4 tokens; reports every
    request but the first it finishes as cached in all its whole blocks
    short of its last token, and keeps the sum."""

    settings: dict[str, Any] = {"block_size": BLOCK, "enable_prefix_caching": True}

    def __init__(self) -> None:
        super().__init__()
        self.finished = 0
        self.cached_total = 0
        self.fed: list[str] = []

    def add(self, request_id: str, request: Any) -> Completion | None:
        self.fed.append(request.id)
        return super().add(request_id, request)

    def step(self, wait: float | None = None) -> list[Completion]:
        done = []
        for c in super().step(wait):
            self.finished += 1
            cached = (c.prompt_tokens - 1) // BLOCK * BLOCK if self.finished > 1 else 0
            self.cached_total += cached
            done.append(Completion(c.request_id, c.text, c.finish_reason, c.prompt_tokens, 1, cached_tokens=cached))
        return done


def test_the_hit_rate_is_cached_over_prompt_tokens_of_the_finished_rows(tmp_path: Path) -> None:
    # raw prompts through the default model's tokenizer: six share a first block (4 tokens)
    system = "You are a careful assistant who answers in one short sentence. " * 3
    rows = [{"id": f"r{i}", "prompt": system + f"Question number {i}: what is {i} plus {i}?"} for i in range(6)]
    rows.append({"id": "other", "prompt": "Hi"})
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    engine = CachingEngine()
    settings = load_settings(overrides={"apply_chat_template": False, "sampling.max_tokens": 1})
    report = run(
        RunPaths.build(src, tmp_path / "out.jsonl"), settings, RunContext(engine_factory=lambda m, s: engine)
    ).report
    cache = report["prefix_cache"]
    prompt = report["tokens"]["prompt"]
    outputs = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    lengths = sorted(o["prompt_tokens"] for o in outputs)
    assert prompt == sum(lengths) == cache["prompt_tokens"]
    assert cache["cached_tokens"] == engine.cached_total > 0
    assert cache["hit_rate"] == engine.cached_total / prompt < 1
    assert report["plan"]["prefix_aware"] is True
    # the six rows sharing the system prompt (all as long) fed together, the first of them leading
    assert engine.fed == [*(f"r{i}" for i in range(6)), "other"]
    estimate = cache["estimate"]
    assert estimate["block_tokens"] == BLOCK and estimate["groups"] == 1 and estimate["rows_in_groups"] == 6
    assert 0 < estimate["shareable_tokens"] < prompt
    console = Console(file=io.StringIO(), width=200)
    print_summary(report, console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"{100 * cache['hit_rate']:.1f}% of prompt tokens ({cache['cached_tokens']}; prefix-aware feed)" in text


def test_cached_tokens_come_from_the_finished_output() -> None:
    streamed = StreamedOutputs()
    piece = SimpleNamespace(index=0, text="x", token_ids=[5], logprobs=None, finish_reason=None)
    last = SimpleNamespace(index=0, text="y", token_ids=[6], logprobs=None, finish_reason="length")

    def out(p: SimpleNamespace, finished: bool) -> SimpleNamespace:
        return SimpleNamespace(
            request_id="r", outputs=[p], finished=finished, prompt_token_ids=list(range(300)), num_cached_tokens=256
        )

    assert streamed.completions([out(piece, False)]) == []
    # the live counts (the ETA's step model prices the prompt tokens computed) move at the first output, once
    assert (streamed.prefilled_tokens, streamed.cached_tokens) == (300, 256)
    (done,) = streamed.completions([out(last, True)])
    assert (done.cached_tokens, done.prompt_tokens, done.completion_tokens) == (256, 300, 2)
    assert (streamed.prefilled_tokens, streamed.cached_tokens) == (300, 256)
