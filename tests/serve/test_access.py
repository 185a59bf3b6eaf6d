"""Access logs: one JSON line per request, with the tenant's name but never
its key, the path without its query string; written to a stream as
``bulkinfer serve`` sets it up."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from serving import Server

from bulkinfer.cli.serve_command import log_access_to
from bulkinfer.serve.access import ACCESS_LOGGER

FIELDS = {"time", "method", "path", "status", "duration_ms", "tenant", "client"}


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


def test_each_request_is_one_json_line_with_its_tenant_and_no_key_or_query(
    serve: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve()
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    server.client("key-b").files.list(extra_query={"purpose": "batch", "secret": "s3cr3t"})
    server.http.get("/v1/batches", headers={"Authorization": "Bearer wrong-key"})
    server.http.get("/metrics")
    server.http.get("/v1/files/file-nope", headers={"Authorization": "Bearer key-a"})
    found = lines(caplog)
    assert [set(line) for line in found] == [FIELDS] * 4
    assert [(x["method"], x["path"], x["status"], x["tenant"]) for x in found] == [
        ("GET", "/v1/files", 200, "bob"),
        ("GET", "/v1/batches", 401, None),
        ("GET", "/metrics", 200, None),
        ("GET", "/v1/files/file-nope", 404, "alice"),
    ]
    assert all(x["client"] == "testclient" and x["duration_ms"] >= 0 and x["time"].endswith("+00:00") for x in found)
    text = caplog.text
    assert not any(secret in text for secret in ("key-a", "key-b", "wrong-key", "s3cr3t"))


def test_the_cli_writes_the_access_log_to_its_stream_and_only_there(
    serve: Callable[..., Server], capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    saved = (logger.level, logger.propagate)
    stream = io.StringIO()
    handler = log_access_to(stream)
    try:
        serve().http.get("/health")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    (line,) = stream.getvalue().splitlines()
    assert orjson.loads(line)["path"] == "/health" and orjson.loads(line)["status"] == 200
    assert capsys.readouterr().err == ""
