"""Per-request metrics: loop-only histograms and counters (gateway.observability.histograms)
bumped per request, exported at scrape time — no prometheus_client metric object, lock or label
lookup on the hot path.

`RequestMetrics` counts HTTP routes and statuses (fed by `gateway.api.asgi.MeteredASGI`), gRPC
methods and codes, and, as an exchange observer (so the three front ends count alike), TTFT,
the exchange's duration and the tenant's tokens. The rest of `/metrics` is read at scrape time
from the state the gateway keeps anyway (`gateway.server.collector`). Every name is listed in
docs/operations.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability.histograms import LATENCY_BUCKETS_S, Histogram, LabelledHistograms
from gateway.request.state import ExchangeRecord
from gateway.request.usage import EngineUsage

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
    async def on_first_token(self, record: ExchangeRecord) -> None:
        if record.first_token_s is not None and record.routed.opened_s:
            self.ttft_seconds.observe(record.first_token_s - record.routed.opened_s)

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        """Physical cache traffic: a read is what the engine found cached, a write what it had
        to prefill (and then kept); the billed split is the billing meter's business."""
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        tenant = record.tenant.name
        counts = self.tenant_tokens
        if prompt is not None:
            read = usage.cached_tokens if usage.cached_tokens <= prompt else 0
            for kind, n in (
                ("prompt", prompt),
                ("cache_read", read),
                ("cache_written", prompt - read),
            ):
                counts[(tenant, kind)] = counts.get((tenant, kind), 0) + n
        if completion is not None:
            key = (tenant, "completion")
            counts[key] = counts.get(key, 0) + completion

    async def on_finish(self, record: ExchangeRecord) -> None:
        if record.routed.opened_s:
            self.exchange_seconds.labels("ok" if record.ok else "broken").observe(
                time.monotonic() - record.routed.opened_s
            )


def build_registry() -> CollectorRegistry:
    """The gateway's own registry (never the process-global one: tests run many gateways)."""
    return CollectorRegistry(auto_describe=True)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
