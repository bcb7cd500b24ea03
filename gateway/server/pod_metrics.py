"""One `/metrics` for a pod of workers: the workers' expositions merged into one.

Counters, histograms and summaries are summed over the workers, sample by sample (same name,
same labels): the pod served what its workers served, and a request is counted once, by the
worker that served it. Gauges (and untyped or info series) are not summed: every worker probes
and scrapes the same replicas, so a sum of their replica gauges would count each engine N
times; they keep one series per worker with a `worker` label (`max by` or `sum by` in a query
says which view a dashboard wants). prometheus_client's text parser reads `_created` series
as gauges of their own, so they too stay per worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

SUMMED = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
WORKER_LABEL = "worker"


def merge(pages: Sequence[str]) -> bytes:
    """The exposition of the pod whose worker `i` rendered `pages[i]`."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for index, page in enumerate(pages):
        for family in text_string_to_metric_families(page):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            if family.type not in SUMMED:
                for s in family.samples:
                    labels = {**s.labels, WORKER_LABEL: str(index)}
                    merged.add_sample(s.name, labels, s.value)
                continue
            totals = sums.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                totals[key] = totals.get(key, 0.0) + s.value
    for name, totals in sums.items():
        for (sample, pairs), value in totals.items():
            families[name].add_sample(sample, dict(pairs), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families.values()))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
