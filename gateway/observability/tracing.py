"""OpenTelemetry traces: one span per request, with the routing decision on it.

    kvgate.request            SERVER  tenant, model, stream, prompt blocks, policy, replica,
    │                                 matched blocks, decision reason; usage and TTFT at the end
    ├── kvgate.directory.lookup       blocks looked up, source (shared | local), deepest match
    └── kvgate.upstream       CLIENT  replica, attempt; a failed attempt ends at once with its
                                      error, the committed one when the exchange ends

Off unless `otlp_endpoint` is set (or a test passes its own exporter): the director then holds
no tracer and makes no span, so tracing costs nothing when off. With a tracer, the director
samples each request at `trace_sample_ratio` before making any span (the SDK's own sampling
still builds non-recording spans, ~35 µs a request for nothing); a sampled request's spans are
all recorded. Spans go out in batches from the SDK's own thread (BatchSpanProcessor), never on
the request path. The exporter is pluggable: `build_tracing(settings, exporter=...)` takes any
`SpanExporter` (the tests use the SDK's in-memory one; OTLP over HTTP is the default).

A span's `kvgate.tenant` is the tenant's name; an end user's identity (a `user` scope) is never
put on a span.

W3C trace context: a client's `traceparent` (HTTP header or gRPC metadata; `tracestate` with it)
makes the request span a child of the client's span, and the client's sampled flag decides
(a parent-based sampler: a sampled parent is traced, an unsampled one is not, whatever the
ratio). Each attempt tells the engine its own span as the parent (vLLM continues it when it
traces); a request kvgate does not trace passes the client's headers to the engine unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.settings import Settings

if TYPE_CHECKING:
    from gateway.pipeline.exchange import Exchange, Routed
    from gateway.request.parsed import ParsedRequest
    from gateway.request.tenant import Tenant
    from router.types import Decision

REQUEST_SPAN = "kvgate.request"
LOOKUP_SPAN = "kvgate.directory.lookup"
UPSTREAM_SPAN = "kvgate.upstream"


@dataclass
class Tracing:
    provider: TracerProvider | None = None
    sample_ratio: float = 1.0
    """Share of requests traced (decided by the director, at the root)."""

    @property
    def tracer(self) -> Tracer | None:
        return self.provider.get_tracer("kvgate") if self.provider is not None else None

    def flush(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def build_tracing(settings: Settings, exporter: SpanExporter | None = None) -> Tracing:
    """A tracer provider exporting to `exporter`, else to `settings.otlp_endpoint` over
    OTLP/HTTP; no provider at all when neither is given."""
    if exporter is None:
        if settings.otlp_endpoint is None:
            return Tracing()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint)
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}), sampler=ALWAYS_ON
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, settings.trace_sample_ratio)


# -- W3C trace context ------------------------------------------------------------------------
TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


def incoming(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of a client's request (HTTP headers or gRPC metadata),
    or None: the only headers kvgate continues and passes on."""
    found = {k: headers[k] for k in TRACE_HEADERS if k in headers}
    return found if "traceparent" in found else None


def parent_of(carrier: Mapping[str, str] | None) -> tuple[Context | None, bool | None]:
    """(the client's span as a parent context, whether the client sampled it); (None, None)
    when there is no valid traceparent."""
    if not carrier:
        return None, None
    context = _PROPAGATOR.extract(carrier)
    parent = trace.get_current_span(context).get_span_context()
    if not parent.is_valid:
        return None, None
    return context, parent.trace_flags.sampled


def outgoing(span: Span) -> dict[str, str]:
    """The trace-context headers that make `span` the engine's parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


# -- the director's hooks ---------------------------------------------------------------------
def start_request(
    tracer: Tracer, parsed: ParsedRequest, tenant: Tenant, parent: Context | None = None
) -> Span:
    return tracer.start_span(
        REQUEST_SPAN,
        context=parent,
        kind=SpanKind.SERVER,
        attributes={
            "kvgate.tenant": tenant.name,
            "kvgate.model": parsed.model,
            "kvgate.kind": parsed.kind,
            "kvgate.stream": parsed.stream,
            "kvgate.prompt_bytes": len(parsed.rendered),
        },
    )


def decided(policy: str, decision: Decision, num_blocks: int) -> None:
    """The decision, on the request span (the current one while the director routes)."""
    span = trace.get_current_span()
    span.set_attributes(
        {
            "kvgate.policy": policy,
            "kvgate.replica": decision.replica,
            "kvgate.matched_blocks": decision.matched_blocks,
            "kvgate.prompt_blocks": num_blocks,
            "kvgate.decision.reason": decision.reason,
        }
    )


def start_upstream(tracer: Tracer, replica: str, attempt: int, uncached_tokens: float) -> Span:
    return tracer.start_span(
        UPSTREAM_SPAN,
        kind=SpanKind.CLIENT,
        attributes={
            "kvgate.replica": replica,
            "kvgate.attempt": attempt,
            "kvgate.uncached_tokens": uncached_tokens,
        },
    )


def fail(span: Span, exc: BaseException) -> None:
    """End a span on an error: the request's (a 4xx/5xx the client gets) or an attempt's."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        span.set_attribute("http.response.status_code", status)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.end()


def passthrough(span: Span, upstream: Span | None, status: int) -> None:
    """An engine's 4xx, passed to the client: both spans end with it."""
    for s in (upstream, span):
        if s is not None:
            s.set_attribute("http.response.status_code", status)
            s.end()


def finish(routed: Routed, exchange: Exchange) -> None:
    """The exchange ended: usage and TTFT on the request span, then both spans end."""
    span = routed.span
    assert span is not None
    upstream = routed.upstream_span
    attributes: dict[str, Any] = {"kvgate.ok": exchange.ok}
    if exchange.first_token_s is not None:
        attributes["kvgate.ttft_ms"] = (exchange.first_token_s - routed.opened_s) * 1e3
    usage = exchange.usage
    if usage is not None:
        for key in ("prompt_tokens", "completion_tokens", "engine_cached_tokens"):
            value = usage.get(key)
            if isinstance(value, int):
                attributes[f"kvgate.usage.{key}"] = value
    span.set_attributes(attributes)
    if not exchange.ok:
        status = Status(StatusCode.ERROR, "the stream broke or the client left")
        span.set_status(status)
        if upstream is not None:
            upstream.set_status(status)
    now = time.time_ns()
    if upstream is not None:
        upstream.end(now)
    span.end(now)
