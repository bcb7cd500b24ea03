"""The admin port: /metrics and the API documents are served there, and nowhere a tenant can
reach (the tenant-facing port answers 404 for them)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.app import create_app
from tests.conftest import MODEL, TENANT_KEY, gateway_settings, metrics_url
from tests.servers import Served, serve

pytestmark = pytest.mark.e2e

ADMIN_PATHS = ("/metrics", "/docs", "/redoc", "/openapi.json")


def test_metrics_and_documents_are_on_the_admin_port_only(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    assert httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=auth).is_success
    for path in ADMIN_PATHS:  # with a key or without, a tenant sees nothing of them
        for headers in ({}, auth):
            r = httpx.get(gateway.url + path, headers=headers)
            assert r.status_code == 404, (path, r.status_code)
            assert "kvgate_" not in r.text
    admin = metrics_url(gateway)
    assert admin != gateway.url
    scraped = httpx.get(admin + "/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(scraped.text)}
    assert {"kvgate_tenant_tokens", "kvgate_routing_decisions", "kvgate_http_requests"} <= names
    # HEAD answers like GET without the body (aiperf probes a metrics URL that way)
    head = httpx.head(admin + "/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == scraped.headers["content-type"]
    document = httpx.get(admin + "/openapi.json").json()
    assert "/v1/chat/completions" in document["paths"]
    for page in ("/docs", "/redoc"):
        r = httpx.get(admin + page)
        assert r.status_code == 200 and "/openapi.json" in r.text


def test_without_a_metrics_port_nothing_is_served_beside_the_api(
    start_engines: Callable[..., list[Served]],
) -> None:
    settings = gateway_settings([e.url for e in start_engines(1)])
    settings = settings.model_copy(update={"metrics_port": None})  # (None flags are ignored)
    with serve(create_app(settings)) as gateway:
        assert not hasattr(gateway.app.state, "metrics_port")
        assert httpx.get(gateway.url + "/metrics").status_code == 404
        assert httpx.get(gateway.url + "/healthz").status_code == 200
