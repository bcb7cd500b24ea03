"""One tenant cannot hold every upstream slot, and a client that does not read cannot hold its
engine connection (issue 45, item 6). Real gateways and engines on loopback."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.billing.wal import read_directory, unsettled
from gateway.errors import TooManyInFlight
from gateway.pipeline.admission import Admission
from gateway.request.tenant import Tenant, TenantPolicy
from loadgen.engine.timing import TimingModel
from tests.clients import director
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, metrics_url
from tests.e2e.test_relay import Flood
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SLOW_DECODE = TimingModel(decode_s_per_token=0.02)
"""A 300-token answer streams for 6 s: the streams stay open while the test looks."""


def stream_body(tag: str) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{tag}: tell me a long story"}],
        "max_tokens": 300,
        "stream": True,
    }


def test_one_tenant_holding_many_streams_leaves_slots_for_another(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """4 upstream slots; by default a tenant may hold half. Before: acme's four streams took
    every slot and globex's request waited for one (its first-byte timeout, then a 502). Now
    acme's third stream is a 429 naming the bound, and globex is served at once."""
    engines = start_engines(1, timing=SLOW_DECODE)
    gateway = start_gateway(engines, upstream_max_connections=4, first_byte_timeout_s=3.0)
    url = gateway.url + "/v1/chat/completions"
    acme = {"authorization": f"Bearer {TENANT_KEY}"}
    with contextlib.ExitStack() as streams, httpx.Client(timeout=10) as http:
        statuses = []
        for i in range(4):
            request = http.build_request("POST", url, json=stream_body(f"acme {i}"), headers=acme)
            response = streams.enter_context(contextlib.closing(http.send(request, stream=True)))
            statuses.append(response.status_code)
            if response.status_code == 429:
                error = response.read() and response.json()["error"]
                assert error["code"] == "too_many_requests_in_flight", error
                assert "tenant 'acme' has 2 requests in flight" in error["message"]
                assert "max_inflight 2" in error["message"]
                assert response.headers["retry-after"] == "2"
        assert statuses == [200, 200, 429, 429]
        assert director(gateway).stats.inflight_refused == 2
        started = time.monotonic()
        other = httpx.post(
            url,
            json={**stream_body("globex"), "max_tokens": 2},
            headers={"authorization": f"Bearer {OTHER_KEY}"},
            timeout=10,
        )
        assert other.status_code == 200, other.text
        assert time.monotonic() - started < 2.0
    # the streams closed: acme's count goes back to nothing (no entry kept)
    admission = director(gateway).admission
    wait_until(lambda: gateway.on_loop(lambda: not admission.num_inflight), 10, "acme's count")


def test_a_tenants_own_max_inflight_overrides_the_gateways_and_each_request_leaves_once() -> None:
    admission = Admission(None, None, max_inflight=2)
    small = Tenant("small", b"s", policy=TenantPolicy(max_inflight=1))
    big = Tenant("big", b"b", policy=TenantPolicy(max_inflight=3))
    leave = admission.enter(small)
    with pytest.raises(TooManyInFlight, match="max_inflight 1"):
        admission.enter(small)
    leaves = [admission.enter(big) for _ in range(3)]
    with pytest.raises(TooManyInFlight, match="tenant 'big' has 3 requests in flight"):
        admission.enter(big)
    leave()
    leave()  # a second end is no second leave
    assert admission.num_inflight == {"big": 3}
    for leave in leaves:
        leave()
    assert admission.num_inflight == {}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_that_stops_reading_is_cut_after_the_drain_deadline_and_billed_aborted(
    start_gateway: Callable[..., Served], tmp_path: Path, path: str
) -> None:
    """Before: the relay waited on the client's `drain()` for ever, holding the engine's
    connection and slot as long as the client held its socket open. Now, after
    `client_drain_timeout_s` (0.5 s here) of a full buffer, the client's connection and the
    engine's are dropped and the request is billed as aborted. OpenAI's stream is spliced
    (`Exchange.drain`), Anthropic's goes through uvicorn's `send` (`ExchangeSSE`): both."""
    flood = Flood()
    engine = start_app(flood.app())
    client = socket.socket()
    try:
        gateway = start_gateway(
            [engine],
            client_drain_timeout_s=0.5,
            billing_wal_dir=str(tmp_path / "wal"),
            billing_model_map={MODEL: "gpt-5.6"},
        )
        body = (
            b'{"model":"%s","stream":true,"max_tokens":100000,'
            b'"messages":[{"role":"user","content":"go"}]}' % MODEL.encode()
        )
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", gateway.port))
        client.sendall(
            b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), TENANT_KEY.encode(), len(body), body)
        )
        assert client.recv(1024).startswith(b"HTTP/1.1 200")  # then the client reads no more
        started = time.monotonic()
        wait_until(lambda: flood.cancelled, 10, "the engine's stream cancelled")
        assert time.monotonic() - started < 5.0
        replicas = director(gateway).replicas
        wait_until(lambda: replicas.get(engine.url).num_inflight == 0, 5, "the slot freed")
        pool = director(gateway).forwarder.pool
        assert pool is not None
        wait_until(lambda: not gateway.on_loop(lambda: len(pool.connections)), 5, "closed")

        def records() -> list[dict[str, object]]:
            return list(read_directory(tmp_path / "wal"))

        wait_until(lambda: bool(records()), 5, "the billing record")
        (record,) = records()
        assert record["status"] == "aborted" and record["tenant"] == "acme"
        assert record["output_tokens"] == 0
        assert unsettled(tmp_path / "wal") == []
        metrics = httpx.get(metrics_url(gateway) + "/metrics", timeout=5).text
        assert "kvgate_clients_cut_total 1.0" in metrics
        client.settimeout(5)
        with contextlib.suppress(ConnectionError):  # reset, or the end of what was sent
            while client.recv(65536):
                pass
    finally:
        client.close()
        stop_all([engine])
