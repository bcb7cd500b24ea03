"""Prometheus metrics and OpenTelemetry spans of real requests through a real gateway: the
numbers scraped from /metrics, the spans from the SDK's in-memory exporter, and OTLP over
HTTP into a receiver on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.observability.histograms import Histogram
from gateway.observability.tracing import (
    LOOKUP_SPAN,
    REQUEST_SPAN,
    UPSTREAM_SPAN,
    Tracing,
    build_tracing,
)
from gateway.request.trace import NoTracer
from gateway.server.app import create_app
from gateway.tenancy.tenant_file import add_key
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, engine_of, gateway_settings, metrics_url
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e


def samples(gateway: Served) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the gateway's /metrics: (name, labels) -> value."""
    text = httpx.get(metrics_url(gateway) + "/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def chat(
    gateway: Served,
    content: str,
    headers: dict[str, str] | None = None,
    key: str = TENANT_KEY,
    **extra: Any,
) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": words("observability/system", 300)},
                {"role": "user", "content": content},
            ],
            "max_tokens": 3,
            **extra,
        },
        headers={"authorization": f"Bearer {key}", **(headers or {})},
        timeout=30,
    )


def test_histograms_count_cumulatively_by_upper_bound() -> None:
    h = Histogram((0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 1.0, 20.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2.0), ("1.0", 4.0), ("10.0", 4.0), ("+Inf", 5.0)]
    assert h.count == 5 and h.sum == pytest.approx(21.65)


def test_requests_tokens_and_lookups_in_metrics(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines)
    usages = []
    for n, stream in enumerate((False, False, True)):
        response = chat(gateway, f"turn {n}", stream=stream, stream_options={"include_usage": True})
        assert response.status_code == 200
        if not stream:
            usages.append(response.json()["usage"])
    assert chat(gateway, "other tenant", key=OTHER_KEY).status_code == 200
    assert chat(gateway, "no key", key="sk-wrong").status_code == 401
    assert httpx.get(gateway.url + "/no/such/path").status_code == 404
    # an HTTP request is counted after its last byte is sent, an exchange when it finishes: a
    # client can read /metrics in between, so wait for the last ones before reading the counts
    found = samples(gateway)

    def counted() -> bool:
        nonlocal found
        found = samples(gateway)
        return (
            value(found, "kvgate_http_requests_total", route="other", status="404") >= 1
            and value(found, "kvgate_exchange_duration_seconds_count", outcome="ok") >= 4
        )

    wait_until(counted, what="the last requests counted")

    requests = "kvgate_http_requests_total"
    chat_route = "/v1/chat/completions"
    assert value(found, requests, route=chat_route, status="200") == 4
    assert value(found, requests, route=chat_route, status="401") == 1
    assert value(found, requests, route="other", status="404") == 1
    durations = "kvgate_http_request_duration_seconds_count"
    assert value(found, durations, route=chat_route) == 5
    assert value(found, "kvgate_time_to_first_token_seconds_count") == 4
    assert value(found, "kvgate_exchange_duration_seconds_count", outcome="ok") == 4

    # acme's tokens: the non-streamed usages are exact; the stream's usage was counted too
    tokens = "kvgate_tenant_tokens_total"
    prompt = value(found, tokens, tenant="acme", kind="prompt")
    read = value(found, tokens, tenant="acme", kind="cache_read")
    written = value(found, tokens, tenant="acme", kind="cache_written")
    assert prompt > sum(u["prompt_tokens"] for u in usages)
    assert read + written == prompt
    assert read >= usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # turn 1 hit
    assert value(found, tokens, tenant="acme", kind="completion") == 9
    assert value(found, tokens, tenant="globex", kind="prompt") > 0

    lookups = "kvgate_directory_lookup_seconds_count"
    assert value(found, lookups, source="local") == 4
    assert value(found, "kvgate_directory_lookup_seconds_bucket", source="local", le="+Inf") == 4
    decisions = sum(v for (name, _), v in found.items() if name == "kvgate_routing_decisions_total")
    assert decisions == 4
    for e in engines:  # the engines' own load, scraped
        assert ("kvgate_engine_num_waiting", frozenset({("replica", e.url)})) in found
        assert ("kvgate_engine_kv_usage", frozenset({("replica", e.url)})) in found


# -- traces -----------------------------------------------------------------------------------
@pytest.fixture
def traced(
    start_engines: Callable[..., list[Served]],
) -> Iterator[tuple[list[Served], Served, InMemorySpanExporter]]:
    engines = start_engines(2)
    exporter = InMemorySpanExporter()
    settings = gateway_settings([e.url for e in engines])
    gateway = start_app(create_app(settings, span_exporter=exporter))
    yield engines, gateway, exporter
    stop_all([gateway])


def finished(gateway: Served, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    tracing: Tracing = gateway.app.state.tracing
    tracing.flush()
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_a_span_per_request_with_the_decision_and_its_children(
    traced: tuple[list[Served], Served, InMemorySpanExporter],
) -> None:
    _, gateway, exporter = traced
    first = chat(gateway, "trace me")
    second = chat(gateway, "trace me")
    assert first.status_code == second.status_code == 200
    spans = finished(gateway, exporter)
    requests = by_name(spans, REQUEST_SPAN)
    assert len(requests) == 2 and len(spans) == 6
    for request, response in zip(requests, (first, second), strict=True):
        attrs = dict(request.attributes or {})
        assert attrs["kvgate.tenant"] == "acme" and attrs["kvgate.model"] == MODEL
        assert attrs["kvgate.replica"] == response.headers["x-kvgate-replica"]
        assert attrs["kvgate.matched_blocks"] == int(response.headers["x-kvgate-matched-blocks"])
        assert attrs["kvgate.decision.reason"] == response.headers["x-kvgate-decision"]
        assert attrs["kvgate.usage.prompt_tokens"] == response.json()["usage"]["prompt_tokens"]
        assert float(str(attrs["kvgate.ttft_ms"])) > 0
        context = request.context
        assert context is not None
        children = [
            s for s in spans if s.parent is not None and s.parent.span_id == context.span_id
        ]
        assert sorted(c.name for c in children) == [LOOKUP_SPAN, UPSTREAM_SPAN]
        assert all(
            c.context is not None and c.context.trace_id == context.trace_id for c in children
        )
        upstream = next(c for c in children if c.name == UPSTREAM_SPAN)
        assert dict(upstream.attributes or {})["kvgate.replica"] == attrs["kvgate.replica"]
        assert request.start_time is not None and upstream.end_time == request.end_time
    second_attrs = dict(requests[1].attributes or {})
    assert second_attrs["kvgate.decision.reason"] == "prefix"
    assert int(str(second_attrs["kvgate.matched_blocks"])) > 0
    lookup = by_name(spans, LOOKUP_SPAN)[1]
    assert (
        dict(lookup.attributes or {})["kvgate.matched_blocks"]
        == second_attrs["kvgate.matched_blocks"]
    )


def test_a_retried_attempt_and_a_refused_request_in_spans(
    traced: tuple[list[Served], Served, InMemorySpanExporter],
) -> None:
    engines, gateway, exporter = traced
    home = chat(gateway, "retry me").headers["x-kvgate-replica"]
    finished(gateway, exporter)
    engine_of(next(e for e in engines if e.url == home)).num_failures_left = 1
    assert chat(gateway, "retry me").status_code == 200
    spans = finished(gateway, exporter)
    upstreams = sorted(by_name(spans, UPSTREAM_SPAN), key=lambda s: s.start_time or 0)
    assert [dict(s.attributes or {})["kvgate.attempt"] for s in upstreams] == [1, 2]
    assert upstreams[0].status.status_code == StatusCode.ERROR
    assert dict(upstreams[0].attributes or {})["kvgate.replica"] == home
    assert upstreams[1].status.status_code != StatusCode.ERROR
    # a request the gateway refuses (unknown model: 404) ends its span with the error
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert response.status_code == 404
    (refused,) = finished(gateway, exporter)
    assert refused.name == REQUEST_SPAN and refused.status.status_code == StatusCode.ERROR
    assert dict(refused.attributes or {})["http.response.status_code"] == 404


def test_a_request_not_sampled_makes_no_span(start_engines: Callable[..., list[Served]]) -> None:
    engines = start_engines(1)
    exporter = InMemorySpanExporter()
    settings = gateway_settings([e.url for e in engines], trace_sample_ratio=0.0)
    gateway = start_app(create_app(settings, span_exporter=exporter))
    try:
        for n in range(3):
            assert chat(gateway, f"unsampled {n}").status_code == 200
        assert finished(gateway, exporter) == []
    finally:
        stop_all([gateway])


def test_a_clients_traceparent_is_continued_and_passed_to_the_engine(
    start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    engines = start_engines(1)
    exporter = InMemorySpanExporter()
    trusted, _, _ = add_key(tmp_path / "tenants.yaml", "traced", trusted_tracing=True)
    # ratio 0: only a trusted tenant's sampled flag makes kvgate trace
    settings = gateway_settings(
        [e.url for e in engines], trace_sample_ratio=0.0, tenants_file=tmp_path / "tenants.yaml"
    )
    gateway = start_app(create_app(settings, span_exporter=exporter))
    engine = engine_of(engines[0])
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        sampled = {"traceparent": f"00-{trace_id}-{client_span}-01", "tracestate": "k=v"}
        # another tenant's sampled flag cannot force a trace past the ratio (0 here) ...
        for n in range(3):
            assert chat(gateway, f"untrusted {n}", sampled).status_code == 200
        assert finished(gateway, exporter) == []
        assert engine.last_traceparent == sampled["traceparent"]  # ... and is passed on as is
        assert chat(gateway, "traced by the client", sampled, key=trusted).status_code == 200
        spans = finished(gateway, exporter)
        (request,) = by_name(spans, REQUEST_SPAN)
        (upstream,) = by_name(spans, UPSTREAM_SPAN)
        assert request.context is not None and upstream.context is not None
        assert format(request.context.trace_id, "032x") == trace_id
        assert request.parent is not None and format(request.parent.span_id, "016x") == client_span
        # the engine's parent is the attempt's span, in the client's trace
        _, seen_trace, seen_parent, flags = str(engine.last_traceparent).split("-")
        assert seen_trace == trace_id and flags == "01"
        assert seen_parent == format(upstream.context.span_id, "016x")

        unsampled = {"traceparent": f"00-{trace_id}-{client_span}-00"}
        assert chat(gateway, "not sampled", unsampled, key=trusted).status_code == 200
        assert finished(gateway, exporter) == []  # the client's flag, not the ratio, decided
        assert engine.last_traceparent == unsampled["traceparent"]  # passed on unchanged
        assert chat(gateway, "no trace context", key=trusted).status_code == 200
        assert engine.last_traceparent is None
    finally:
        stop_all([gateway])


def test_tracing_is_off_without_an_endpoint() -> None:
    settings = gateway_settings([])
    assert build_tracing(settings).provider is None
    app = create_app(settings)
    assert isinstance(app.state.director.tracer, NoTracer)


def test_spans_go_out_over_otlp_http(start_engines: Callable[..., list[Served]]) -> None:
    received: list[bytes] = []

    async def traces(request: Request) -> Response:
        assert request.headers["content-type"] == "application/x-protobuf"
        received.append(await request.body())
        return Response(b"", status_code=200)

    collector = start_app(Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])]))
    engines = start_engines(1)
    settings = gateway_settings(
        [e.url for e in engines],
        otlp_endpoint=collector.url + "/v1/traces",
        service_name="kvgate-test",
    )
    gateway = start_app(create_app(settings))
    try:
        assert chat(gateway, "export me").status_code == 200
        gateway.app.state.tracing.flush()
        assert received
        names = []
        for body in received:
            export = ExportTraceServiceRequest.FromString(body)
            for resource_spans in export.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
                    "service.name"
                ]
                assert service == "kvgate-test"
                names += [s.name for scope in resource_spans.scope_spans for s in scope.spans]
        assert sorted(names) == sorted([REQUEST_SPAN, LOOKUP_SPAN, UPSTREAM_SPAN])
    finally:
        stop_all([gateway, collector])
