"""The Batch API through the official ``openai`` client (its pydantic types
validate every response): a batch runs to ``completed`` through bulkinfer's
core, tenants are kept apart, bad input fails with line numbers, uploads
are limited, batches run FIFO, a cancel publishes the rows finished so far.
The engine is a fake: this tests the server's orchestration, not inference."""

from __future__ import annotations

from collections.abc import Callable

import openai
import orjson
import pytest
from fakes import FakeEngine, wait_for
from serving import Server, batch_lines, create, records, stopped_mid_batch, upload, usage_of, wait_done

from bulkinfer.serve.api import Limits


def test_a_batch_runs_to_completed_and_every_custom_id_is_in_the_output_once(serve: Callable[..., Server]) -> None:
    server = serve()
    client = server.client()
    ids = [f"r{i}" for i in range(7)]
    file = upload(client, batch_lines(ids))
    assert (file.purpose, file.bytes, file.filename) == ("batch", len(batch_lines(ids)), "in.jsonl")
    assert client.files.retrieve(file.id).id == file.id
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"team": "x"}
    )
    assert (
        batch.status == "validating"
        and batch.metadata == {"team": "x"}
        and batch.expires_at == batch.created_at + 86400
    )

    done = wait_done(client, batch.id)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 7, 0)
    assert done.in_progress_at is not None and done.finalizing_at is not None and done.completed_at is not None
    assert done.error_file_id is None
    report = orjson.loads((server.store.batch_dir(batch.id) / "output.report.json").read_bytes())
    tokens, row = report["tokens"], server.store.batch("alice", batch.id)
    assert row is not None and row["throughput"] == {
        "completion_tokens_per_s": report["throughput"]["completion_tokens_per_s"],
        "measured": "report",
    }
    assert batch.model == done.model == "tiny" and batch.usage is None and done.usage is not None
    assert (
        (done.usage.input_tokens, done.usage.output_tokens)
        == (tokens["prompt"], tokens["completion"])
        == (usage_of(records(client, done.output_file_id)))
    )
    assert done.usage.total_tokens == tokens["prompt"] + tokens["completion"] and tokens["completion"] == 7
    assert done.usage.input_tokens_details.cached_tokens == done.usage.output_tokens_details.reasoning_tokens == 0
    lines = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in lines) == sorted(ids)
    for line in lines:
        body = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
        assert body.choices[0].message.content == f"echo {line['custom_id']}"
    output = client.files.retrieve(done.output_file_id or "")
    assert output.purpose == "batch_output"
    assert {f.id for f in client.files.list()} == {file.id, output.id}
    assert client.models.list().data[0].id == "tiny"


def test_completions_endpoint_and_batch_list_pages_newest_first(serve: Callable[..., Server]) -> None:
    client = serve().client()
    file = upload(client, batch_lines(["a", "b"], url="/v1/completions"))
    made = [create(client, file.id, "/v1/completions").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == [made[0]] and not rest.has_more
    assert [b.id for b in client.batches.list()] == made[::-1]  # the SDK's auto-paging
    done = wait_done(client, made[0])
    assert done.status == "completed"
    (line, _) = records(client, done.output_file_id)
    assert openai.types.Completion.model_validate(line["response"]["body"]).choices[0].text.startswith("echo ")


def test_a_wrong_key_is_401_and_another_tenants_ids_are_404(serve: Callable[..., Server]) -> None:
    server = serve()
    alice, bob = server.client("key-a"), server.client("key-b")
    file = upload(alice, batch_lines(["x"]))
    batch = create(alice, file.id)
    with pytest.raises(openai.AuthenticationError) as caught:
        server.client("wrong").files.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    no_bearer = server.http.get("/v1/batches")
    assert no_bearer.status_code == 401 and set(no_bearer.json()["error"]) == {"message", "type", "param", "code"}
    for call in (
        lambda: bob.files.retrieve(file.id),
        lambda: bob.files.content(file.id),
        lambda: bob.files.delete(file.id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: create(bob, file.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(bob.batches.list()) == [] and list(bob.files.list()) == []
    assert wait_done(alice, batch.id).status == "completed"


def test_a_malformed_file_fails_the_batch_with_the_bad_line_numbers(serve: Callable[..., Server]) -> None:
    client = serve().client()
    good = batch_lines(["a"]).decode()
    lines = [
        good,
        "{not json\n",
        good,  # a custom_id used twice
        orjson.dumps({"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {}}).decode() + "\n",
        orjson.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {}}).decode() + "\n",
        orjson.dumps({"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": []}).decode() + "\n",
        "\n",
        orjson.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}).decode() + "\n",
    ]
    file = upload(client, "".join(lines).encode())
    batch = wait_done(
        client,
        create(client, file.id).id,
    )
    assert batch.status == "failed" and batch.failed_at is not None and batch.errors is not None
    found = [(e.line, e.code, e.param) for e in batch.errors.data or []]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_request", "method"),
        (5, "mismatched_endpoint", "url"),
        (6, "invalid_request", "body"),
        (8, "missing_required_parameter", "custom_id"),
    ]
    assert batch.output_file_id is None


def test_an_upload_over_the_limit_is_413_and_leaves_no_file(serve: Callable[..., Server]) -> None:
    server = serve(limits=Limits(max_file_bytes=100))
    client = server.client()
    with pytest.raises(openai.APIStatusError) as caught:
        upload(client, batch_lines([f"r{i}" for i in range(5)]))
    assert caught.value.status_code == 413 and caught.value.code == "file_too_large"
    assert list(client.files.list()) == []
    assert [p.name for p in server.store.files_dir.iterdir()] == []
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def test_three_batches_submitted_at_once_complete_in_fifo_order(serve: Callable[..., Server]) -> None:
    server = serve(engine=lambda: FakeEngine(step_delay=0.01))
    client = server.client()
    files = [upload(client, batch_lines([f"{k}-{i}" for i in range(6)])) for k in "xyz"]
    batches = [create(client, f.id) for f in files]
    done = [wait_done(client, b.id) for b in batches]
    assert [b.status for b in done] == ["completed"] * 3
    in_progress = [b.in_progress_at or 0 for b in done]
    completed = [b.completed_at or 0 for b in done]
    assert in_progress == sorted(in_progress) and completed == sorted(completed)
    for batch, key in zip(done, "xyz", strict=True):
        assert sorted(r["custom_id"] for r in records(client, batch.output_file_id)) == sorted(
            f"{key}-{i}" for i in range(6)
        )
    assert len(server.engines) == 1  # one warm engine for every batch


def test_counts_grow_while_a_batch_runs_and_cancel_publishes_the_finished_rows(serve: Callable[..., Server]) -> None:
    server = serve(engine=lambda: FakeEngine(step_delay=0.25))
    client = server.client()
    ids = [f"r{i}" for i in range(60)]
    file = upload(client, batch_lines(ids))
    batch = create(client, file.id)
    live = wait_done(client, batch.id, ("in_progress",))
    assert live.request_counts is not None and live.request_counts.total == 60
    running = []  # request_counts grow while the batch runs
    wait_for(lambda: running.append(client.batches.retrieve(batch.id).request_counts) or running[-1].completed >= 2)
    assert running[-1].failed == 0 and client.batches.retrieve(batch.id).status == "in_progress"
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at is not None and done.cancelled_at is not None
    finished = [r["custom_id"] for r in records(client, done.output_file_id)]
    assert 0 < len(finished) < len(ids) and len(set(finished)) == len(finished) and set(finished) <= set(ids)
    assert done.request_counts is not None and done.request_counts.completed == len(finished)
    unrun = records(client, done.error_file_id)  # every request not run: batch_cancelled, once
    assert {e["error"]["code"] for e in unrun} == {"batch_cancelled"}
    assert sorted(finished + [e["custom_id"] for e in unrun]) == sorted(ids)
    assert (done.request_counts.failed, done.request_counts.total) == (len(unrun), len(ids))
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == usage_of(
        records(client, done.output_file_id)
    )
    assert done.usage.output_tokens == len(finished)  # the fake engine: one completion token a row
    # the next batch runs on the same engine, clean: the cancelled run's requests were aborted
    assert server.engines[0].aborted
    completed = wait_done(client, create(client, file.id).id)
    assert completed.status == "completed", completed.errors
    assert sorted(r["custom_id"] for r in records(client, completed.output_file_id)) == sorted(ids)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(completed.id)


def test_a_queued_batch_cancels_without_running_or_expires_when_picked_up_late(serve: Callable[..., Server]) -> None:
    server = serve(engine=lambda: FakeEngine(step_delay=0.1))
    client = server.client()
    file = upload(client, batch_lines([f"r{i}" for i in range(20)]))
    first, queued, late = create(client, file.id), create(client, file.id), create(client, file.id)
    server.store.update(late.id, expires_at=late.created_at - 1)
    assert client.batches.cancel(queued.id).status == "cancelled"
    done = client.batches.retrieve(queued.id)
    assert done.in_progress_at is None and done.output_file_id is None
    unrun = records(client, done.error_file_id)  # cancelled while validating: every request batch_cancelled
    assert [(e["custom_id"], e["error"]["code"]) for e in unrun] == [(f"r{i}", "batch_cancelled") for i in range(20)]
    assert done.request_counts is not None and (done.request_counts.failed, done.request_counts.total) == (20, 20)
    expired = wait_done(client, late.id)
    assert expired.status == "expired" and expired.expired_at is not None and expired.output_file_id is None
    assert expired.in_progress_at is None  # never run
    errors = records(client, expired.error_file_id)  # every request: batch_expired, in input order (as OpenAI's)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"r{i}", "batch_expired") for i in range(20)]
    assert wait_done(client, first.id).status == "completed"


def test_a_batch_left_in_progress_resumes_at_the_next_start_and_every_custom_id_ends_once(
    serve: Callable[..., Server],
) -> None:
    batch, ids = stopped_mid_batch(serve)
    again = serve()
    client = again.client()
    done = wait_done(client, batch.id)
    assert done.status == "completed"
    assert sorted(r["custom_id"] for r in records(client, done.output_file_id)) == sorted(ids)
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed) == (30, 30)
    assert again.engines[0].steps < 15  # the resumed run ran only the rest (2 rows a step)


def test_a_bom_blank_lines_and_an_unknown_top_level_key_run_as_bulkinfer_run_reads_them(
    serve: Callable[..., Server],
) -> None:
    client = serve().client()
    a, b = batch_lines(["a"]), batch_lines(["b"])
    b = b.replace(b'{"custom_id"', b'{"foo":1,"custom_id"')  # run ignores a top-level key it does not read
    batch = wait_done(client, create(client, upload(client, b"\xef\xbb\xbf" + a + b"\n\r\n" + b + b"\n").id).id)
    assert batch.status == "completed", batch.errors
    assert sorted(r["custom_id"] for r in records(client, batch.output_file_id)) == ["a", "b"]
    assert batch.request_counts is not None and batch.request_counts.total == 2  # the blank lines are no requests
