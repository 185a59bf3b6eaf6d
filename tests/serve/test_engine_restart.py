"""The engine comes back (issue 35): an engine that dies during a batch is
closed and replaced after a back-off, the batch resumes from its journal on
the new one and completes with every ``custom_id`` once; ``/health`` says
``starting`` meanwhile and ``ready`` after. An engine that keeps dying fails
the batch (``engine_failed``) after the last restart and ``/health`` says
``failed`` (503) until a later batch gets a working engine. Fake engines
(the orchestration, not inference)."""

from __future__ import annotations

import errno
import sqlite3
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from fakes import FakeEngine
from serving import Server, batch_lines, create, records, upload, wait_done

import bulkinfer.serve.worker
from bulkinfer.io.spool import Spool
from bulkinfer.serve.access import ACCESS_LOGGER


@pytest.fixture(autouse=True)
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulkinfer.serve.worker, "ENGINE_RESTART_DELAYS_S", (0.3, 0.3))


def engines(crashes: int, seen: list[str], server: list[Server]) -> Callable[[], FakeEngine]:
    """A factory of fake engines: the first ``crashes`` die at their third
    step; each start notes the health the server reports while it starts."""
    made = [0]

    def make() -> FakeEngine:
        made[0] += 1
        if server:
            seen.append(server[0].http.get("/health").json()["status"])
        return FakeEngine(step_delay=0.05, crash_at=3 if made[0] <= crashes else None)

    return make


def test_a_dead_engine_is_replaced_and_the_batch_resumes_on_the_new_one(serve: Callable[..., Server]) -> None:
    seen: list[str] = []
    holder: list[Server] = []
    server = serve(engine=engines(1, seen, holder))
    holder.append(server)
    client = server.client()
    ids = [f"r{i}" for i in range(30)]
    done = wait_done(client, create(client, upload(client, batch_lines(ids)).id).id)
    assert done.status == "completed", done.errors
    assert Counter(r["custom_id"] for r in records(client, done.output_file_id)) == Counter(ids)
    assert len(server.engines) == 2 and server.engines[0].closed and not server.engines[1].closed
    assert server.engines[1].steps < 15  # the new engine ran only what the dead one had not finished
    assert seen == ["starting"]  # the restart (the first engine started with the server, before it was seen)
    assert server.http.get("/health").json() == {"status": "ready"}


def test_an_engine_that_keeps_dying_fails_the_batch_then_a_later_batch_gets_a_new_one(
    serve: Callable[..., Server],
) -> None:
    seen: list[str] = []
    holder: list[Server] = []
    server = serve(engine=engines(3, seen, holder))  # the first start and both restarts die
    holder.append(server)
    client = server.client()
    file = upload(client, batch_lines([f"r{i}" for i in range(30)]))
    failed = wait_done(client, create(client, file.id).id)
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data
    assert failed.errors.data[0].code == "engine_failed" and "died 3 times" in (failed.errors.data[0].message or "")
    health = server.http.get("/health")
    assert (health.status_code, health.json()) == (503, {"status": "failed"})
    assert len(server.engines) == 3 and all(e.closed for e in server.engines)
    later = wait_done(client, create(client, file.id).id)
    assert later.status == "completed"
    assert server.http.get("/health").status_code == 200


def test_a_full_disk_stalls_the_batch_and_it_resumes_once_there_is_room(
    serve: Callable[..., Server], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At 3 a.m. the disk fills mid-batch: the run's spool write fails (ENOSPC), then so does
    the store's record of the failure (SQLite: "database or disk is full"). The worker thread
    died there and every later batch waited forever; now the batch keeps its status, the
    worker waits (STALL_DELAYS_S) and resumes it from its journal: every custom_id once."""
    monkeypatch.setattr(bulkinfer.serve.worker, "STALL_DELAYS_S", (0.2,))
    full = {"spool": 1, "store": 1}  # failures left to inject
    write_raw = Spool.write_raw

    def spool_write(self: Spool, line: bytes) -> None:
        if full["spool"] and b'"custom_id":"r7"' in line:
            full["spool"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        write_raw(self, line)

    monkeypatch.setattr(Spool, "write_raw", spool_write)
    server = serve(engine=lambda: FakeEngine(step_delay=0.02))
    move = server.store.move

    def store_move(batch_id: str, from_: tuple[str, ...], status: str, **fields: Any) -> bool:
        if full["store"] and status == "failed":
            full["store"] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        return move(batch_id, from_, status, **fields)

    monkeypatch.setattr(server.store, "move", store_move)
    client = server.client()
    ids = [f"r{i}" for i in range(20)]
    with caplog.at_level("WARNING", logger=ACCESS_LOGGER):
        done = wait_done(client, create(client, upload(client, batch_lines(ids)).id).id)
        assert done.status == "completed", done.errors
        assert Counter(r["custom_id"] for r in records(client, done.output_file_id)) == Counter(ids)
        # a bug whose failure record cannot be written either stalls too, then fails the batch once it can
        failing = RuntimeError("a bug")
        monkeypatch.setattr(bulkinfer.serve.worker, "run", lambda *a, **k: (_ for _ in ()).throw(failing))
        failed = wait_done(client, create(client, upload(client, batch_lines(["x"])).id).id)
    assert failed.status == "failed" and failed.errors is not None and "a bug" in str(failed.errors.data)
    stalls = [orjson.loads(r.getMessage()) for r in caplog.records if "stalled" in r.getMessage()]
    reasons = [s["stalled"] for s in stalls]
    assert len(reasons) == 2 and reasons[0].startswith("cannot write ") and "(ENOSPC)" in reasons[0], reasons
    assert reasons[1] == "the state database: database or disk is full", reasons
    assert not any("--resume" in reason for reason in reasons)  # the CLI's advice: the server tries again itself
    assert server.worker.is_alive() and full == {"spool": 0, "store": 0}
