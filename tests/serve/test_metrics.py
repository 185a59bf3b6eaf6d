"""``GET /metrics``: Prometheus text read from the store at scrape time,
without a key, naming no tenant, key or id."""

from __future__ import annotations

from collections.abc import Callable

import orjson
from fakes import FakeEngine
from prometheus_client.parser import text_string_to_metric_families
from serving import KEYS, Server, batch_lines, create, upload, wait_done

from bulkinfer.serve.tables import STATUSES


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Each sample of ``/metrics``: (name, sorted labels) -> value."""
    response = server.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_count_batches_requests_and_tokens_from_the_reports(serve: Callable[..., Server]) -> None:
    server = serve(engine=lambda: FakeEngine(reject={"bad"}))
    before = scrape(server)
    assert before[("bulkinfer_batches", (("status", "completed"),))] == 0
    assert before[("bulkinfer_completion_tokens_per_second", ())] == 0
    client = server.client()
    batch = create(client, upload(client, batch_lines(["a", "b", "bad", "c"])).id)
    done = wait_done(client, batch.id)
    assert done.status == "completed"
    report = orjson.loads((server.store.batch_dir(batch.id) / "output.report.json").read_bytes())

    found = scrape(server)
    assert {s: found[("bulkinfer_batches", (("status", s),))] for s in STATUSES} == {
        s: 1 if s == "completed" else 0 for s in STATUSES
    }
    assert found[("bulkinfer_requests_total", (("outcome", "completed"),))] == 3
    assert found[("bulkinfer_requests_total", (("outcome", "failed"),))] == 1
    assert found[("bulkinfer_prompt_tokens_total", ())] == report["tokens"]["prompt"] > 0
    assert found[("bulkinfer_completion_tokens_total", ())] == report["tokens"]["completion"] == 3
    rate = report["throughput"]["completion_tokens_per_s"]
    assert found[("bulkinfer_completion_tokens_per_second", ())] == rate > 0
    assert before[("bulkinfer_files", (("purpose", "batch"),))] == 0
    assert found[("bulkinfer_files", (("purpose", "batch"),))] == 1
    assert found[("bulkinfer_file_bytes", (("purpose", "batch"),))] == len(batch_lines(["a", "b", "bad", "c"]))
    outputs = [done.output_file_id, done.error_file_id]
    assert found[("bulkinfer_files", (("purpose", "batch_output"),))] == 2
    assert found[("bulkinfer_file_bytes", (("purpose", "batch_output"),))] == sum(
        client.files.retrieve(f).bytes for f in outputs if f is not None
    )
    text = server.http.get("/metrics").text
    for secret in (*KEYS, *KEYS.values(), batch.id, batch.input_file_id):
        assert secret not in text
