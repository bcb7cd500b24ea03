"""Prometheus metrics of the gateway, collected at scrape time from the director's state (no
per-request metric calls on the hot path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.director import Director


class _GatewayCollector(Collector):
    def __init__(self, director: Director) -> None:
        self.director = director

    def collect(self) -> Iterable[Any]:
        d = self.director
        decisions = CounterMetricFamily(
            "kvgate_routing_decisions",
            "Routing decisions by policy and reason.",
            labels=["policy", "reason"],
        )
        for (policy, reason), n in sorted(d.stats.decisions.items()):
            decisions.add_metric([policy, reason], n)
        yield decisions
        yield CounterMetricFamily(
            "kvgate_upstream_retries", "Attempts retried on another replica.", d.stats.retries
        )
        healthy = GaugeMetricFamily("kvgate_replica_healthy", "1 if healthy.", labels=["replica"])
        inflight = GaugeMetricFamily(
            "kvgate_replica_inflight", "Requests in flight.", labels=["replica"]
        )
        requests = CounterMetricFamily(
            "kvgate_replica_requests", "Attempts sent to the replica.", labels=["replica"]
        )
        for s in d.replicas.states.values():
            healthy.add_metric([s.url], 1.0 if s.healthy else 0.0)
            inflight.add_metric([s.url], s.num_inflight)
            requests.add_metric([s.url], s.num_requests)
        yield healthy
        yield inflight
        yield requests


def build_registry(director: Director) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_GatewayCollector(director))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
