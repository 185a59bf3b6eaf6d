"""``bulkinfer run -`` orchestration with a fake engine: windows planned when
full, when their oldest row has waited ``max_wait_s`` or when the stream
ends, PENDING in between; the feed loop steps and waits through PENDING;
every row of a stream ends as one record (output or error) on the output,
in completion order, written while the stream is still open; --resume and a
Parquet output refused. tests/e2e/test_stream_e2e.py runs the real engine."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.engine.feed import PENDING, feed
from bulkinfer.errors import ConfigError, OutputExistsError
from bulkinfer.io.readers import RawRow
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.stream import StreamPaths, stream, stream_requests
from bulkinfer.schema import Request, RowError


class Rows:
    """A RowQueue stand-in: rows handed in by the test, ``ended`` when it says."""

    def __init__(self) -> None:
        self.items: list[RawRow] = []
        self.ended = False

    def get(self) -> RawRow | None:
        return self.items.pop(0) if self.items else None


class Planner:
    """Plans a window as it is (the real planner is tested elsewhere)."""

    windows: list[int]

    def __init__(self) -> None:
        self.windows = []

    def plan_window(self, window: list[Request]) -> tuple[list[Request], list[RowError]]:
        self.windows.append(len(window))
        return window, []


def settings(**plan: Any) -> Any:
    """The defaults with these ``[plan]`` settings, prompts sent raw (no tokenizer here)."""
    return load_settings(None, {f"plan.{k}": v for k, v in plan.items()}).resolve_chat_template(None)


def row(line: int) -> RawRow:
    return RawRow(line, data={"id": f"r{line}", "prompt": f"question {line}"})


def test_a_window_goes_when_full_when_its_oldest_row_waited_or_at_the_end() -> None:
    rows, planner, now, errors = Rows(), Planner(), [0.0], []
    requests = stream_requests(
        rows, settings(window_rows=3, max_wait_s=2.0), planner, errors.append, lambda r: None, lambda: now[0]
    )
    assert next(requests) is PENDING  # nothing arrived
    rows.items += [row(1), row(2), row(3), row(4)]
    assert [next(requests).id for _ in range(3)] == ["r1", "r2", "r3"]  # full: planned at once
    assert next(requests) is PENDING and planner.windows == [3]  # r4 waits for company
    now[0] = 1.9
    assert next(requests) is PENDING
    now[0] = 2.0
    assert next(requests).id == "r4" and planner.windows == [3, 1]  # its oldest row waited max_wait_s
    rows.items += [row(5), RawRow(6, data={"id": "bad", "prompt": ""})]
    rows.ended = True
    assert [r.id for r in requests] == ["r5"]  # the end plans what is left, then the requests end
    assert [e.id for e in errors] == ["bad"] and planner.windows == [3, 1, 1]


def test_the_feed_loop_steps_and_waits_through_pending() -> None:
    engine = FakeEngine()
    pending = iter([PENDING, PENDING])
    done: list[str] = []

    def requests() -> Any:
        yield from pending
        for k in range(3):
            yield Request(seq=k, line=k + 1, id=f"r{k}", prompt="p", messages=None, max_tokens=4, temperature=0.0,
                          top_p=1.0, seed=None, stop=(), prompt_token_ids=[1, 2, 3])  # fmt: skip
            yield PENDING

    feed(engine, requests(), max_in_flight=2, on_finished=lambda r, c: done.append(r.id), on_failed=lambda r, m: None)
    assert done == ["r0", "r1", "r2"]


def test_every_row_of_a_stream_ends_as_one_record_written_while_the_stream_is_open(tmp_path: Path) -> None:
    read, write = os.pipe()
    source = os.fdopen(read, "rb")
    out = tmp_path / "out.jsonl"
    seen_early: list[int] = []

    def produce() -> None:
        with os.fdopen(write, "wb") as sink:
            for k in range(6):
                sink.write(orjson.dumps({"id": f"r{k}", "prompt": f"question {k}"}) + b"\n")
            sink.write(b"not json\n")
            sink.flush()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (out.exists() and out.read_bytes().count(b"\n") >= 6):
                time.sleep(0.05)
            seen_early.append(out.read_bytes().count(b"\n") if out.exists() else 0)
            sink.write(orjson.dumps({"id": "last", "prompt": "late question"}) + b"\n")

    producer = threading.Thread(target=produce)
    producer.start()
    context = RunContext(engine_factory=lambda m, s: FakeEngine(), progress_plain=True)
    result = stream(source, StreamPaths.build(out), settings(max_wait_s=0.1), context)
    producer.join()
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert seen_early == [7]  # six outputs and the bad line's error before the last row was written
    assert sorted(r["id"] or "" for r in records) == ["", "last", "r0", "r1", "r2", "r3", "r4", "r5"]
    assert [r["error"]["type"] for r in records if "error" in r] == ["invalid_json"]
    assert result.exit_code == 3 and result.report["request_counts"] == {"completed": 7, "failed": 1}
    assert result.report["windows"]["count"] >= 2 and result.report["output_order"] == "completion"
    assert orjson.loads((tmp_path / "out.report.json").read_bytes())["job"] == "stream"


def test_resume_and_a_parquet_output_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--resume is not offered for standard input"):
        stream(io.BytesIO(b""), StreamPaths.build(tmp_path / "o.jsonl"), settings(), RunContext(resume=True))
    with pytest.raises(ConfigError, match="give a .jsonl file or -"):
        StreamPaths.build(tmp_path / "o.parquet")
    (tmp_path / "o.jsonl").write_bytes(b"{}\n")
    with pytest.raises(OutputExistsError, match="use --overwrite"):
        stream(io.BytesIO(b""), StreamPaths.build(tmp_path / "o.jsonl"), settings(), RunContext())
