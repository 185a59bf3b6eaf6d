"""An OpenAI /v1/completions line whose ``prompt`` lists several prompts:
each prompt is its own engine request, and the line's one record holds every
prompt's choices, prompt j's n at indices j*n on, with usage summed, as
OpenAI's and vLLM's answer such a request (checked against the ``openai``
SDK's types). The engine is a fake that echoes each prompt's token ids;
tests/e2e/test_e2e.py runs the real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from fakes import FakeEngine
from reference_types import check_openai_line

from bulkinfer.config import load_settings
from bulkinfer.engine.feed import Join, joined
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.schema import Choice, Completion, Request

POISON = 999  # a part whose prompt holds this token fails in the engine


class Echo(FakeEngine):
    """Answers each request with its prompt's token ids as text, one completion token a prompt token."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[str] = []

    def add(self, request_id: str, request: Request) -> Any:
        self.added.append(request_id)
        return super().add(request_id, request)

    def step(self, wait: float | None = None) -> list[Completion]:
        done = []
        while self.queue:
            rid, req = self.queue.popleft()
            ids = req.prompt_token_ids or []
            if POISON in ids:
                done.append(Completion(rid, "", "error", len(ids), 0, "RuntimeError: boom"))
            else:
                done.append(Completion(rid, " ".join(map(str, ids)), "stop", len(ids), len(ids), cached_tokens=1))
        return done


def line(custom_id: str, prompt: Any, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "url": "/v1/completions", "body": {"model": "m", "prompt": prompt, **body}}


def test_each_prompt_runs_and_the_line_holds_all_their_choices_in_order(tmp_path: Path) -> None:
    long = list(range(5, 5 + FakeEngine.max_model_len))
    rows = [
        line("two", [[11, 12, 13], [21]], max_tokens=4),
        line("text-and-ids", ["hello", [31, 32]], max_tokens=4),
        line("too-long", [[1], long], max_tokens=4),
        line("poisoned", [[41], [POISON], [43]], max_tokens=4),
        {"id": "row", "prompt": ["a", "b"]},  # a bulkinfer row: one prompt, one record
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    engine, paths = Echo(), RunPaths.build(src, tmp_path / "out.jsonl")
    run(paths, load_settings(), RunContext(engine_factory=lambda model, settings: engine))
    outputs = {r["custom_id"]: r for r in map(orjson.loads, paths.output.read_bytes().splitlines())}
    errors = {r.get("custom_id") or r["id"]: r for r in map(orjson.loads, paths.errors.read_bytes().splitlines())}
    assert set(outputs) == {"two", "text-and-ids"} and set(errors) == {"too-long", "poisoned", "row"}
    for record in [*outputs.values(), *(errors[k] for k in ("too-long", "poisoned"))]:
        check_openai_line(record)
    body = outputs["two"]["response"]["body"]
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "11 12 13"), (1, "21")]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    mixed = outputs["text-and-ids"]["response"]["body"]["choices"]
    assert mixed[1]["text"] == "31 32" and mixed[0]["text"].replace(" ", "").isdigit()  # the text, tokenized
    assert "prompt[1]: prompt is" in errors["too-long"]["error"]["message"]  # nothing of it ran
    assert errors["poisoned"]["error"]["message"] == "prompt[1]: RuntimeError: boom"
    assert "a list of 2 prompts" in errors["row"]["error"]["message"]
    added = engine.added
    assert sorted(a for a in added if "." in a) == ["0.0", "0.1", "1.0", "1.1", "3.0", "3.1", "3.2"]
    report = orjson.loads(paths.report.read_bytes())
    assert report["request_counts"] == {"total": 5, "completed": 2, "failed": 3, "skipped": 0}


def test_joined_choices_take_each_prompts_n_in_turn_and_usage_sums() -> None:
    def part(rid: str, texts: list[str]) -> Completion:
        choices = tuple(Choice(i, t, "length", 2) for i, t in enumerate(texts))
        return Completion(rid, texts[0], "length", 3, 2 * len(texts), choices=choices, cached_tokens=2)

    one = joined([part("7.0", ["a0", "a1"]), part("7.1", ["b0", "b1"])])
    assert [(c.index, c.text) for c in one.choices] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert (one.request_id, one.text, one.prompt_tokens, one.completion_tokens, one.cached_tokens) == (
        "7",
        "a0",
        6,
        8,
        4,
    )


def test_a_join_ends_once_when_its_last_part_finishes_or_its_first_fails() -> None:
    def done(rid: str, text: str, error: str | None = None) -> Completion:
        return Completion(rid, text, "stop", 2, 1, error)

    join = Join(3)
    assert join.add(2, done("5.2", "c")) is None and join.add(0, done("5.0", "a")) is None  # out of order
    whole = join.add(1, done("5.1", "b"))
    assert whole is not None and [c.text for c in whole.choices] == ["a", "b", "c"] and whole.request_id == "5"
    assert join.add(1, done("5.1", "again")) is None  # after the end: dropped

    failing = Join(3)
    assert failing.add(0, done("6.0", "a")) is None
    failed = failing.add(2, done("6.2", "", "RuntimeError: boom"))
    assert failed is not None and failed.error == "prompt[2]: RuntimeError: boom"
    assert failing.add(1, done("6.1", "b")) is None and failing.add(2, done("6.2", "", "x")) is None
    assert Join(2).fail(1, "rejected by the engine") == "prompt[1]: rejected by the engine"
