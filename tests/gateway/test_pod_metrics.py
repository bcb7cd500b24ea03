"""The pod's /metrics merged from its workers' pages (gateway.server.pod_metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.pod_metrics import merge


def page(requests: int, queue: float, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("kvgate_t_requests", "requests", ["tenant"], registry=registry)
    counter.labels("acme").inc(requests)
    Gauge("kvgate_t_queue", "queue", registry=registry).set(queue)
    histogram = Histogram("kvgate_t_seconds", "latency", registry=registry, buckets=(0.1, 1.0))
    for value in latencies:
        histogram.observe(value)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_and_histograms_sum_and_gauges_stay_per_worker() -> None:
    merged = samples(merge([page(2, 3.0, [0.05]), page(5, 4.0, [0.5, 2.0])]).decode())
    assert merged[("kvgate_t_requests_total", (("tenant", "acme"),))] == 7
    assert merged[("kvgate_t_seconds_count", ())] == 3
    assert merged[("kvgate_t_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("kvgate_t_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("kvgate_t_seconds_sum", ())] == 2.55
    assert merged[("kvgate_t_queue", (("worker", "0"),))] == 3
    assert merged[("kvgate_t_queue", (("worker", "1"),))] == 4
    assert ("kvgate_t_queue", ()) not in merged
