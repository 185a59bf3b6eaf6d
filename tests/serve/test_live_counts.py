"""Progress of a running batch: its rows and tokens counted from the run's
spools (only what was added since the last count), and the live
``request_counts`` and completion tokens/s written to the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from bulkinfer.jobs.output_files import OutputFiles
from bulkinfer.serve.progress import LiveCounts, RowTally
from bulkinfer.serve.store import Store


def output_row(custom_id: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {"custom_id": custom_id, "response": {"body": {"choices": [{"message": {"content": "x"}}], "usage": usage}}}


def test_a_row_tally_reads_only_whole_lines_and_only_what_was_added(tmp_path: Path) -> None:
    spool = tmp_path / "s.jsonl"
    tally = RowTally(spool)
    assert tally.read().rows == 0  # not there yet
    row = output_row("a", 5, 2)
    spool.write_bytes(b"[1,{}]\n" + orjson.dumps([2, row]) + b'\n[3,{"a"')
    assert (tally.read().rows, tally.prompt_tokens, tally.completion_tokens) == (2, 5, 2)  # the torn line waits
    with open(spool, "ab") as f:
        f.write(b":1}]\n" + orjson.dumps(row) + b"\nnot json\n")  # a published (bare) record; a damaged line
    assert (tally.read().rows, tally.prompt_tokens, tally.completion_tokens) == (5, 10, 4)
    assert tally.offset == spool.stat().st_size


def test_live_counts_write_counts_and_the_completion_tokens_per_s_of_this_attempt(tmp_path: Path) -> None:
    store = Store(tmp_path)
    batch = store.add_batch("alice", "file-x", "/v1/chat/completions", "24h", None, "tiny")
    files = OutputFiles(store.batch_dir(batch["id"]) / "output.jsonl")
    files.out.parent.mkdir(parents=True)
    files.spool.write_bytes(orjson.dumps([1, output_row("resumed", 9, 50)]) + b"\n")  # an earlier attempt's row
    now = [90.0]
    live = LiveCounts(store, batch["id"], files.out, total=4, clock=lambda: now[0])
    now[0] = 100.0
    live.engine_ready()  # the 10 s of model load are not counted
    with open(files.spool, "ab") as f:
        f.write(orjson.dumps([2, output_row("b", 3, 6)]) + b"\n" + orjson.dumps([3, output_row("c", 3, 4)]) + b"\n")
    files.errors_spool.write_bytes(orjson.dumps([4, {"custom_id": "d", "error": {}}]) + b"\n")
    now[0] = 104.0
    live.tick()
    found = store.batch("alice", batch["id"])
    assert found is not None
    assert found["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert found["throughput"] == {"completion_tokens_per_s": 2.5, "measured": "live"}  # (6 + 4) tokens / 4 s
    store.close()
