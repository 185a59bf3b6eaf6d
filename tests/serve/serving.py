"""Helpers for serve tests: a server without a real engine: the app over a store in ``tmp_path``, a
worker whose engine is :class:`fakes.FakeEngine` (the tokenizer is the tiny
stand-in model's, see tests/conftest.py), and the official ``openai`` client
talking to it through FastAPI's TestClient."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import orjson
from fakes import FakeEngine, wait_for
from fastapi.testclient import TestClient

from bulkinfer.config import load_settings
from bulkinfer.serve.api import Limits, create_app
from bulkinfer.serve.store import Store
from bulkinfer.serve.worker import BatchWorker

KEYS = {"key-a": "alice", "key-b": "bob"}
DONE = ("completed", "failed", "cancelled", "expired")


class Server:
    """The store, worker, app and one client per key of a test's server."""

    def __init__(
        self,
        data: Path,
        engine: Callable[[], FakeEngine],
        limits: Limits | None = None,
        webhook_url: str | None = None,
        model: str | None = None,
    ):
        self.store = Store(data, webhook_url=webhook_url)
        self.engines: list[FakeEngine] = []

        def factory(model: str, settings: Any) -> FakeEngine:
            self.engines.append(engine())
            return self.engines[-1]

        self.worker = BatchWorker(self.store, load_settings(overrides={"model": model}), factory)
        endpoints = self.worker.served.endpoints
        self.app = create_app(self.store, KEYS, self.worker, limits or Limits(), "tiny", endpoints)
        self.http = TestClient(self.app)
        self.worker.start()
        wait_for(lambda: self.worker.health != "starting")  # the engine starts with the server

    def client(self, key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0)

    def close(self) -> None:
        self.worker.close(timeout=30)
        self.store.close()


class NoRunner:
    """A runner that runs nothing: for an app whose batches never run."""

    health = "ready"
    online = None

    def submit(self, batch_id: str) -> None:
        pass

    def cancel(self, batch_id: str) -> None:
        pass


def batch_lines(ids: list[str], url: str = "/v1/chat/completions") -> bytes:
    """An OpenAI batch input file: one chat (or completions) request per id."""
    body = (
        (lambda i: {"model": "tiny", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4})
        if url == "/v1/chat/completions"
        else (lambda i: {"model": "tiny", "prompt": f"say {i}", "max_tokens": 4})
    )
    return b"".join(orjson.dumps({"custom_id": i, "method": "POST", "url": url, "body": body(i)}) + b"\n" for i in ids)


def upload(client: openai.OpenAI, data: bytes, name: str = "in.jsonl") -> openai.types.FileObject:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def create(client: openai.OpenAI, file_id: str, endpoint: str = "/v1/chat/completions") -> openai.types.Batch:
    """``batches.create`` of ``file_id`` on ``endpoint``, window 24h."""
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def wait_done(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = DONE) -> openai.types.Batch:
    """Poll ``batches.retrieve`` until the batch is in one of ``statuses``."""
    found: list[openai.types.Batch] = []
    wait_for(lambda: found.append(client.batches.retrieve(batch_id)) or found[-1].status in statuses, timeout=60)
    return found[-1]


def records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def usage_of(lines: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt, completion) tokens summed over the ``usage`` of output ``lines``."""
    usages = [line["response"]["body"]["usage"] for line in lines]
    return sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)


def stopped_mid_batch(serve: Callable[..., Server], rows: int = 30) -> tuple[openai.types.Batch, list[str]]:
    """A server (``serve``: the tests' fixture) runs a batch of ``rows`` on a
    slow fake engine and is closed after three engine steps: the batch stays
    ``in_progress`` with its finished rows in the spool. Returns it and its ids."""
    server = serve(engine=lambda: FakeEngine(step_delay=0.1))
    client = server.client()
    ids = [f"r{i}" for i in range(rows)]
    batch = create(client, upload(client, batch_lines(ids)).id)
    wait_for(lambda: bool(server.engines) and server.engines[0].steps >= 3)
    server.close()
    return batch, ids
