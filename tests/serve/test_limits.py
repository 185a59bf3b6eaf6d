"""Limits and corners of the server: the lines-per-batch limit, the
declared-size check of an upload, and the keyless mode
(any bearer is the tenant ``default``), metadata limits, and the error
shape of unknown routes, wrong methods and bodies that are not JSON."""

from __future__ import annotations

import errno
import gzip
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from serving import NoRunner, Server, batch_lines, upload

from bulkinfer.serve.api import Limits, create_app
from bulkinfer.serve.store import Store
from bulkinfer.serve.validate import validate_input


def test_a_file_over_the_lines_limit_is_refused_at_validation(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(batch_lines(["a", "b", "c", "d"]))
    assert validate_input(path, "/v1/chat/completions", max_lines=4) == (4, [])
    count, errors = validate_input(path, "/v1/chat/completions", max_lines=3)
    assert errors == [
        {"code": "too_many_requests", "message": "the file has more than 3 requests", "param": None, "line": None}
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n")
    assert [e["code"] for e in validate_input(empty, "/v1/completions")[1]] == ["empty_file"]


def test_a_compressed_file_or_an_archive_is_one_error_not_a_line_each(tmp_path: Path) -> None:
    packed = tmp_path / "in.jsonl"
    packed.write_bytes(gzip.compress(batch_lines([f"r{i}" for i in range(50)])))
    assert validate_input(packed, "/v1/chat/completions") == (
        0,
        [
            {
                "code": "invalid_file",
                "message": "the file is gzip-compressed; a batch's input file is plain JSONL: upload it decompressed",
                "param": None,
                "line": None,
            }
        ],
    )
    packed.write_bytes(b"PK\x03\x04" + bytes(100))
    (error,) = validate_input(packed, "/v1/chat/completions")[1]
    assert error["code"] == "invalid_file" and "is a zip archive" in error["message"]


def test_an_upload_declared_over_the_limit_is_413_before_its_body_is_read(serve: Callable[..., Server]) -> None:
    server = serve(limits=Limits(max_file_bytes=1000))
    big = b"x" * (200 * 1024)
    response = server.http.post(
        "/v1/files",
        headers={"Authorization": "Bearer key-a"},
        files={"file": ("a.jsonl", big)},
        data={"purpose": "batch"},
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"


def test_without_keys_any_bearer_is_the_default_tenant(tmp_path: Path) -> None:
    store = Store(tmp_path)
    server = Server.__new__(Server)  # only its client(): no worker needed
    server.http = TestClient(create_app(store, {}, NoRunner(), model="tiny"))
    one, two = server.client("anything"), server.client("something-else")
    file = upload(one, batch_lines(["a"]))
    assert two.files.retrieve(file.id).id == file.id
    assert server.http.get("/v1/files").status_code == 401  # still a bearer is needed
    store.close()


def test_the_cli_imports_no_web_server_until_serve_runs() -> None:
    code = (
        "import sys\n"
        "import bulkinfer.cli\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'bulkinfer.serve') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registering_a_batch_output_twice_gives_the_same_file(tmp_path: Path) -> None:
    store = Store(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"{}\n")
    first = store.register_file("alice", "b_output.jsonl", "batch_output", out)
    assert store.register_file("alice", "b_output.jsonl", "batch_output", out) == first
    assert [f["id"] for f in store.files("alice")[0]] == [first["id"]]
    store.close()


def test_a_streamed_upload_without_a_declared_size_is_cut_off_at_the_limit(serve: Callable[..., Server]) -> None:
    server = serve(limits=Limits(max_file_bytes=1000))

    def body() -> Iterator[bytes]:  # chunked: no Content-Length
        yield b'--b\\r\\nContent-Disposition: form-data; name="purpose"\\r\\n\\r\\nbatch\\r\\n'
        yield b'--b\\r\\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\\r\\n\\r\\n'
        for _ in range(64):  # 4 MB
            yield b"x" * 65536
        yield b"\\r\\n--b--\\r\\n"

    response = server.http.post(
        "/v1/files",
        headers={"Authorization": "Bearer key-a", "Content-Type": "multipart/form-data; boundary=b"},
        content=body(),
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"
    assert "content-length" not in response.request.headers  # found by counting, not declared
    assert list(server.store.files_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("raised", "status", "code", "says"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), 507, "insufficient_storage", "(ENOSPC)"),
        (sqlite3.OperationalError("database or disk is full"), 507, "insufficient_storage", "disk is full"),
        (PermissionError(errno.EACCES, "Permission denied"), 500, None, "(EACCES)"),
    ],
)
def test_a_data_directory_that_cannot_be_written_is_an_openai_error_not_a_bare_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: Exception, status: int, code: str | None, says: str
) -> None:
    """A full disk at 3 a.m.: the client reads why (it got "Internal Server Error" and no body)."""
    store = Store(tmp_path / "data")

    def save_file(*args: Any, **kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(store, "save_file", save_file)
    client = openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="k",
        http_client=TestClient(create_app(store, {"k": "t"}, NoRunner()), raise_server_exceptions=False),
        max_retries=0,
    )
    with pytest.raises(openai.APIStatusError) as failed:
        upload(client, batch_lines(["a"]))
    error = failed.value.body
    assert failed.value.status_code == status and isinstance(error, dict)
    assert error["type"] == "server_error" and error["code"] == code and says in error["message"], error
    store.close()


def test_metadata_past_openais_limits_is_a_400_naming_metadata(tmp_path: Path) -> None:
    store = Store(tmp_path)
    client = openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="k",
        http_client=TestClient(create_app(store, {}, NoRunner(), model="tiny")),
        max_retries=0,
    )
    file = upload(client, batch_lines(["a"]))
    fits = {"k" * 64: "v" * 512, **{f"k{i}": "v" for i in range(15)}}
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {**fits, "one-more": "v"}):
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata=metadata)  # fmt: skip
        assert bad.value.param == "metadata"
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata=fits
    )
    assert batch.metadata == fits
    store.close()


def test_unknown_routes_wrong_methods_and_bad_json_answer_in_openais_error_shape(tmp_path: Path) -> None:
    store = Store(tmp_path)
    http = TestClient(create_app(store, {}, NoRunner(), model="tiny"))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.get("/nowhere", cast_to=object)
    assert missing.value.body == {
        "message": "Invalid URL (GET /v1/nowhere)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.APIStatusError) as wrong:
        client.delete("/batches", cast_to=object)
    assert wrong.value.status_code == 405 and "DELETE /v1/batches" in wrong.value.message
    assert wrong.value.response.headers["allow"] == "GET, POST"  # every route's of the path, not the first's
    bad = http.post(
        "/v1/batches", headers={"Authorization": "Bearer k", "Content-Type": "application/json"}, content=b"{bad"
    )
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON: ")
    store.close()
