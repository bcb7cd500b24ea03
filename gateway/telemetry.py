"""Prometheus metrics of the gateway, collected at scrape time from the director's state (no
per-request metric calls on the hot path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.director import Director

HOTTEST_SHOWN = 5
"""Hot prefixes exported by name (a label each): a handful keeps the cardinality bounded."""


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
        dstats = d.directory.stats
        lookups = CounterMetricFamily(
            "kvgate_directory_lookups",
            "Directory lookups by where the answer came from.",
            labels=["source"],
        )
        lookups.add_metric(["shared"], dstats.shared_lookups)
        lookups.add_metric(["local"], dstats.lookups - dstats.shared_lookups)
        yield lookups
        yield CounterMetricFamily(
            "kvgate_directory_fallbacks",
            "Lookups answered locally because the shared directory did not answer in time.",
            dstats.fallbacks,
        )
        yield GaugeMetricFamily(
            "kvgate_directory_degraded",
            "1 while the shared directory is unavailable and routing is local.",
            1.0 if dstats.degraded else 0.0,
        )
        yield CounterMetricFamily(
            "kvgate_directory_writes_dropped",
            "Records/drops that did not reach the shared directory.",
            dstats.writes_dropped,
        )
        placement = d.placement
        yield CounterMetricFamily(
            "kvgate_overflow_widenings",
            "Hot prefixes spread over more replicas.",
            placement.stats.widenings,
        )
        yield CounterMetricFamily(
            "kvgate_overflow_shrinks",
            "Hot prefixes spread over fewer replicas.",
            placement.stats.shrinks,
        )
        yield CounterMetricFamily(
            "kvgate_overflow_spread_requests",
            "Requests routed with a hot prefix spread to replicas that did not hold it yet.",
            placement.stats.spread_requests,
        )
        rates = d.directory.rates
        if rates is not None:
            k = GaugeMetricFamily(
                "kvgate_hot_prefix_replicas", "k of the hottest prefixes.", labels=["prefix"]
            )
            rate = GaugeMetricFamily(
                "kvgate_hot_prefix_rate_per_min",
                "Request rate of the hottest prefixes.",
                labels=["prefix"],
            )
            for prefix, observed in rates.hottest(HOTTEST_SHOWN):
                label = prefix.hex()[:16]
                k.add_metric([label], observed.k)
                rate.add_metric([label], observed.rate_per_min)
            yield k
            yield rate
        flights = placement.flights
        if flights is not None:
            yield CounterMetricFamily(
                "kvgate_fanout_holds", "Siblings held for an in-flight leader.", flights.stats.holds
            )
            releases = CounterMetricFamily(
                "kvgate_fanout_releases", "How held siblings were released.", labels=["reason"]
            )
            releases.add_metric(["landed"], flights.stats.released_landed)
            releases.add_metric(["leader_failed"], flights.stats.released_failed)
            releases.add_metric(["timeout"], flights.stats.timeouts)
            yield releases
        yield CounterMetricFamily(
            "kvgate_directory_lookup_seconds",
            "Time spent in shared directory lookups.",
            dstats.lookup_seconds,
        )


def build_registry() -> CollectorRegistry:
    """The gateway's own registry (never the process-global one: tests run many gateways)."""
    return CollectorRegistry(auto_describe=True)


def register_collector(registry: CollectorRegistry, director: Director) -> None:
    registry.register(_GatewayCollector(director))


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
