"""End to end: ``bulkinfer serve`` as a real uvicorn process on a free port
of 127.0.0.1, the real engine and default model, driven over HTTP by the
official ``openai`` client (files, batches, content).

One server (one engine start) serves the module's batches and its online
requests; its last batch is stopped twice, each time by starting the server
again on the same data directory (SIGTERM, then SIGKILL, mid-batch), and the
second server's engine is killed under it and comes back: four engine starts
in all.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from browser import CHROMIUM, FLAGS, NO_CHROMIUM
from e2e_helpers import CAPITALS, ROOT, SAMPLE, engine_children, read_jsonl
from reference_types import check_online_chunk, check_online_response, check_openai_line

from bulkinfer.engine.mux import ONLINE_FIRST_SCHEDULER
from bulkinfer.engine.online_first import FIRST_PAUSE

KEYS = ("key-alice", "key-bob")
DONE = ("completed", "failed", "cancelled", "expired")
START_S = 600.0  # a server's first batch waits for the engine to load (~40 s here)
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MAX_ONLINE = 2
MAX_FILE_BYTES = 4 << 20
QUESTION = [{"role": "user", "content": "What is the capital of Japan?"}]  # see e2e_helpers.CAPITALS


# The servers' config: a KV cache of 1 GiB holds every batch here, where the CPU default (which a server keeps
# rather than size it to its first batch) takes each start ~10 s more; eight requests in flight, so that rows
# finish a few at a time and each stop of the last test lands mid-batch.
CONFIG = f"[plan]\nmax_in_flight = 8\n[engine]\nkv_cache_memory_bytes = {1 << 30}\n"


class ServeProcess:
    """``bulkinfer serve`` on ``port`` over ``data``; its output (vLLM's log
    included) goes to ``data``'s sibling ``serve-N.log``."""

    def __init__(self, data: Path, port: int, *extra: str, env: Mapping[str, str] | None = None):
        self.data, self.port = data, port
        self.log = data.parent / f"serve-{len(list(data.parent.glob('serve-*.log')))}.log"
        args = ["serve", "--port", str(port), "--data-dir", str(data), *(f"--api-key={k}" for k in KEYS), *extra]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bulkinfer", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        deadline = time.monotonic() + START_S  # /health is 200 once the engine is ready
        while not self.up():
            assert self.proc.poll() is None, f"the server exited: {self.tail()}"
            assert time.monotonic() < deadline, f"the server did not answer /health: {self.tail()}"
            time.sleep(0.2)

    def up(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chat_lines(rows: list[dict[str, Any]], max_tokens: int = 24, **body: Any) -> list[dict[str, Any]]:
    """OpenAI batch lines (``/v1/chat/completions``, temperature 0) of
    bulkinfer rows with a ``prompt`` or ``messages``."""
    return [
        {
            "custom_id": row["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                "messages": row.get("messages") or [{"role": "user", "content": row["prompt"]}],
                "max_tokens": max_tokens,
                "temperature": 0,
                **body,
            },
        }
        for row in rows
    ]


def submit(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions") -> Any:
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def poll(client: openai.OpenAI, batch_id: str, until: Callable[[Any], bool], timeout: float = START_S) -> Any:
    """``batches.retrieve`` every 0.5 s until ``until(batch)``; that batch."""
    deadline = time.monotonic() + timeout
    while not until(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"timed out: {batch}"
        time.sleep(0.5)
    return batch


def finished(client: openai.OpenAI, batch_id: str, timeout: float = START_S) -> Any:
    return poll(client, batch_id, lambda b: b.status in DONE, timeout)


def completed_at_least(n: int) -> Callable[[Any], bool]:
    return lambda b: b.status in DONE or (b.request_counts is not None and b.request_counts.completed >= n)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def answer(record: dict[str, Any]) -> str:
    choice = record["response"]["body"]["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("serve")
    config = tmp / "serve.toml"
    config.write_text(CONFIG)
    limits = ("--max-online", str(MAX_ONLINE), "--max-file-bytes", str(MAX_FILE_BYTES), "--batch-beside-online", "2")
    # this server's engine in its process (15 s less to start); the later ones' in vLLM's processes (serve's default)
    process = ServeProcess(tmp / "data", free_port(), "--config", str(config), *limits, env=IN_PROCESS)
    yield process
    process.stop()


def test_a_batch_through_the_openai_client(server: ServeProcess) -> None:
    """files.create -> batches.create -> poll -> files.content: every line is
    valid by the reference types, every ``custom_id`` exactly once, the
    answers are real."""
    client = server.client()
    rows = read_jsonl(SAMPLE / "sharegpt.jsonl")[:12] + read_jsonl(SAMPLE / "chat.jsonl")[:4]
    rows += [{"id": f"ask-capital-{c}", "prompt": f"What is the capital of {c.title()}?"} for c in CAPITALS]
    lines = chat_lines(rows)
    lines.insert(5, {**chat_lines(rows[:1])[0], "custom_id": "bad-tools", "body": {**lines[0]["body"], "tools": []}})
    batch = submit(client, lines)
    assert batch.status == "validating"
    done = finished(client, batch.id)
    assert done.status == "completed", (done.errors, server.tail())
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    ids = [r["custom_id"] for r in outputs + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert [r["custom_id"] for r in errors] == ["bad-tools"]
    assert errors[0]["error"]["code"] == "unsupported_field"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (20, 19, 1)
    for record in outputs + errors:
        check_openai_line(record)
    by_id = {r["custom_id"]: r for r in outputs}
    for country, capital in CAPITALS.items():
        assert capital in answer(by_id[f"ask-capital-{country}"])
    assert all(r["response"]["body"]["usage"]["completion_tokens"] >= 1 for r in outputs)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at  # type: ignore[operator]
    report = orjson.loads((server.data / "batches" / batch.id / "output.report.json").read_bytes())
    assert "kv_cache" not in report["engine_choice"]  # the engine serves later batches: not sized to this one
    assert report["engine"]["scheduling_policy"] == "priority"  # online requests go ahead of batch rows


def test_a_completions_batch(server: ServeProcess) -> None:
    client = server.client()
    lines = [
        {
            "custom_id": f"count-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": f"{i}, {i + 1}, {i + 2},", "max_tokens": 6, "temperature": 0},
        }
        for i in range(1, 5)
    ]
    done = finished(client, submit(client, lines, "/v1/completions").id)
    assert done.status == "completed", done.errors
    outputs = lines_of(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in outputs) == [f"count-{i}" for i in range(1, 5)]
    for record in outputs:
        assert check_openai_line(record).response.status_code == 200
        assert record["response"]["body"]["object"] == "text_completion"


def test_three_batches_at_once_run_in_order_and_all_complete(server: ServeProcess) -> None:
    client = server.client()
    rows = read_jsonl(SAMPLE / "sharegpt.jsonl")[20:44]
    batches = [submit(client, chat_lines(rows[i * 8 : (i + 1) * 8], max_tokens=12)) for i in range(3)]
    done = [finished(client, b.id) for b in batches]
    assert [b.status for b in done] == ["completed"] * 3, [b.errors for b in done]
    for first, second in zip(done, done[1:], strict=False):  # FIFO: one starts after the previous one finished
        assert first.completed_at <= second.in_progress_at
    for batch, submitted in zip(done, batches, strict=True):
        assert len(lines_of(client, batch.output_file_id)) == 8
        assert batch.id == submitted.id


def test_online_requests_mid_batch_then_a_cancel_publishes_the_finished_rows(server: ServeProcess) -> None:
    """Online chat and text completions, whole and streamed (read with the
    SDK's streaming API, and as raw server-sent events validated by vLLM's
    and the SDK's types), answered while a 100-row batch runs on the same
    engine; then the batch is cancelled with the rows it finished."""
    client = server.client()
    rows = read_jsonl(SAMPLE / "sharegpt.jsonl")[:100]
    lines = chat_lines(rows, max_tokens=64)
    batch = submit(client, lines)
    running = poll(client, batch.id, completed_at_least(3))
    assert running.status == "in_progress", running.status
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    request = {"model": "default", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    whole = httpx.post(server.url("/v1/chat/completions"), json=request, headers=auth, timeout=120)
    assert whole.status_code == 200, whole.text
    chat = check_online_response(whole.json())
    assert "Tokyo" in (chat.choices[0].message.content or "") and chat.model == "default"
    assert chat.usage.completion_tokens == chat.usage.total_tokens - chat.usage.prompt_tokens > 0
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
    chunks = list(stream)
    assert "Tokyo" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # every token, whatever VllmEngine.stream_interval a batch row gets (a few tokens may add no text)
    texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= chunks[-1].usage.completion_tokens // 2, (len(texts), chunks[-1].usage.completion_tokens)
    raw = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=raw, headers=auth, timeout=120) as events:
        data = [line.removeprefix("data: ") for line in events.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    pieces = [check_online_chunk(orjson.loads(d)) for d in data[:-1]]
    assert "Paris" in "".join(p.choices[0].text for p in pieces)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    # OpenAI's list of prompts: one engine request each, their choices in turn
    several = client.completions.create(model="default", prompt=[raw["prompt"]] * 2, max_tokens=8, temperature=0)
    assert [c.index for c in several.choices] == [0, 1] and all("Paris" in c.text for c in several.choices)
    assert client.batches.retrieve(batch.id).status == "in_progress"  # the answers did not wait for the batch
    # vLLM ran bulkinfer's scheduler, and it left all but two batch rows out of the online requests' steps
    assert f"Using custom scheduler class {ONLINE_FIRST_SCHEDULER}" in server.log.read_text()
    assert FIRST_PAUSE % 2 in server.log.read_text()
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = finished(client, batch.id, timeout=120)
    assert done.status == "cancelled"
    assert done.cancelling_at is not None and done.cancelled_at is not None
    outputs = lines_of(client, done.output_file_id)
    ids = [r["custom_id"] for r in outputs]
    assert 3 <= len(ids) < 100
    assert len(set(ids)) == len(ids) and set(ids) <= {line["custom_id"] for line in lines}
    assert done.request_counts is not None and done.request_counts.completed == len(ids)
    for record in outputs:
        check_openai_line(record)


def test_429_past_max_online_and_413_past_max_file_bytes(server: ServeProcess) -> None:
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    long = {"model": "default", "prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, contextlib.ExitStack() as held:
        lines = []  # kept: a line iterator collected early closes its connection
        for _ in range(MAX_ONLINE):  # in flight: each has sent its first token
            events = held.enter_context(http.stream("POST", server.url("/v1/completions"), json=long, headers=auth))
            assert events.status_code == 200
            lines.append(events.iter_lines())
            next(lines[-1])
        busy = http.post(server.url("/v1/completions"), json={**long, "stream": False}, headers=auth)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
    assert busy.json()["error"]["code"] == "too_many_requests"
    with pytest.raises(openai.APIStatusError) as too_large:
        server.client().files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert too_large.value.status_code == 413
    metrics = httpx.get(server.url("/metrics")).text
    assert 'bulkinfer_online_requests_total{endpoint="/v1/completions",status="429"} 1.0' in metrics
    assert 'bulkinfer_online_requests_total{endpoint="/v1/completions",status="499"} 2.0' in metrics  # went away
    assert re.search(r'vllm:time_to_first_token_seconds_count\{model_name="[^"]+"\} [1-9]', metrics)


def test_a_batch_past_its_window_expires_with_its_finished_rows(server: ServeProcess) -> None:
    """OpenAI's only window is 24h: the test moves the running batch's
    ``expires_at`` into the past in the server's state database, as the clock
    passing it would. The server stops the batch within a second: ``expired``,
    the finished rows in its output, every other request a ``batch_expired``
    line of its errors file, each ``custom_id`` once, every line valid by the
    reference types."""
    client = server.client()
    rows = [{"id": f"count-{i}", "prompt": f"Count from {i} to {i + 20}."} for i in range(100)]  # short prefills
    lines = chat_lines(rows, max_tokens=32)
    batch = submit(client, lines)
    assert poll(client, batch.id, completed_at_least(3)).status == "in_progress"
    db = sqlite3.connect(server.data / "state.sqlite3", timeout=30)
    with db:
        db.execute("UPDATE batches SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, batch.id))
    db.close()
    done = finished(client, batch.id, timeout=120)
    assert done.status == "expired" and done.expired_at is not None, (done.status, server.tail())
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert 3 <= len(outputs) < len(lines)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(r["custom_id"] for r in outputs + errors) == sorted(line["custom_id"] for line in lines)
    for record in outputs + errors:
        check_openai_line(record)
    counts = done.request_counts
    assert counts is not None and (counts.completed, counts.failed) == (len(outputs), len(errors))


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_status_page_shows_a_running_batch_in_chromium(server: ServeProcess, tmp_path: Path) -> None:
    """Headless Chromium logs in with the key (HTTP Basic, in the URL) and
    renders ``/`` while a batch runs: its row, status and progress bar. The
    screenshot goes to ``$BULKINFER_STATUS_SCREENSHOT`` when set (the README's)."""
    assert CHROMIUM is not None
    client = server.client()
    batch = submit(client, chat_lines(read_jsonl(SAMPLE / "sharegpt.jsonl")[:100], max_tokens=64))
    running = poll(client, batch.id, completed_at_least(3))
    assert running.status == "in_progress", running.status
    url = f"http://user:{KEYS[0]}@127.0.0.1:{server.port}/"
    flags = [*FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    row = re.search(rf'<tr id="{batch.id}">(.*?)</tr>', dom.stdout, re.S)
    assert row, dom.stdout[-2000:] + dom.stderr[-2000:]
    assert "in_progress" in row.group(1)
    bar = re.search(r'<progress value="(\d+)" max="(\d+)"', row.group(1))
    assert bar and 3 <= int(bar.group(1)) < 100 and bar.group(2) == "100", row.group(1)
    shot = Path(os.environ.get("BULKINFER_STATUS_SCREENSHOT") or tmp_path / "status.png").resolve()
    subprocess.run(
        [CHROMIUM, *flags, "--window-size=1700,520", f"--screenshot={shot}", url], capture_output=True, timeout=120
    )
    assert shot.exists() and shot.stat().st_size > 5_000
    client.batches.cancel(batch.id)
    assert finished(client, batch.id, timeout=120).status == "cancelled"


def test_keys_tenants_and_a_malformed_file(server: ServeProcess) -> None:
    alice, bob = server.client(KEYS[0]), server.client(KEYS[1])
    with pytest.raises(openai.AuthenticationError) as wrong:
        server.client("key-mallory").batches.list()
    assert wrong.value.status_code == 401
    batch = submit(alice, chat_lines([{"id": "only", "prompt": "Hi"}], max_tokens=2))
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(batch.id)
    only = finished(alice, batch.id)
    assert only.status == "completed", only.errors
    good = orjson.dumps(chat_lines([{"id": "a", "prompt": "Hi"}])[0])
    data = b"\n".join([good, b"{not json", orjson.dumps({"method": "POST"}), good.replace(b'"a"', b'"b"')]) + b"\n"
    file = alice.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    bad = alice.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = finished(alice, bad.id, timeout=60)
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
    ]


@pytest.fixture(scope="module")
def stopped_twice(server: ServeProcess) -> dict[str, Any]:
    """The module's server stopped by SIGTERM mid-batch (exit 0 promptly,
    the batch stays ``in_progress``); then a second server on the same data
    directory, its engine in vLLM's processes (serve's default): as it
    resumes the batch its engine's processes are SIGKILLed, and once its new
    engine has finished more rows the server itself is SIGKILLed (its
    engine's processes go too)."""
    import psutil

    lines = chat_lines(read_jsonl(SAMPLE / "sharegpt.jsonl")[:40], max_tokens=32)
    batch = submit(server.client(), lines)
    seen = poll(server.client(), batch.id, completed_at_least(5))
    server.proc.send_signal(signal.SIGTERM)
    term = {"status": seen.status, "code": server.proc.wait(timeout=60), "tail": server.tail()}

    config = server.data.parent / "serve.toml"
    second = ServeProcess(server.data, server.port, "--config", str(config))
    try:
        after_term = second.client().batches.retrieve(batch.id).status
        seen = poll(second.client(), batch.id, completed_at_least(seen.request_counts.completed + 3))
        first_engine = engine_children(second.proc.pid)
        assert first_engine, "no engine process under the server"
        for process in first_engine:
            process.kill()
        gap = through_the_gap(second)
        seen = poll(second.client(), batch.id, completed_at_least(seen.request_counts.completed + 3))
        engines = engine_children(second.proc.pid)
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait()
        psutil.wait_procs(engines, timeout=60)
        alive = [p for p in engines if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        log = second.log.read_text(errors="replace")
    finally:
        second.stop()
    return {"batch": batch, "lines": lines, "term": term, "after_term": after_term, "killed_status": seen.status,
            "engines": engines, "alive": alive, "gap": gap, "log": log}  # fmt: skip


def through_the_gap(server: ServeProcess) -> dict[str, list[Any]]:
    """``/health`` and an online chat request every 0.2 s from the engine's
    death until ``/health`` is ``ready`` again after ``starting``: the
    statuses seen (``healths``) and the online requests' codes (``codes``),
    each 200 or 503 with ``Retry-After: 5`` (never a hang or a 500)."""
    healths: list[str] = []
    codes: list[int] = []
    request = {"model": "default", "messages": QUESTION, "max_tokens": 4}
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    deadline = time.monotonic() + START_S
    while not (healths and "starting" in healths and healths[-1] == "ready"):
        assert time.monotonic() < deadline, (healths, codes, server.tail())
        healths.append(httpx.get(server.url("/health"), timeout=10).json()["status"])
        online = httpx.post(server.url("/v1/chat/completions"), json=request, headers=auth, timeout=60)
        codes.append(online.status_code)
        assert online.status_code in (200, 503), online.text
        assert online.status_code == 200 or online.headers["retry-after"] == "5"
        time.sleep(0.2)
    after = httpx.post(server.url("/v1/chat/completions"), json=request, headers=auth, timeout=60)
    return {"healths": healths, "codes": codes, "after": [after.status_code]}


def test_sigterm_then_sigkill_mid_batch_leave_it_in_progress(stopped_twice: dict[str, Any]) -> None:
    term = stopped_twice["term"]
    assert term["status"] == "in_progress", term["status"]
    assert term["code"] == 0, term["tail"]
    assert stopped_twice["after_term"] == "in_progress"
    assert stopped_twice["killed_status"] == "in_progress"
    assert stopped_twice["engines"], "no engine process under the server"
    assert not stopped_twice["alive"]


def test_an_engine_killed_mid_batch_comes_back_and_online_requests_get_503_meanwhile(
    stopped_twice: dict[str, Any],
) -> None:
    """The second server's engine processes SIGKILLed as it resumed the
    batch: ``/health`` said ``starting`` then ``ready``, online requests in
    the gap got 503 with ``Retry-After`` (never a hang or a 500), one after
    it 200, and the batch went on on the new engine (more rows finished
    before the server's own SIGKILL)."""
    gap = stopped_twice["gap"]
    assert 503 in gap["codes"] and "failed" not in gap["healths"], gap
    assert gap["after"] == [200]
    assert '"engine":"died"' in stopped_twice["log"]  # the server's access log says so


def test_a_third_server_completes_the_twice_stopped_batch(server: ServeProcess, stopped_twice: dict[str, Any]) -> None:
    """The batch completes on a third server (its engine in its process):
    every ``custom_id`` exactly once, the rows finished before each stop
    kept, not run again."""
    batch, lines = stopped_twice["batch"], stopped_twice["lines"]
    config = server.data.parent / "serve.toml"
    third = ServeProcess(server.data, server.port, "--config", str(config), env=IN_PROCESS)
    try:
        done = finished(third.client(), batch.id)
        assert done.status == "completed", (done.errors, third.tail())
        outputs = lines_of(third.client(), done.output_file_id)
        assert sorted(r["custom_id"] for r in outputs) == sorted(line["custom_id"] for line in lines)
        report = orjson.loads((server.data / "batches" / batch.id / "output.report.json").read_bytes())
        assert report["resumed"]["completed"] >= 11  # kept across both stops and the engine's death
    finally:
        third.stop()
