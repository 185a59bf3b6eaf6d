"""Files that expire as OpenAI's do (an upload's ``expires_after``, a batch's
``output_expires_after``, 30 days for an upload that names none), the
sweeper that deletes them, files listed in pages, and ``models.retrieve``:
through the official ``openai`` client, whose types validate each answer.
The engine is a fake: this tests the server, not inference."""

from __future__ import annotations

import io
import sqlite3
from collections.abc import Callable
from pathlib import Path

import openai
import orjson
import pytest
from fakes import wait_for
from serving import Server, batch_lines, records, upload, wait_done

from bulkinfer.serve.access import ACCESS_LOGGER
from bulkinfer.serve.api import Limits
from bulkinfer.serve.retention import FileSweeper
from bulkinfer.serve.store import Store

HOUR, DAYS_30 = 3600, 30 * 24 * 3600


def test_uploads_and_batch_outputs_expire_when_asked_and_the_sweeper_deletes_them(
    serve: Callable[..., Server],
) -> None:
    server = serve()
    client = server.client()
    asked = client.files.create(
        file=("in.jsonl", io.BytesIO(batch_lines(["a", "b"]))),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": HOUR},
    )
    assert asked.expires_at == asked.created_at + HOUR
    assert client.files.retrieve(asked.id).expires_at == asked.expires_at
    default = upload(client, batch_lines(["c"]))
    assert default.expires_at == default.created_at + DAYS_30  # OpenAI's default for purpose "batch"

    batch = client.batches.create(
        input_file_id=asked.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 2 * HOUR},
    )
    done = wait_done(client, batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at == output.created_at + 2 * HOUR
    assert len(records(client, output.id)) == 2

    paths = {f["id"]: Path(f["path"]) for f in server.store.files("alice")[0]}
    assert FileSweeper(server.store, clock=lambda: asked.expires_at - 1).sweep() == []  # nothing is due yet
    assert FileSweeper(server.store, clock=lambda: output.created_at + 2 * HOUR).sweep() == [asked.id, output.id]
    for gone in (asked.id, output.id):
        assert not paths[gone].exists()
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(gone)
    assert [f.id for f in client.files.list()] == [default.id] and paths[default.id].exists()
    assert not server.store.batch_dir(batch.id).exists()  # its report and log went with its last file
    assert client.batches.retrieve(batch.id).output_file_id == output.id  # the batch object stays, as OpenAI's


def test_a_batch_directory_goes_once_its_batch_ended_and_no_file_of_it_is_left(tmp_path: Path) -> None:
    store = Store(tmp_path)
    source = store.save_file("alice", "in.jsonl", "batch", [b"{}\n"], 100)
    batch = store.add_batch("alice", source["id"], "/v1/completions", "24h", None)
    directory = store.batch_dir(batch["id"])
    directory.mkdir(parents=True)
    (directory / "output.report.html").write_text("<html></html>")
    files = []
    for name in ("output.jsonl", "output.errors.jsonl"):
        (directory / name).write_text("{}\n")
        files.append(store.register_file("alice", name, "batch_output", directory / name, None, HOUR))
    later = files[0]["created_at"] + HOUR
    store.update(batch["id"], status="finalizing")
    assert store.delete_file("alice", files[0]["id"]) and directory.exists()  # the batch is still publishing
    store.update(batch["id"], status="completed")
    assert store.drop_batch_dir(directory / "output.jsonl") is None and directory.exists()  # its errors file is left
    assert [(f["id"], f["batch_dir_removed"]) for f in store.expire_files(later)] == [(files[1]["id"], batch["id"])]
    assert not directory.exists() and store.batch("alice", batch["id"]) is not None
    assert store.drop_batch_dir(Path(source["path"])) is None  # an upload is no batch's
    store.close()


def test_an_input_file_expires_only_once_no_batch_reads_it(tmp_path: Path) -> None:
    store = Store(tmp_path)
    file = store.save_file("alice", "in.jsonl", "batch", [b"{}\n"], 100, expires_after=HOUR)
    batch = store.add_batch("alice", file["id"], "/v1/completions", "24h", None)
    later = file["created_at"] + HOUR
    for status in ("in_progress", "finalizing", "cancelling"):
        store.update(batch["id"], status=status)
        assert store.expire_files(later) == [], status  # its batch still reads it
    store.update(batch["id"], status="cancelled")
    assert [f["id"] for f in store.expire_files(later)] == [file["id"]]
    assert not Path(file["path"]).exists() and store.file("alice", file["id"]) is None
    store.close()


def test_a_server_told_to_keep_uploads_keeps_those_that_name_no_expiry(serve: Callable[..., Server]) -> None:
    client = serve(limits=Limits(batch_file_expiry=None)).client()
    assert upload(client, batch_lines(["a"])).expires_at is None


def test_a_bad_expiry_or_an_unknown_upload_field_is_refused_naming_it(serve: Callable[..., Server]) -> None:
    server = serve()
    client = server.client()
    data = batch_lines(["a"])
    for policy, param, words in (
        ({"anchor": "created_at", "seconds": 60}, "expires_after[seconds]", "greater than or equal to 3600"),
        ({"anchor": "created_at", "seconds": DAYS_30 + 1}, "expires_after[seconds]", "less than or equal to"),
        ({"anchor": "last_active_at", "seconds": HOUR}, "expires_after[anchor]", "'created_at'"),
        ({"anchor": "created_at"}, "expires_after[seconds]", "Field required"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch", expires_after=policy)  # type: ignore[arg-type]
        assert refused.value.param == param and words in refused.value.message, refused.value.message
    answer = server.http.post(
        "/v1/files",
        headers={"Authorization": "Bearer key-a"},
        data={"purpose": "batch", "expires_in": "3600"},
        files={"file": ("in.jsonl", data)},
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "expires_in"
    file = upload(client, data)
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 10},
        )
    assert refused.value.param == "output_expires_after.seconds"
    assert [f.id for f in client.files.list()] == [file.id]  # the refused uploads kept nothing


def test_files_are_listed_in_pages_in_either_order(serve: Callable[..., Server]) -> None:
    client = serve().client()
    ids = [upload(client, batch_lines([str(i)]), name=f"{i}.jsonl").id for i in range(5)]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[:2:-1][:2] and page.has_more
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # the client follows the pages
    assert [f.id for f in client.files.list(limit=3, order="asc")] == ids
    assert [f.id for f in client.files.list(after=ids[1], order="asc").data] == ids[2:]
    assert [f.id for f in client.files.list(after=ids[3]).data] == ids[2::-1]
    for bad, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.list(**bad)  # type: ignore[arg-type]
        assert refused.value.param == param


def test_the_served_model_is_retrieved_by_its_id(serve: Callable[..., Server]) -> None:
    client = serve().client()
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and "'tiny'" in missing.value.message


def test_files_created_in_the_same_second_keep_their_upload_order(tmp_path: Path) -> None:
    store = Store(tmp_path)
    ids = [store.save_file("alice", f"{i}.jsonl", "batch", [b"{}\n"], 100)["id"] for i in range(3)]
    assert [f["id"] for f in store.files("alice", newest_first=False)[0]] == ids
    store.close()


def test_a_sweep_that_fails_is_logged_and_the_next_one_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path)
    file = store.save_file("alice", "in.jsonl", "batch", [b"{}\n"], 100, expires_after=HOUR)
    calls: list[int] = []

    def clock() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database is locked")
        return file["created_at"] + HOUR

    sweeper = FileSweeper(store, every_s=0.01, clock=clock)
    with caplog.at_level("INFO", logger=ACCESS_LOGGER):
        sweeper.start()
        wait_for(lambda: store.file("alice", file["id"]) is None, timeout=10)
        sweeper.close()
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert lines[0]["file_expiry_failed"] == "the state database: database is locked"  # errors.write_reason
    assert lines[1]["file_expired"] == file["id"] and lines[1]["bytes"] == 3 and "error" not in lines[1]
    store.close()
