"""The status page and the files it links to: a tenant sees its own batches
(status, progress, counts, tokens/s, links) and no other's; a browser logs
in by HTTP Basic with the key as password; everything is HTML-escaped."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import orjson
from fakes import FakeEngine, wait_for
from fastapi.testclient import TestClient
from serving import NoRunner, Server, batch_lines, create, upload, wait_done

from bulkinfer.serve.api import create_app
from bulkinfer.serve.store import Store


def page(server: Server, key: str) -> str:
    response = server.http.get("/", auth=("anyone", key))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    return response.text


def test_the_page_shows_a_finished_batch_with_its_counts_and_links_to_its_own_tenant_only(
    serve: Callable[..., Server],
) -> None:
    server = serve(engine=lambda: FakeEngine(reject={"bad"}))
    client = server.client("key-a")
    batch = wait_done(client, create(client, upload(client, batch_lines(["a", "bad", "c", "d"])).id).id)
    assert batch.status == "completed"
    rate = orjson.loads((server.store.batch_dir(batch.id) / "output.report.json").read_bytes())["throughput"]

    html = page(server, "key-a")
    assert '<meta http-equiv="refresh" content="5">' in html and "<script" not in html
    row = re.search(rf'<tr id="{batch.id}">(.*?)</tr>', html, re.S)
    assert row is not None
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)]
    assert cells[2:7] == ["completed", "4 of 4\n100%", "3", "1", "4"]
    assert cells[7] == f"{rate['completion_tokens_per_s']:.1f} (report)"
    links = re.findall(r'<a href="([^"]+)">', row.group(1))
    assert links == [f"batches/{batch.id}/{what}" for what in ("output", "errors", "report")]

    output, errors, report = (server.http.get(f"/{link}", auth=("", "key-a")) for link in links)
    assert sorted(orjson.loads(line)["custom_id"] for line in output.text.splitlines()) == ["a", "c", "d"]
    assert [orjson.loads(line)["custom_id"] for line in errors.text.splitlines()] == ["bad"]
    assert report.headers["content-type"].startswith("text/html") and "<html" in report.text
    assert output.headers["content-type"].startswith("text/plain")

    assert batch.id not in page(server, "key-b")
    for link in links:
        assert server.http.get(f"/{link}", auth=("", "key-b")).status_code == 404
    assert server.http.get("/", headers={"Authorization": "Bearer key-a"}).status_code == 200

    assert batch.output_file_id is not None
    client.files.delete(batch.output_file_id)  # deleted, or expired: no link to a file that is gone
    row = re.search(rf'<tr id="{batch.id}">(.*?)</tr>', page(server, "key-a"), re.S)
    assert row is not None and re.findall(r'<a href="([^"]+)">', row.group(1)) == links[1:]


def test_a_wrong_or_missing_key_is_401_asking_the_browser_for_basic_auth(serve: Callable[..., Server]) -> None:
    server = serve()
    for response in (
        server.http.get("/", auth=("alice", "wrong")),
        server.http.get("/"),
        server.http.get("/batches/batch_x/output", auth=("alice", "wrong")),
        server.http.get("/", headers={"Authorization": "Bearer wrong"}),
    ):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == 'Basic realm="bulkinfer"'
    assert server.http.get("/v1/files", auth=("", "key-a")).status_code == 401  # the API takes bearer keys only


def test_a_running_batch_shows_its_live_progress_and_tokens_per_s(serve: Callable[..., Server]) -> None:
    server = serve(engine=lambda: FakeEngine(step_delay=0.2))
    client = server.client()
    batch = create(client, upload(client, batch_lines([f"r{i}" for i in range(60)])).id)
    wait_for(lambda: (client.batches.retrieve(batch.id).request_counts or batch.request_counts).completed >= 2)
    html = page(server, "key-a")
    row = re.search(rf'<tr id="{batch.id}">(.*?)</tr>', html, re.S)
    assert row is not None and "in_progress" in row.group(1) and "(running)" in row.group(1)
    assert re.search(r'<progress value="\d+" max="60">', row.group(1))
    assert "batches/" not in row.group(1)  # no output yet: no links
    assert server.http.get(f"/batches/{batch.id}/output", auth=("", "key-a")).status_code == 404
    client.batches.cancel(batch.id)
    assert wait_done(client, batch.id).status == "cancelled"
    row = re.search(rf'<tr id="{batch.id}">(.*?)</tr>', page(server, "key-a"), re.S)
    assert row is not None and "(ran)" in row.group(1) and f"batches/{batch.id}/output" in row.group(1)


def test_without_keys_the_page_needs_no_login_and_escapes_what_it_shows(tmp_path: Path) -> None:
    store = Store(tmp_path)
    http = TestClient(create_app(store, {}, NoRunner(), model='<script>alert("x")</script>'))
    response = http.get("/")
    assert response.status_code == 200
    assert "<script>" not in response.text and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in response.text
    assert "Tenant <code>default</code>" in response.text and "No batches yet" in response.text
    store.close()
