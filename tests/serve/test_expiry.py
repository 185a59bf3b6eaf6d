"""A batch past its ``completion_window`` (``expires_at``) ends ``expired``
as OpenAI's do (issue 35): the rows finished so far are published as its
output, every other request is in its errors file with code
``batch_expired``, each ``custom_id`` exactly once across the two. Whether
it expires while it runs, while it waits, or while no server runs it. The
tests move ``expires_at`` in the store (the only window OpenAI accepts is
24h); the engine is a fake (the orchestration, not inference)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from fakes import FakeEngine, wait_for
from serving import Server, batch_lines, create, records, stopped_mid_batch, upload, wait_done

from bulkinfer.serve.publish import EXPIRED_MESSAGE
from bulkinfer.serve.store import Store, now


def outcome(client: openai.OpenAI, batch: openai.types.Batch) -> tuple[list[str], list[dict[str, Any]]]:
    """The custom_ids of the output file, and the records of the errors file."""
    return [r["custom_id"] for r in records(client, batch.output_file_id)], records(client, batch.error_file_id)


def assert_every_id_once(ids: list[str], finished: list[str], errors: list[dict[str, Any]]) -> None:
    assert Counter(finished) + Counter(e["custom_id"] for e in errors) == Counter(ids)


def test_a_running_batch_past_its_window_publishes_what_finished_and_expires_the_rest(
    serve: Callable[..., Server],
) -> None:
    server = serve(engine=lambda: FakeEngine(step_delay=0.1))
    client = server.client()
    ids = [f"r{i}" for i in range(60)]
    batch = create(client, upload(client, batch_lines(ids)).id)
    wait_for(lambda: (client.batches.retrieve(batch.id).request_counts or batch.request_counts).completed >= 6)
    server.store.update(batch.id, expires_at=now() - 1)
    done = wait_done(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None and done.completed_at is None
    finished, errors = outcome(client, done)
    assert 6 <= len(finished) < len(ids)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert errors[0]["error"]["message"] == EXPIRED_MESSAGE and errors[0]["response"] is None
    assert_every_id_once(ids, finished, errors)
    lines = [e["line"] for e in errors]
    assert lines == sorted(lines)  # in input order, each with its line
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (60, len(finished), len(errors))
    assert done.usage is not None and done.usage.output_tokens > 0  # the finished rows' tokens


def test_a_batch_that_expired_while_no_server_ran_it_is_expired_at_the_next_start(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    batch, ids = stopped_mid_batch(serve)
    store = Store(tmp_path / "data")  # the state as the next start finds it (the serve fixture's), its window moved
    store.update(batch.id, expires_at=now() - 1)
    store.close()
    again = serve()
    client = again.client()
    done = wait_done(client, batch.id)
    assert done.status == "expired"
    finished, errors = outcome(client, done)
    assert finished and errors
    assert_every_id_once(ids, finished, errors)
    assert [e.steps for e in again.engines] == [0]  # the server's engine (started with it) ran nothing
