"""A server killed by SIGKILL mid-batch and started again on the same data
directory finishes the batch: every ``custom_id`` ends exactly once. The
server is a real uvicorn process on 127.0.0.1 driven by the ``openai``
client over HTTP; its engine is a slow fake (the orchestration, not inference)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from fakes import wait_for
from serving import batch_lines, create, records, upload, wait_done

TESTS = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[[int], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), str(TESTS / "serve")])}

    def start(port: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, str(TESTS / "serve" / "server_driver.py"), str(tmp_path / "data"), str(port)], env=env
        )
        procs.append(proc)
        wait_for(lambda: _up(port) or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, "the server did not start"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigkill_mid_batch_then_restart_completes_every_custom_id_once(
    start_server: Callable[[int], subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    port = free_port()
    server = start_server(port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="key-a", max_retries=0)
    ids = [f"r{i}" for i in range(60)]
    batch = create(client, upload(client, batch_lines(ids)).id)
    counts: list[openai.types.BatchRequestCounts | None] = []
    wait_for(
        lambda: (
            counts.append(client.batches.retrieve(batch.id).request_counts)
            or (counts[-1] is not None and counts[-1].completed >= 6)
        )
    )
    server.send_signal(signal.SIGKILL)
    server.wait()
    assert counts[-1] is not None and counts[-1].completed < 60  # killed mid-batch
    start_server(port)
    done = wait_done(client, batch.id)
    assert done.status == "completed", done.errors
    finished = [r["custom_id"] for r in records(client, done.output_file_id)]
    assert sorted(finished) == sorted(ids)  # each once: none lost, none twice
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (60, 0)
    report = orjson.loads((tmp_path / "data" / "batches" / batch.id / "output.report.json").read_bytes())
    assert report["resumed"]["completed"] >= 6  # the rows finished before the kill were kept, not run again
