"""``GET /metrics``: the server's batches in Prometheus' text format.

Every value is read from the store when Prometheus scrapes (a custom
collector over :meth:`~bulkinfer.serve.store.Store.totals`), so the counters
survive a restart of the server, and each app has its own registry (never
``prometheus_client``'s global one). Nothing names a tenant, a key or an id.

- ``bulkinfer_batches{status}`` (gauge): batches in each status, every tenant's;
- ``bulkinfer_requests_total{outcome="completed"|"failed"}``: requests (rows)
  that ended, running batches' included;
- ``bulkinfer_prompt_tokens_total``, ``bulkinfer_completion_tokens_total``:
  tokens of the completed requests of completed and cancelled batches
  (their ``usage``);
- ``bulkinfer_completion_tokens_per_second`` (gauge): the running batch's,
  live since its run started; else the last completed batch's, from its
  report (generation seconds); 0 before any;
- ``bulkinfer_files{purpose}``, ``bulkinfer_file_bytes{purpose}`` (gauges):
  the files stored (uploads ``batch``, outputs ``batch_output``), every
  tenant's, until deleted or expired (:mod:`bulkinfer.serve.retention`).

Online requests (:class:`OnlineMetrics`, counted since the server started),
under vLLM's names where vLLM has the metric (``vllm/v1/metrics/loggers.py``;
the same buckets):

- ``vllm:time_to_first_token_seconds{model_name}`` and
  ``vllm:e2e_request_latency_seconds{model_name}`` (histograms), from the
  request's arrival at the server;
- ``bulkinfer_online_requests_total{endpoint, status}``: online requests by
  HTTP status (200, 400, 429, 503, 499: the client went away);
- ``bulkinfer_online_requests_in_flight`` (gauge).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bulkinfer.serve.store import Store
from bulkinfer.serve.tables import STATUSES


class StoreCollector:
    """The metrics of the module's list, from ``store`` at each :meth:`collect`."""

    def __init__(self, store: Store):
        self.store = store

    def collect(self) -> Iterator[Metric]:
        totals = self.store.totals()
        batches = GaugeMetricFamily("bulkinfer_batches", "Batches by status, every tenant's.", labels=["status"])
        for status in STATUSES:
            batches.add_metric([status], totals.batches.get(status, 0))
        yield batches
        requests = CounterMetricFamily(
            "bulkinfer_requests",
            "Requests (rows) that ended, by outcome; running batches' so far included.",
            labels=["outcome"],
        )
        requests.add_metric(["completed"], totals.completed)
        requests.add_metric(["failed"], totals.failed)
        yield requests
        yield CounterMetricFamily(
            "bulkinfer_prompt_tokens", "Prompt tokens of completed and cancelled batches.", totals.prompt_tokens
        )
        yield CounterMetricFamily(
            "bulkinfer_completion_tokens",
            "Completion tokens of completed and cancelled batches.",
            totals.completion_tokens,
        )
        yield GaugeMetricFamily(
            "bulkinfer_completion_tokens_per_second",
            "The running batch's completion tokens/s (live, since its run started), "
            "else the last completed batch's (its report: generation time).",
            totals.completion_tokens_per_s,
        )
        files = GaugeMetricFamily("bulkinfer_files", "Files stored, by purpose, every tenant's.", labels=["purpose"])
        stored = GaugeMetricFamily(
            "bulkinfer_file_bytes", "Bytes of the files stored, by purpose, every tenant's.", labels=["purpose"]
        )
        for purpose in sorted({"batch", "batch_output", *totals.files}):
            count, size = totals.files.get(purpose, (0, 0))
            files.add_metric([purpose], count)
            stored.add_metric([purpose], size)
        yield files
        yield stored


def metrics_registry(store: Store) -> CollectorRegistry:
    """A registry of its own holding a :class:`StoreCollector` of ``store``
    (``prometheus_client.generate_latest(registry)`` is the page's text)."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    return registry


# vLLM 0.32's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class OnlineMetrics:
    """The online requests' metrics of the module's list, in ``registry``; ``model`` their ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model: str):
        self.model = model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Online requests: seconds from arrival to the first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Online requests: seconds from arrival to the last token.",
            ["model_name"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.requests = Counter(
            "bulkinfer_online_requests",
            "Online requests that ended, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "bulkinfer_online_requests_in_flight", "Online requests admitted and not finished.", registry=registry
        )

    def ended(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
