"""``bulkinfer run -`` end to end: the real CLI, engine and model, rows
written to its standard input by this test and results read from its
standard output as they come. The first rows' results arrive while the
input is still open (the stream is run as it arrives, not read to the
end first); every row ends as one record; standard output holds nothing
but JSON records (vLLM's log goes to the log file); the end of the input
ends the run with its summary on standard error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import orjson
import pytest
from e2e_helpers import ROOT, SAMPLE, SMALL_KV_CACHE, read_jsonl

pytestmark = pytest.mark.e2e

ROWS = read_jsonl(SAMPLE / "sharegpt.jsonl")[:12]

# A stream's size is unknown, so bulkinfer leaves vLLM's CPU default KV cache (25% of memory, ~10 s more to
# allocate); the smallest holds these 13 rows.
KV_CACHE = SMALL_KV_CACHE


def test_results_flow_out_while_the_input_is_still_open(tmp_path: Any) -> None:
    args = ["run", "-", "--max-tokens", "16", "--temperature", "0", "--max-wait", "0.2", "--plain-progress", *KV_CACHE]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bulkinfer", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stderr: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    first, rest = ROWS[:8], ROWS[8:]
    proc.stdin.write(b"".join(orjson.dumps({"id": r["id"], "prompt": r["prompt"]}) + b"\n" for r in first))
    proc.stdin.flush()
    lines: list[bytes] = []
    deadline = time.monotonic() + 600
    while len(lines) < len(first) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert len(lines) == len(first), (lines, b"".join(stderr)[-3000:])  # before the input ended
    proc.stdin.write(b"".join(orjson.dumps({"id": r["id"], "prompt": r["prompt"]}) + b"\n" for r in rest))
    proc.stdin.write(b'{"id": "bad", "prompt": 7}\n')
    proc.stdin.close()
    lines += proc.stdout.read().splitlines(keepends=True)
    assert proc.wait(timeout=600) == 3  # the bad row
    records = [orjson.loads(line) for line in lines]  # every line is a JSON record: no log line got in
    outputs = [r for r in records if "completion" in r]
    assert sorted(r["id"] for r in outputs) == sorted(r["id"] for r in ROWS)  # every row once
    assert all(r["completion"] and r["completion_tokens"] <= 16 for r in outputs)
    assert [r["id"] for r in records if "error" in r] == ["bad"]
    reader.join(timeout=60)  # the process has exited; its last stderr bytes may still be on their way here
    summary = b"".join(stderr).decode()
    assert "stream ended: 12 rows completed, 1 failed" in summary, summary[-2000:]
