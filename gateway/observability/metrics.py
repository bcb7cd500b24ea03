"""Prometheus metrics of the gateway, collected at scrape time from the state the gateway keeps
anyway (the director's counters, the replica set, the directory, discovery) and from a few
loop-only histograms and counters (gateway.observability.histograms) bumped per request: no
prometheus_client metric object, lock or label lookup on the hot path.

Per request: HTTP route, status and duration (`MeteredASGI`, around the ASGI app), TTFT, the
exchange's duration and the tenant's tokens (`RequestMetrics`, an exchange observer, so the
three front ends count alike). Every name is listed in docs/operations.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import Message, Receive, Scope, Send

from gateway.api.openai.routes import GatewayASGI, Handler
from gateway.fleet.discovery import Discovery
from gateway.observability import histograms
from gateway.observability.histograms import LATENCY_BUCKETS_S, Histogram, LabelledHistograms
from gateway.pipeline.director import Director
from gateway.pipeline.exchange import Exchange

HOTTEST_SHOWN = 5
"""Hot prefixes exported by name (a label each): a handful keeps the cardinality bounded."""


ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/models",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
        "/docs",
    }
)
"""Paths counted under their own name; anything else is `other` (a scanner's random paths must
not make a label each)."""


DISCOVERY_EVENTS = (
    "lists",
    "relists_after_gone",
    "watches",
    "events",
    "errors",
    "joins",
    "leaves",
    "epochs",
)


@dataclass
class RequestMetrics:
    """Per-request numbers, bumped in the event loop and exported at scrape time. Also an
    exchange observer (TTFT, duration, tokens by tenant)."""

    http: dict[tuple[str, str], int] = field(default_factory=dict)
    """(route, status) -> requests"""
    http_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LATENCY_BUCKETS_S)
    )
    ttft_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    exchange_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LATENCY_BUCKETS_S)
    )
    tenant_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    """(tenant, kind) -> tokens; kinds: prompt, completion, cache_read, cache_written"""
    grpc: dict[tuple[str, str], int] = field(default_factory=dict)
    """(method, status code) -> RPCs"""
    grpc_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LATENCY_BUCKETS_S)
    )

    def observe_grpc(self, method: str, code: str, seconds: float) -> None:
        key = (method, code)
        self.grpc[key] = self.grpc.get(key, 0) + 1
        self.grpc_seconds.labels(method).observe(seconds)

    def observe_http(self, path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        key = (route, str(status))
        self.http[key] = self.http.get(key, 0) + 1
        self.http_seconds.labels(route).observe(seconds)

    # -- the exchange observer --
    async def on_first_token(self, exchange: Exchange) -> None:
        if exchange.first_token_s is not None and exchange.routed.opened_s:
            self.ttft_seconds.observe(exchange.first_token_s - exchange.routed.opened_s)

    async def on_usage(self, exchange: Exchange, usage: dict[str, Any]) -> None:
        """Physical cache traffic: a read is what the engine found cached, a write what it had
        to prefill (and then kept); the billed split is the billing meter's business."""
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        cached = usage.get("engine_cached_tokens")
        tenant = exchange.routed.tenant.name
        counts = self.tenant_tokens
        if isinstance(prompt, int) and prompt >= 0:
            read = cached if isinstance(cached, int) and 0 <= cached <= prompt else 0
            for kind, n in (
                ("prompt", prompt),
                ("cache_read", read),
                ("cache_written", prompt - read),
            ):
                counts[(tenant, kind)] = counts.get((tenant, kind), 0) + n
        if isinstance(completion, int) and completion >= 0:
            key = (tenant, "completion")
            counts[key] = counts.get(key, 0) + completion

    async def on_finish(self, exchange: Exchange, ok: bool) -> None:
        if exchange.routed.opened_s:
            self.exchange_seconds.labels("ok" if ok else "broken").observe(
                time.monotonic() - exchange.routed.opened_s
            )


class MeteredASGI(GatewayASGI):
    """The gateway's ASGI app, counting each HTTP request by route and status and timing it
    to its last byte (a stream's included)."""

    def __init__(self, api: FastAPI, hot: dict[str, Handler], metrics: RequestMetrics) -> None:
        super().__init__(api, hot)
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client sees if the app fails before answering

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await super().__call__(scope, receive, send_counted)
        finally:
            self.metrics.observe_http(scope["path"], status, time.perf_counter() - started)


class _GatewayCollector(Collector):
    def __init__(
        self, director: Director, metrics: RequestMetrics, discovery: Discovery | None
    ) -> None:
        self.director = director
        self.metrics = metrics
        self.discovery = discovery

    def collect(self) -> Iterable[Any]:
        yield from self._requests()
        yield from self._replicas()
        yield from self._discovery()
        yield from self._routing()

    def _requests(self) -> Iterable[Any]:
        m = self.metrics
        requests = CounterMetricFamily(
            "kvgate_http_requests", "HTTP requests by route and status.", labels=["route", "status"]
        )
        for (route, status), n in sorted(m.http.items()):
            requests.add_metric([route, status], n)
        yield requests
        rpcs = CounterMetricFamily(
            "kvgate_grpc_requests",
            "gRPC calls by method and status code.",
            labels=["method", "code"],
        )
        for (method, code), n in sorted(m.grpc.items()):
            rpcs.add_metric([method, code], n)
        yield rpcs
        yield histograms.family(
            "kvgate_grpc_request_duration_seconds",
            "gRPC calls, arrival to the last message, by method.",
            ["method"],
            m.grpc_seconds,
        )
        yield histograms.family(
            "kvgate_http_request_duration_seconds",
            "HTTP requests, arrival to last byte, by route.",
            ["route"],
            m.http_seconds,
        )
        yield histograms.single(
            "kvgate_time_to_first_token_seconds",
            "Arrival at the director to the engine's first byte (all front ends).",
            m.ttft_seconds,
        )
        yield histograms.family(
            "kvgate_exchange_duration_seconds",
            "Arrival at the director to the end of the engine's answer, by outcome.",
            ["outcome"],
            m.exchange_seconds,
        )
        tokens = CounterMetricFamily(
            "kvgate_tenant_tokens",
            "Tokens by tenant: prompt, completion, cache_read (found cached by the engine), "
            "cache_written (prefilled and kept).",
            labels=["tenant", "kind"],
        )
        for (tenant, kind), n in sorted(m.tenant_tokens.items()):
            tokens.add_metric([tenant, kind], n)
        yield tokens

    def _replicas(self) -> Iterable[Any]:
        d = self.director
        healthy = GaugeMetricFamily("kvgate_replica_healthy", "1 if healthy.", labels=["replica"])
        inflight = GaugeMetricFamily(
            "kvgate_replica_inflight", "Requests in flight.", labels=["replica"]
        )
        requests = CounterMetricFamily(
            "kvgate_replica_requests", "Attempts sent to the replica.", labels=["replica"]
        )
        pending = GaugeMetricFamily(
            "kvgate_replica_pending_prefill_tokens",
            "Prefill tokens this gateway sent whose first token has not come back.",
            labels=["replica"],
        )
        waiting = GaugeMetricFamily(
            "kvgate_engine_num_waiting",
            "Requests queued at the engine (every gateway's), as last scraped.",
            labels=["replica"],
        )
        running = GaugeMetricFamily(
            "kvgate_engine_num_running",
            "Requests running at the engine, as last scraped.",
            labels=["replica"],
        )
        kv_usage = GaugeMetricFamily(
            "kvgate_engine_kv_usage",
            "The engine's KV cache usage (1 = full), as last scraped.",
            labels=["replica"],
        )
        foreign = GaugeMetricFamily(
            "kvgate_replica_foreign_prefill_tokens",
            "Prefill work other gateways queued on the replica, as the router counts it.",
            labels=["replica"],
        )
        for s in d.replicas.states.values():
            labels = [s.url]
            healthy.add_metric(labels, 1.0 if s.healthy else 0.0)
            inflight.add_metric(labels, s.num_inflight)
            requests.add_metric(labels, s.num_requests)
            pending.add_metric(labels, s.pending_prefill_tokens)
            m = s.metrics
            if m is not None:
                for family, value in ((waiting, m.num_waiting), (running, m.num_running)):
                    if value is not None:
                        family.add_metric(labels, value)
                if m.kv_usage is not None:
                    kv_usage.add_metric(labels, m.kv_usage)
                foreign.add_metric(labels, s.snapshot().foreign_prefill_tokens)
        yield from (healthy, inflight, requests, pending, waiting, running, kv_usage, foreign)

    def _discovery(self) -> Iterable[Any]:
        if self.discovery is None:
            return
        stats = self.discovery.stats
        yield GaugeMetricFamily(
            "kvgate_discovery_endpoints",
            "Engine endpoints in the watched EndpointSlices.",
            len(self.discovery.known),
        )
        events = CounterMetricFamily(
            "kvgate_discovery_events", "What discovery saw and did.", labels=["kind"]
        )
        for kind in DISCOVERY_EVENTS:
            events.add_metric([kind], getattr(stats, kind))
        yield events

    def _routing(self) -> Iterable[Any]:
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
        yield histograms.family(
            "kvgate_directory_lookup_seconds",
            "Directory lookups as the request path waited for them, by source (shared: Redis; "
            "local: in process, or the fallback while Redis is away).",
            ["source"],
            d.stats.lookup_seconds,
        )


def build_registry() -> CollectorRegistry:
    """The gateway's own registry (never the process-global one: tests run many gateways)."""
    return CollectorRegistry(auto_describe=True)


def register_collector(
    registry: CollectorRegistry,
    director: Director,
    metrics: RequestMetrics | None = None,
    discovery: Discovery | None = None,
) -> None:
    registry.register(_GatewayCollector(director, metrics or RequestMetrics(), discovery))


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
