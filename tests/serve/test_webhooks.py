"""Batch webhooks (issue 35): OpenAI's batch events signed per Standard
Webhooks, verified by a local receiver with the ``standardwebhooks`` library
and the ``openai`` client's ``webhooks.unwrap``; retried until the receiver
takes them, and recorded so that a server killed before a delivery delivers
after its restart, and one killed after a delivery never sends it again. The
engine is a fake (the orchestration, not inference)."""

from __future__ import annotations

import base64
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from fakes import FakeEngine, wait_for
from serving import Server, batch_lines, create, upload, wait_done
from standardwebhooks import Webhook
from test_kill import TESTS, _up, free_port

from bulkinfer.errors import ConfigError
from bulkinfer.serve.access import ACCESS_LOGGER
from bulkinfer.serve.webhooks import WebhookSender, checked_url, signer

SECRET = "whsec_" + base64.b64encode(b"bulkinfer-test-secret-32-bytes!!").decode()


class Receiver:
    """A webhook endpoint on 127.0.0.1: records every POST (body, headers,
    the status it answered); answers 500 to the first ``failures`` ones."""

    def __init__(self, failures: int = 0, port: int = 0):
        self.failures, self.received = failures, []  # type: ignore[var-annotated]
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                status = 500 if len(receiver.received) < receiver.failures else 200
                receiver.received.append({"body": body, "headers": dict(self.headers), "status": status})
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/hooks"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def delivered(self) -> list[dict[str, Any]]:
        return [r for r in self.received if r["status"] == 200]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(failures: int = 0, port: int = 0) -> Receiver:
        made.append(Receiver(failures, port))
        return made[-1]

    yield make
    for r in made:
        r.close()


def with_sender(server: Server, delays: tuple[float, ...] = (0.2, 0.2)) -> WebhookSender:
    sender = WebhookSender(server.store, SECRET, delays=delays)
    sender.start()
    return sender


def verified(delivery: dict[str, Any]) -> Any:
    """The event, verified twice: by ``standardwebhooks`` and by the
    ``openai`` client (its typed event)."""
    Webhook(SECRET).verify(delivery["body"], delivery["headers"])
    return openai.OpenAI(api_key="unused").webhooks.unwrap(delivery["body"], delivery["headers"], secret=SECRET)


def test_batch_events_are_signed_and_typed_as_openais(
    serve: Callable[..., Server], receiver: Callable[..., Receiver]
) -> None:
    hook = receiver()
    server = serve(engine=lambda: FakeEngine(step_delay=0.05), webhook_url=hook.url)
    sender = with_sender(server)
    client = server.client()
    completed = wait_done(client, create(client, upload(client, batch_lines(["a", "b"])).id).id)
    failed = wait_done(client, create(client, upload(client, b"{not json\n").id).id)
    cancelled = client.batches.cancel(create(client, upload(client, batch_lines([f"r{i}" for i in range(40)])).id).id)
    cancelled = wait_done(client, cancelled.id)
    assert (completed.status, failed.status, cancelled.status) == ("completed", "failed", "cancelled")
    wait_for(lambda: len(hook.delivered()) == 3)
    events = {e.data.id: e for e in map(verified, hook.delivered())}
    assert {b: e.type for b, e in events.items()} == {
        completed.id: "batch.completed",
        failed.id: "batch.failed",
        cancelled.id: "batch.cancelled",
    }
    assert type(events[completed.id]).__name__ == "BatchCompletedWebhookEvent"
    assert all(e.object == "event" and e.id.startswith("evt_") for e in events.values())
    assert events[completed.id].created_at >= completed.completed_at  # type: ignore[operator]
    assert {d["headers"]["webhook-id"] for d in hook.delivered()} == {e.id for e in events.values()}
    sender.close()


def test_a_tampered_body_or_another_secret_fails_verification(
    serve: Callable[..., Server], receiver: Callable[..., Receiver]
) -> None:
    from standardwebhooks.webhooks import WebhookVerificationError

    hook = receiver()
    server = serve(webhook_url=hook.url)
    with_sender(server)
    client = server.client()
    wait_done(client, create(client, upload(client, batch_lines(["a"])).id).id)
    wait_for(lambda: len(hook.delivered()) == 1)
    delivery = hook.delivered()[0]
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(delivery["body"].replace(b"batch_", b"batch_x"), delivery["headers"])
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + base64.b64encode(b"another secret").decode()).verify(delivery["body"], delivery["headers"])


def test_a_receiver_that_fails_twice_gets_the_event_once_it_succeeds(
    serve: Callable[..., Server], receiver: Callable[..., Receiver]
) -> None:
    hook = receiver(failures=2)
    server = serve(webhook_url=hook.url)
    sender = with_sender(server)
    client = server.client()
    batch = wait_done(client, create(client, upload(client, batch_lines(["a"])).id).id)
    wait_for(lambda: len(hook.delivered()) == 1)
    time.sleep(0.6)  # past the retry delays: nothing more comes
    assert [r["status"] for r in hook.received] == [500, 500, 200]
    assert len({r["headers"]["webhook-id"] for r in hook.received}) == 1  # one event, sent three times
    assert verified(hook.delivered()[0]).data.id == batch.id
    (event_id,) = {r["headers"]["webhook-id"] for r in hook.received}
    row = server.store.event(event_id)
    assert row is not None and row["attempts"] == 3 and row["delivered_at"] is not None
    assert row["last_error"] is None and row["gave_up_at"] is None
    sender.close()


def test_a_state_database_that_cannot_be_written_stalls_the_sender_never_ends_it(
    serve: Callable[..., Server],
    receiver: Callable[..., Receiver],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full disk: the record of a delivery fails (the thread died there, and no event went
    out again until a restart); the sender waits and goes on, sending that event once more
    (receivers dedupe by webhook-id, as Standard Webhooks asks)."""
    monkeypatch.setattr("bulkinfer.serve.webhooks.STALLED_RETRY_S", 0.2)
    hook = receiver()
    server = serve(webhook_url=hook.url)
    attempted, full = server.store.event_attempted, [1]

    def event_attempted(*args: Any) -> None:
        if full[0]:
            full[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        attempted(*args)

    monkeypatch.setattr(server.store, "event_attempted", event_attempted)
    caplog.set_level("INFO", logger=ACCESS_LOGGER)
    sender = with_sender(server)
    client = server.client()
    first = wait_done(client, create(client, upload(client, batch_lines(["a"])).id).id)
    second = wait_done(client, create(client, upload(client, batch_lines(["b"])).id).id)
    wait_for(lambda: {verified(d).data.id for d in hook.delivered()} == {first.id, second.id})
    assert sender.is_alive() and full == [0]
    assert len(hook.delivered()) == 3  # the first event twice: its first delivery could not be recorded
    sender.close()
    stalls = [orjson.loads(r.getMessage()) for r in caplog.records if "webhooks_stalled" in r.getMessage()]
    assert [line["webhooks_stalled"] for line in stalls] == ["the state database: database or disk is full"]


def test_an_event_is_given_up_after_the_last_retry(
    serve: Callable[..., Server], receiver: Callable[..., Receiver]
) -> None:
    hook = receiver(failures=100)
    server = serve(webhook_url=hook.url)
    with_sender(server, delays=(0.1,))
    client = server.client()
    wait_done(client, create(client, upload(client, batch_lines(["a"])).id).id)
    wait_for(lambda: len(hook.received) == 2)
    time.sleep(0.5)
    assert len(hook.received) == 2  # the first attempt and one retry
    row = server.store.event(hook.received[0]["headers"]["webhook-id"])
    assert row is not None and row["gave_up_at"] is not None and row["last_error"] == "HTTP 500"


def test_no_url_records_no_event(serve: Callable[..., Server]) -> None:
    server = serve()
    client = server.client()
    wait_done(client, create(client, upload(client, batch_lines(["a"])).id).id)
    assert server.store.next_event_at() is None


def test_the_secret_and_url_are_checked() -> None:
    signer(SECRET)
    with pytest.raises(ConfigError, match="whsec_"):
        signer("whsec_not base64!")
    with pytest.raises(ConfigError, match="whsec_"):
        signer("")
    assert checked_url("https://hooks.example.com/b") == "https://hooks.example.com/b"
    with pytest.raises(ConfigError, match="http"):
        checked_url("file:///etc/passwd")


def _events(data: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(data / "state.sqlite3") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM webhook_events")]


def test_killed_before_delivery_delivers_after_restart_and_never_again_after(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    """A real server process (fake engine): the event of a completed batch is
    recorded but its receiver is down; SIGKILL; the receiver comes up and a
    restarted server delivers it; SIGKILL after that delivery, a third start
    sends nothing more."""
    port, hook_port = free_port(), free_port()
    url = f"http://127.0.0.1:{hook_port}/hooks"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), str(TESTS / "serve")])}
    driver = [sys.executable, str(TESTS / "serve" / "server_driver.py"), str(tmp_path / "data"), str(port)]
    flags = ["--webhook-url", url, "--webhook-secret", SECRET, "--webhook-delays", "0.5,0.5,0.5,0.5,0.5,0.5"]
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen([*driver, *flags], env=env))
        wait_for(lambda: _up(port) or procs[-1].poll() is not None, timeout=60)
        assert procs[-1].poll() is None, "the server did not start"
        return procs[-1]

    def kill(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    try:
        server = start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="key-a", max_retries=0)
        batch = wait_done(client, create(client, upload(client, batch_lines(["a", "b"])).id).id)
        assert batch.status == "completed"
        wait_for(lambda: any(e["attempts"] >= 1 for e in _events(tmp_path / "data")))  # tried: nobody listens
        kill(server)
        (event,) = _events(tmp_path / "data")
        assert event["delivered_at"] is None and event["last_error"]
        hook = receiver(port=hook_port)
        server = start()
        wait_for(lambda: len(hook.delivered()) == 1)
        wait_for(lambda: _events(tmp_path / "data")[0]["delivered_at"] is not None)
        kill(server)
        assert verified(hook.delivered()[0]).data.id == batch.id
        start()
        time.sleep(2.0)  # four retry delays
        assert len(hook.received) == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)
