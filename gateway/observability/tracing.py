"""OpenTelemetry traces: one span per request, with the routing decision on it.

    kvgate.request            SERVER  tenant, model, stream, prompt blocks, policy, replica,
    │                                 matched blocks, decision reason; usage and TTFT at the end
    ├── kvgate.directory.lookup       blocks looked up, source (shared | local), deepest match
    └── kvgate.upstream       CLIENT  replica, attempt; a failed attempt ends at once with its
                                      error, the committed one when the exchange ends

Off unless `otlp_endpoint` is set (or a test passes its own exporter): the pipeline then gets
`gateway.request.trace.NoTracer` and makes no span, so tracing costs nothing when off. With
`OtelTracer`, each request is sampled at `trace_sample_ratio` before any span is made (the
SDK's own sampling still builds non-recording spans, ~35 µs a request for nothing); a sampled
request's spans are all recorded. The pipeline talks to a request's trace only through the
protocols of `gateway.request.trace`: this module is an implementation of them. Spans go out in
batches from the SDK's own thread (BatchSpanProcessor), never on the request path. The exporter
is pluggable: `build_tracing(settings, exporter=...)` takes any `SpanExporter` (the tests use the
SDK's in-memory one; OTLP over HTTP is the default).

A span's `kvgate.tenant` is the tenant's name; an end user's identity (a `user` scope) is never
put on a span.

W3C trace context: a client's `traceparent` (HTTP header or gRPC metadata; `tracestate` with it)
makes the request span a child of the client's span. The client's sampled flag decides only for
a tenant with `trusted_tracing` (a parent-based sampler: its own tracing infrastructure says what
is traced); for every other tenant the flag can opt a request out, never in: it is sampled at
`trace_sample_ratio` like a request without one, so no client can make the gateway trace and
export all of its requests. Each attempt tells the engine its own span as the parent (vLLM
continues it when it traces); a request kvgate does not trace passes the client's headers to the
engine unchanged.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.request.parsed import ParsedRequest
from gateway.request.state import ExchangeRecord
from gateway.request.tenant import Tenant
from gateway.request.trace import NoTracer, RequestTrace, Untraced
from gateway.request.trace import Tracer as PipelineTracer
from gateway.settings import Settings
from router.types import Decision

REQUEST_SPAN = "kvgate.request"
LOOKUP_SPAN = "kvgate.directory.lookup"
UPSTREAM_SPAN = "kvgate.upstream"
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass
class Tracing:
    """The process's tracing: its provider (None when off) and the pipeline's tracer."""

    provider: TracerProvider | None = None
    tracer: PipelineTracer = field(default_factory=NoTracer)

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
    return Tracing(provider, OtelTracer(provider.get_tracer("kvgate"), settings.trace_sample_ratio))


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


def _fail(span: Span, exc: BaseException) -> None:
    """End a span on an error: the request's (a 4xx/5xx the client gets) or an attempt's."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        span.set_attribute("http.response.status_code", status)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.end()


class OtelTracer:
    """Samples each request at `sample_ratio` (a client's traceparent decides by its own
    sampled flag) and traces the sampled ones with spans."""

    def __init__(self, tracer: Tracer, sample_ratio: float) -> None:
        self.tracer = tracer
        self.sample_ratio = sample_ratio

    def begin(
        self, parsed: ParsedRequest, tenant: Tenant, client_headers: Mapping[str, str] | None
    ) -> RequestTrace:
        # the global generator, not the router's seeded one: tracing must not change its choices
        parent, client_sampled = parent_of(client_headers)
        if client_sampled is not None and tenant.policy.trusted_tracing:
            sampled = client_sampled
        else:  # a client may opt out of tracing, never force it beyond the ratio
            sampled = client_sampled is not False and random.random() < self.sample_ratio
        if not sampled:
            return Untraced(client_headers)
        span = self.tracer.start_span(
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
        return SpanTrace(self.tracer, span)


class _AttemptSpan:
    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def headers(self) -> dict[str, str] | None:
        return outgoing(self.span)

    def failed(self, exc: BaseException) -> None:
        _fail(self.span, exc)


class SpanTrace:
    """One sampled request: the request span, its lookup and upstream children."""

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.upstream: Span | None = None
        """The latest attempt's span (the committed one, once the exchange is open)."""

    def looked_up(
        self, started_ns: int, ended_ns: int, num_blocks: int, source: str, matched_blocks: int
    ) -> None:
        span = self.tracer.start_span(LOOKUP_SPAN, context=self.context, start_time=started_ns)
        span.set_attributes(
            {
                "kvgate.blocks": num_blocks,
                "kvgate.source": source,
                "kvgate.matched_blocks": matched_blocks,
            }
        )
        span.end(ended_ns)

    def decided(self, policy: str, decision: Decision, num_blocks: int) -> None:
        self.span.set_attributes(
            {
                "kvgate.policy": policy,
                "kvgate.replica": decision.replica,
                "kvgate.matched_blocks": decision.matched_blocks,
                "kvgate.prompt_blocks": num_blocks,
                "kvgate.decision.reason": decision.reason,
            }
        )

    def attempt(self, replica: str, attempt: int, uncached_tokens: float) -> _AttemptSpan:
        self.upstream = self.tracer.start_span(
            UPSTREAM_SPAN,
            context=self.context,
            kind=SpanKind.CLIENT,
            attributes={
                "kvgate.replica": replica,
                "kvgate.attempt": attempt,
                "kvgate.uncached_tokens": uncached_tokens,
            },
        )
        return _AttemptSpan(self.upstream)

    def passthrough(self, status: int) -> None:
        for s in (self.upstream, self.span):
            if s is not None:
                s.set_attribute("http.response.status_code", status)
                s.end()

    def failed(self, exc: BaseException) -> None:
        _fail(self.span, exc)

    def finished(self, record: ExchangeRecord) -> None:
        """The exchange ended: usage and TTFT on the request span, then both spans end."""
        attributes: dict[str, Any] = {"kvgate.ok": record.ok}
        if record.first_token_s is not None:
            attributes["kvgate.ttft_ms"] = (record.first_token_s - record.routed.opened_s) * 1e3
        usage = record.usage
        if usage is not None:
            for key, value in (
                ("prompt_tokens", usage.prompt_tokens),
                ("completion_tokens", usage.completion_tokens),
                ("engine_cached_tokens", usage.cached_tokens),
            ):
                if value is not None:
                    attributes[f"kvgate.usage.{key}"] = value
        self.span.set_attributes(attributes)
        upstream = self.upstream
        if not record.ok:
            status = Status(StatusCode.ERROR, "the stream broke or the client left")
            self.span.set_status(status)
            if upstream is not None:
                upstream.set_status(status)
        now = time.time_ns()
        if upstream is not None:
            upstream.end(now)
        self.span.end(now)
