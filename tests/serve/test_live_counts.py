"""Progress of a running batch: the run's observer (rows finished, their
completion tokens, engine ready) counted and written to the store as the
live ``request_counts`` and completion tokens/s; a run tells its observer
every row once, resumed ones included; the published files counted for a
cancelled batch."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.errors import Interrupted
from bulkinfer.io.output_files import OutputFiles, Published, RunPaths
from bulkinfer.jobs.context import RunContext, RunObserver
from bulkinfer.jobs.run import run
from bulkinfer.serve.progress import LiveCounts
from bulkinfer.serve.store import Store
from bulkinfer.stop import StopToken


def test_live_counts_write_counts_and_the_completion_tokens_per_s_of_this_attempt(tmp_path: Path) -> None:
    store = Store(tmp_path)
    batch = store.add_batch("alice", "file-x", "/v1/chat/completions", "24h", None, "tiny")
    now = [90.0]
    live = LiveCounts(store, batch["id"], total=5, clock=lambda: now[0])
    live.started(resumed_completed=1, resumed_failed=0)  # an earlier attempt's row
    now[0] = 100.0
    live.engine_ready()  # the 10 s of model load are not counted
    live.rows_finished(completed=2, failed=0, completion_tokens=10)
    live.rows_finished(completed=0, failed=1, completion_tokens=0)
    now[0] = 104.0
    live.tick()
    found = store.batch("alice", batch["id"])
    assert found is not None
    assert found["request_counts"] == {"total": 5, "completed": 3, "failed": 1}
    assert found["throughput"] == {"completion_tokens_per_s": 2.5, "measured": "live"}  # 10 tokens / 4 s
    store.close()


class Recorder(RunObserver):
    """Every event a run tells, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def started(self, resumed_completed: int, resumed_failed: int) -> None:
        self.events.append(("started", resumed_completed, resumed_failed))

    def engine_ready(self) -> None:
        self.events.append(("engine_ready",))

    def rows_finished(self, completed: int, failed: int, completion_tokens: int) -> None:
        self.events.append(("rows", completed, failed, completion_tokens))

    def finished(self, report: dict[str, Any]) -> None:
        self.events.append(("finished", report["request_counts"]["completed"], report["request_counts"]["failed"]))

    def rows(self) -> tuple[int, int, int]:
        found = [e[1:] for e in self.events if e[0] == "rows"]
        return tuple(sum(column) for column in zip(*found, strict=True)) if found else (0, 0, 0)  # type: ignore[return-value]


def test_a_run_tells_its_observer_every_row_once_with_its_tokens_also_across_a_resume(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    lines = [{"id": f"r{i}", "prompt": "x" * (i + 1)} for i in range(12)] + [{"id": "bad", "prompt": 7}]
    src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in lines))
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    settings = load_settings(None, {"plan.max_in_flight": 2})
    first, stop = Recorder(), StopToken()
    context = RunContext(engine_factory=lambda m, s: FakeEngine(stop_at=(5, stop)), stop=stop, observer=first)
    with pytest.raises(Interrupted):  # the stop token is set after the engine's 5th step
        run(paths, settings, context)
    assert first.events[:2] == [("started", 0, 0), ("engine_ready",)]
    done_first = first.rows()
    assert done_first[0] >= 5 and done_first[1] == 1  # the bad row fails before the engine
    second = Recorder()
    result = run(paths, settings, RunContext(resume=True, engine_factory=lambda m, s: FakeEngine(), observer=second))
    assert second.events[0] == ("started", done_first[0], done_first[1])
    assert second.events[-1] == ("finished", 12, 1)
    completed, failed, tokens = second.rows()
    assert (done_first[0] + completed, done_first[1] + failed) == (12, 1)  # every row told once
    records = [orjson.loads(line) for line in paths.output.read_bytes().splitlines()]
    told = first.rows()[2] + tokens
    assert told == sum(r["completion_tokens"] for r in records)
    assert result.report["request_counts"]["completed"] == 12


def test_published_counts_the_rows_and_tokens_of_the_published_files(tmp_path: Path) -> None:
    files = OutputFiles(tmp_path / "output.jsonl")
    assert files.published() == Published(0, 0, 0, 0)  # nothing published yet
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    row = {"custom_id": "a", "response": {"body": {"choices": [{"message": {"content": "x"}}], "usage": usage}}}
    files.out.write_bytes(orjson.dumps(row) + b"\n" + orjson.dumps({**row, "custom_id": "b"}) + b"\n")
    files.errors.write_bytes(orjson.dumps({"custom_id": "c", "error": {"message": "no"}}) + b"\n")
    published = files.published()
    assert (published.completed, published.failed) == (2, 1)
    assert (published.prompt_tokens, published.completion_tokens) == (10, 4)


def test_live_counts_go_on_after_a_write_that_failed(tmp_path: Path) -> None:
    """A full disk for a moment: the thread that writes the counts each second lives on."""
    from fakes import wait_for

    from bulkinfer.serve.progress import LiveCounts
    from bulkinfer.serve.store import Store

    store = Store(tmp_path)
    batch = store.add_batch("alice", "file-x", "/v1/completions", "24h", None)
    update, failures = store.update, [2]

    def flaky(batch_id: str, **fields: Any) -> None:
        if failures[0]:
            failures[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        update(batch_id, **fields)

    store.update = flaky  # type: ignore[method-assign]
    live = LiveCounts(store, batch["id"], 5, interval=0.02)
    live.start()
    live.rows_finished(3, 1, 30)
    wait_for(lambda: (store.batch(None, batch["id"]) or {})["request_counts"]["completed"] == 3, timeout=10)
    live.finish()
    store.close()
