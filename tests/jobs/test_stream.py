"""``bulkinfer run -`` orchestration with a fake engine: windows planned when
full, when their oldest row has waited ``max_wait_s`` or when the stream
ends, PENDING in between; the feed loop steps and waits through PENDING;
every row of a stream ends as one record (output or error) on the output,
in completion order, written while the stream is still open; input order
through the bounded reorder buffer; --resume by id to a file output; --resume
to standard output and a Parquet output refused. tests/e2e/test_stream_e2e.py runs the real engine."""

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

import bulkinfer
from bulkinfer.config import load_settings
from bulkinfer.engine.feed import PENDING, feed
from bulkinfer.errors import ConfigError, EngineError, Interrupted, LockHeldError, OutputExistsError, OutputWriteError
from bulkinfer.io.output_files import OutputFiles, RunPaths
from bulkinfer.io.readers import RawRow
from bulkinfer.io.stream_out import StreamWriter, done_ids
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.jobs.stream import KEEP_LOGS as STREAM_KEEP_LOGS
from bulkinfer.jobs.stream import StreamPaths, stream
from bulkinfer.jobs.stream_windows import stream_requests
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


def test_every_row_of_a_stream_ends_as_one_record_written_while_the_stream_is_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BULKINFER_HEAP", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
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
    assert result.exit_code == 3 and result.report["request_counts"] == {"completed": 7, "failed": 1, "resumed": 0}
    assert result.report["windows"]["count"] >= 2 and result.report["output_order"] == "completion"
    assert result.report["heap"] == "arenas"  # the default: glibc's arenas capped (bulkinfer/engine/heap.py)
    assert orjson.loads((tmp_path / "out.report.json").read_bytes())["job"] == "stream"


def test_resume_to_standard_output_an_errors_file_for_a_file_run_and_a_parquet_output_are_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="--resume is not offered for standard input to standard output"):
        stream(io.BytesIO(b""), StreamPaths.build(None), settings(), RunContext(resume=True))
    with pytest.raises(ConfigError, match="--errors is for a stream"):
        bulkinfer.run(tmp_path / "in.jsonl", errors_path=tmp_path / "e.jsonl")
    with pytest.raises(ConfigError, match="give a .jsonl file or -"):
        StreamPaths.build(tmp_path / "o.parquet")
    (tmp_path / "o.jsonl").write_bytes(b"{}\n")
    with pytest.raises(OutputExistsError, match="use --overwrite"):
        stream(io.BytesIO(b""), StreamPaths.build(tmp_path / "o.jsonl"), settings(), RunContext())


def test_a_stream_that_fails_before_its_first_record_leaves_no_file_its_retry_would_be_refused_for(
    tmp_path: Path,
) -> None:
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"

    def no_engine(model: str, settings: Any) -> Any:
        raise EngineError("the vLLM engine failed to start")

    context = RunContext(engine_factory=no_engine, progress_plain=True)
    for _ in range(2):  # the retry fails as the first attempt did, not for an output that exists
        with pytest.raises(EngineError, match="failed to start"):
            stream(io.BytesIO(b'{"prompt": "hi"}\n'), StreamPaths.build(out, errors), settings(), context)
        assert not out.exists() and not errors.exists()
    errors.write_bytes(b"")  # an errors file that exists: refused, and the output opened before it is not left
    with pytest.raises(OutputExistsError, match=f"output {errors} already exists"):
        stream(io.BytesIO(b""), StreamPaths.build(out, errors), settings(), context)
    assert not out.exists() and errors.exists()
    out.write_bytes(b"")  # a resumed stream keeps its files, empty or not
    with pytest.raises(EngineError):
        stream(
            io.BytesIO(b'{"prompt": "hi"}\n'), StreamPaths.build(out, errors), settings(), context.replace(resume=True)
        )
    assert out.exists() and errors.exists()
    ok = RunContext(engine_factory=lambda m, s: FakeEngine(), progress_plain=True, overwrite=True)
    stream(io.BytesIO(b""), StreamPaths.build(out, errors), settings(), ok)  # no row, no failure: files kept
    assert out.read_bytes() == b"" and errors.read_bytes() == b""


def line_rows(*specs: tuple[str, str]) -> bytes:
    return b"".join(orjson.dumps({"id": i, "prompt": p}) + b"\n" for i, p in specs)


def test_input_order_writes_rows_as_they_arrived_though_the_planner_fed_longest_first(tmp_path: Path) -> None:
    rows = [(f"r{k}", "word " * (1 + (k * 7) % 5)) for k in range(9)]
    source = io.BytesIO(line_rows(*rows[:4]) + b"not json\n" + line_rows(*rows[4:]))
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    engine = FakeEngine()
    context = RunContext(engine_factory=lambda m, s: engine, progress_plain=True)
    result = stream(source, StreamPaths.build(out, errors), settings(output_order="input", window_rows=4), context)
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [i for i, _ in rows]
    assert [orjson.loads(line)["line"] for line in errors.read_bytes().splitlines()] == [5]
    assert result.report["output_order"] == "input" and result.report["reorder"]["bound"] == 4
    assert result.report["reorder"]["peak_held"] >= 2  # the planner fed longer prompts first: rows waited


def test_the_reorder_buffer_holds_what_finished_until_earlier_rows_have_their_records() -> None:
    sink = io.BytesIO()
    writer = StreamWriter(sink, sink, input_order=True, bound=8)
    for line in (1, 2, 3, 4, 5):
        writer.read(line)
    writer.output(3, {"id": "c"})
    writer.output(2, {"id": "b"})
    assert sink.getvalue() == b"" and writer.held == 2
    writer.error(1, {"id": "a", "error": {}})
    assert [orjson.loads(x)["id"] for x in sink.getvalue().splitlines()] == ["a", "b", "c"]
    writer.output(5, {"id": "e"})
    writer.skip(4)  # a resumed row: no record, and nothing after it waits for one
    assert [orjson.loads(x)["id"] for x in sink.getvalue().splitlines()] == ["a", "b", "c", "e"]
    assert (writer.held, writer.peak_held, writer.skipped) == (0, 2, 1)


def request(line: int) -> Request:
    return Request(seq=line - 1, line=line, id=f"r{line}", prompt="p", messages=None, max_tokens=4, temperature=0.0,
                   top_p=1.0, seed=None, stop=(), prompt_token_ids=[1])  # fmt: skip


def test_the_gate_feeds_nothing_new_while_the_buffer_is_full_and_its_oldest_row_is_in_the_engine() -> None:
    writer = StreamWriter(io.BytesIO(), io.BytesIO(), input_order=True, bound=2)
    for line in (1, 2, 3, 4, 5):
        writer.read(line)
    # the planner fed lines 2 and 3 before 1 (longest first): the oldest row is not fed yet, so 1 goes
    gated = writer.gate(iter([request(2), request(3), request(1), request(4), request(5)]), PENDING)
    assert [next(gated).line for _ in range(2)] == [2, 3]
    writer.output(2, {"id": "r2"})
    writer.output(3, {"id": "r3"})
    assert next(gated).line == 1  # full, but line 1 is not in the engine: holding back would never end
    assert next(gated) is PENDING and next(gated) is PENDING  # full and line 1 in the engine: wait for it
    writer.output(1, {"id": "r1"})
    assert next(gated).line == 4 and writer.held == 0


def test_a_stream_to_a_file_resumes_by_id_after_cutting_a_torn_line(tmp_path: Path) -> None:
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    out.write_bytes(b'{"id":"r0","completion":"echo r0"}\n{"id":"r1","completion":"echo r1"}\n{"id":"r2","compl')
    errors.write_bytes(b'{"id":"bad","line":3,"error":{"type":"invalid_row","message":"m"}}\n')
    source = io.BytesIO(line_rows(*[(f"r{k}", f"question {k}") for k in range(5)], ("bad", "")))
    context = RunContext(engine_factory=lambda m, s: FakeEngine(), progress_plain=True, resume=True)
    result = stream(source, StreamPaths.build(out, errors), settings(), context)
    ids = [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()]
    assert ids[:2] == ["r0", "r1"] and sorted(ids) == ["r0", "r1", "r2", "r3", "r4"]  # r2's torn line cut off
    assert errors.read_bytes().count(b"\n") == 1  # "bad" had its record: skipped, not failed again
    assert result.report["request_counts"] == {"completed": 3, "failed": 0, "resumed": 3}
    assert done_ids(out) == {"r0", "r1", "r2", "r3", "r4"}


def test_a_rows_custom_id_column_does_not_stand_for_its_id_on_resume(tmp_path: Path) -> None:
    """A bulkinfer row's record with a ``custom_id`` column passed through is
    done under its ``id``; an OpenAI line's records (``response``) under ``custom_id``."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(
        b'{"id":"r0","completion":"c","custom_id":"ticket-1"}\n'
        b'{"id":"batch_req_1","custom_id":"c1","response":null,"error":{"code":"invalid_field","message":"m"}}\n'
    )
    assert done_ids(out) == {"r0", "c1"}


def test_a_resumed_output_that_is_not_records_is_refused_naming_its_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id":"r0"}\nvLLM log line\n')
    with pytest.raises(ConfigError, match=r"out.jsonl, line 2: not a JSON record"):
        stream(io.BytesIO(b""), StreamPaths.build(out), settings(), RunContext(resume=True))


def test_the_closing_line_counts_windows_in_the_singular_and_plural() -> None:
    from bulkinfer.jobs.stream import _summary

    def report(windows: int) -> dict[str, Any]:
        return {
            "request_counts": {"completed": 6, "failed": 1}, "seconds": {"generate": 1.2, "load": 18.4},
            "tokens": {"completion": 36}, "throughput": {"completion_tokens_per_s": 30.4},
            "windows": {"count": windows, "max_wait_s": 0.5}, "log": "x.log",
        }  # fmt: skip

    assert "(30.4 tok/s), 1 window (max wait 0.5 s); load 18.4 s; log x.log" in _summary(report(1))
    assert "(30.4 tok/s), 3 windows (max wait 0.5 s)" in _summary(report(3))
    assert "6 rows completed, 1 failed, 36 completion" in _summary(report(1))
    assert "6 rows completed, 1 failed, 2 blank lines skipped, 36" in _summary({**report(1), "blank_lines": 2})


def test_streams_to_standard_output_keep_the_newest_logs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cron line streaming to standard output every minute would otherwise
    leave 1,440 engine logs a day in $BULKINFER_HOME/logs."""
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(STREAM_KEEP_LOGS + 5):
        old = logs / f"stream-{i:04d}.log"
        old.write_bytes(b"")
        os.utime(old, ns=(i * 10**9, i * 10**9))
    (logs / "other.log").write_bytes(b"")  # not a stream's: kept
    paths = StreamPaths.build(None)
    kept = sorted(p.name for p in logs.iterdir())
    assert len(kept) == STREAM_KEEP_LOGS and "other.log" in kept  # the new log is written when the engine starts
    assert kept[0] == "other.log" and kept[1] == "stream-0006.log" and paths.log.parent == logs


def test_a_stream_whose_reader_went_away_stops_as_a_closed_pipe_would_end_it() -> None:
    """``bulkinfer run - -o - | head -1``: it ended with click's silent exit 1, or not at
    all while rows kept coming; now the engine is closed and the run is Interrupted with
    141, what a process ended by SIGPIPE exits with, saying how many records were written."""
    rows = b"".join(orjson.dumps({"id": f"r{k}", "prompt": f"question {k}"}) + b"\n" for k in range(50))
    read, write = os.pipe()
    saved = os.dup(1)
    os.dup2(write, 1)  # the stream's standard output: a pipe whose reader takes one line and goes
    os.close(write)
    engines: list[FakeEngine] = []

    def engine(model: str, settings: Any) -> FakeEngine:
        engines.append(FakeEngine())
        return engines[-1]

    reader = threading.Thread(target=lambda: (os.fdopen(read, "rb").readline(), None))
    reader.start()  # the file object is collected after its line: the read end closes
    try:
        context = RunContext(engine_factory=engine, progress_plain=True)
        with pytest.raises(Interrupted) as stopped:
            stream(io.BytesIO(rows), StreamPaths.build(None), settings(window_rows=4, max_wait_s=0.05), context)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        reader.join()
    assert stopped.value.exit_code == 141 and "the output's reader went away (a closed pipe)" in str(stopped.value)
    assert engines[0].closed


def test_errors_naming_the_output_file_is_refused_and_both_standard_output_is_the_default(tmp_path: Path) -> None:
    """One file opened twice would lose the records written first."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(ConfigError, match=f"--errors {out} is the output file: leave --errors out"):
        StreamPaths.build(out, out)
    (tmp_path / "link.jsonl").symlink_to(out)
    with pytest.raises(ConfigError, match="is the output file"):
        StreamPaths.build(out, tmp_path / "link.jsonl")
    assert StreamPaths.build(Path("-"), Path("-")).errors is None


def test_a_streams_output_directory_is_made_and_a_file_in_its_way_is_exit_9(tmp_path: Path) -> None:
    context = RunContext(engine_factory=lambda m, s: FakeEngine(), progress_plain=True)
    out = tmp_path / "new" / "sub" / "out.jsonl"
    stream(io.BytesIO(line_rows(("a", "hi"))), StreamPaths.build(out), settings(), context)
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["a"]
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OutputWriteError, match="not a directory|Not a directory") as raised:
        stream(io.BytesIO(b""), StreamPaths.build(tmp_path / "file" / "o.jsonl"), settings(), context)
    assert raised.value.exit_code == 9


def test_a_stream_resumes_only_with_its_own_settings_and_never_onto_a_file_runs_output(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    context = RunContext(engine_factory=lambda m, s: FakeEngine(), progress_plain=True)
    stream(io.BytesIO(line_rows(("a", "hi"))), StreamPaths.build(out), settings(), context)
    resume = context.replace(resume=True)
    other = load_settings(None, {"sampling.max_tokens": 5}).resolve_chat_template(None)
    with pytest.raises(ConfigError, match=r"settings differ from the interrupted run's: .*max_tokens\): 256 -> 5"):
        stream(io.BytesIO(line_rows(("b", "yo"))), StreamPaths.build(out), other, resume)
    result = stream(io.BytesIO(line_rows(("a", "hi"), ("b", "yo"))), StreamPaths.build(out), settings(), resume)
    assert result.report["request_counts"] == {"completed": 1, "failed": 0, "resumed": 1}
    src, ran = tmp_path / "in.jsonl", tmp_path / "ran.jsonl"
    src.write_bytes(line_rows(("a", "hi")))
    run(RunPaths.build(src, ran), settings(), context)
    with pytest.raises(ConfigError, match=f"cannot resume {ran} with a stream: `bulkinfer run {src}` wrote it"):
        stream(io.BytesIO(line_rows(("b", "yo"))), StreamPaths.build(ran), settings(), resume)
    with OutputFiles(out).locked(), pytest.raises(LockHeldError):  # another stream or run writing OUT
        stream(io.BytesIO(b""), StreamPaths.build(out), settings(), resume)


def test_a_stream_refused_for_an_existing_output_leaves_that_outputs_settings_record_alone(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    context = RunContext(engine_factory=lambda m, s: FakeEngine(), progress_plain=True)
    stream(io.BytesIO(line_rows(("a", "hi"))), StreamPaths.build(out), settings(), context)
    before = OutputFiles(out).journal.read_bytes()
    other = load_settings(None, {"sampling.max_tokens": 5}).resolve_chat_template(None)
    with pytest.raises(OutputExistsError):
        stream(io.BytesIO(line_rows(("b", "yo"))), StreamPaths.build(out), other, context)
    assert OutputFiles(out).journal.read_bytes() == before
