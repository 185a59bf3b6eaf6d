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
  report (generation seconds); 0 before any.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bulkinfer.serve.store import STATUSES, Store


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


def metrics_registry(store: Store) -> CollectorRegistry:
    """A registry of its own holding a :class:`StoreCollector` of ``store``
    (``prometheus_client.generate_latest(registry)`` is the page's text)."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    return registry
