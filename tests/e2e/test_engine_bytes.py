"""What a broken or hostile engine's bytes can do to a gateway (issue 45, items 4 and 5), with
a real gateway in front of an engine that writes exact bytes (`tests.raw_engine`): a stray
response on a kept-alive connection reaches no request, not even the one before it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.clients import director
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY
from tests.raw_engine import RawEngine, default_shape, http_answer, sse_answer
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

STRAY = b'{"stray": "bytes nobody asked for: another request\'s '


def stray_swallowing(real: bytes) -> bytes:
    """A partial response whose content-length swallows `real`, the engine's next answer."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%b" % (
        len(STRAY) + len(real),
        STRAY,
    )


@pytest.fixture
def raw_engine() -> Iterator[Callable[..., RawEngine]]:
    started: list[RawEngine] = []

    def start(**kwargs: Any) -> RawEngine:
        started.append(RawEngine(**kwargs))
        return started[-1]

    yield start
    for engine in started:
        engine.stop()


def chat(gateway: Served, key: str, stream: bool) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def test_a_stray_response_after_a_stream_reaches_neither_it_nor_the_next_request(
    raw_engine: Callable[..., RawEngine], start_gateway: Callable[..., Served]
) -> None:
    """The engine ends each streamed answer and, in the same write, begins a stray response
    whose length swallows its next answer. Before: the stray bytes went out as the end of the
    first tenant's stream, the connection went back to the pool mid-stray, and the next
    request (another tenant's) waited for headers that never came (its answer swallowed), then
    failed after the first-byte timeout. Now the connection is dropped at the stray's first
    byte, and each request gets exactly its own answer."""

    def shape(n: int, body: bytes) -> bytes:
        return sse_answer(f"answer {n}") + stray_swallowing(sse_answer(f"answer {n + 1}"))

    engine = raw_engine(shape=shape)
    gateway = start_gateway([engine], scrape_metrics=False, first_byte_timeout_s=2.0)
    for n, key in ((1, TENANT_KEY), (2, OTHER_KEY), (3, TENANT_KEY)):
        started = time.monotonic()
        response = chat(gateway, key, stream=True)
        assert response.status_code == 200, response.text
        assert b"stray" not in response.content, response.content
        assert f"answer {n}".encode() in response.content
        assert response.content.endswith(b"data: [DONE]\n\n")
        assert time.monotonic() - started < 2.0
    assert engine.num_completions == 3
    pool = director(gateway).forwarder.pool
    assert pool is not None and pool.num_strays == 3  # counted: kvgate_upstream_stray_...


def test_a_stray_response_on_an_idle_connection_reaches_no_request(
    raw_engine: Callable[..., RawEngine], start_gateway: Callable[..., Served]
) -> None:
    """The engine writes the stray response on the idle connection between two requests (the
    gateway reads it while no request is in flight). Before: kept, parsed, and the connection
    reused; the next answer was swallowed. Now the connection is closed when the bytes come."""
    engine = raw_engine(shape=default_shape)
    gateway = start_gateway([engine], scrape_metrics=False, first_byte_timeout_s=2.0)
    pool = director(gateway).forwarder.pool
    assert pool is not None
    for stream in (True, False):
        before = engine.num_completions
        assert chat(gateway, TENANT_KEY, stream).status_code == 200
        n = engine.num_completions
        engine.write_on(-1, stray_swallowing(sse_answer(f"answer {n + 1}")))
        wait_until(lambda: not gateway.on_loop(lambda: len(pool.connections)), 2, "closed")
        started = time.monotonic()
        response = chat(gateway, OTHER_KEY, stream)
        assert response.status_code == 200, response.text
        assert b"stray" not in response.content
        assert f"answer {n + 1}".encode() in response.content
        assert time.monotonic() - started < 2.0
        assert engine.num_completions == before + 2


FLOOD = 8 * 1024 * 1024


class Flood:
    """The engine's answers, switched by the test: `mode` names the misbehaviour."""

    def __init__(self) -> None:
        self.mode = "ok"

    def __call__(self, n: int, body: bytes) -> bytes:
        if self.mode == "header":  # an 8 MB header (llhttp's cost is quadratic in it)
            return sse_answer(f"answer {n}", head=b"x-flood: %b\r\n" % (b"a" * FLOOD))
        if self.mode in ("400", "500"):  # an 8 MB error body
            error = b'{"error": {"message": "%b"}}' % (b"e" * FLOOD)
            return http_answer(int(self.mode), b"application/json", error)
        if self.mode == "sse":  # 8 MB of streamed answer, for a client that did not stream
            return sse_answer("s" * 16_000, num_events=FLOOD // 16_000)
        if self.mode == "event":  # one event of 8 MB, never whole (no blank line after it)
            return sse_answer("e" * FLOOD)[: -len(b"0\r\n\r\n")]
        if self.mode == "json":  # an 8 MB answer, not streamed (whatever was asked): read whole
            return http_answer(200, b"application/json", b'{"x": "%b"}' % (b"j" * FLOOD))
        return default_shape(n, body)


@pytest.mark.parametrize(
    ("mode", "stream"),
    [
        ("header", True),
        ("400", True),
        ("500", True),
        ("json", False),
        ("500", False),
        ("sse", False),
        ("event", True),
    ],
)
def test_an_engines_huge_head_or_body_is_a_clean_502_and_the_gateway_stays_responsive(
    raw_engine: Callable[..., RawEngine],
    start_gateway: Callable[..., Served],
    mode: str,
    stream: bool,
) -> None:
    """Item 5. Before: an 8 MB header was parsed whole (quadratic in llhttp) and the answer
    relayed; an 8 MB 4xx was read whole and passed through; an 8 MB non-streamed answer was
    read whole, and so was one assembled from 8 MB of stream for a client that did not stream;
    an event that never ended was held back whole. Now a head is cut at
    `upstream_max_header_bytes` (64 KiB), a whole or assembled body and an event at
    `upstream_max_body_bytes` (1 MiB here), each a 502 in the API's shape; a 5xx's body is
    read only for the log; the next request is served at once (the replica is not down)."""
    flood = Flood()
    engine = raw_engine(shape=flood)
    gateway = start_gateway([engine], scrape_metrics=False, upstream_max_body_bytes=1024 * 1024)
    pool = director(gateway).forwarder.pool
    assert pool is not None
    for _ in range(2):  # and again: the gateway is as it was
        flood.mode = mode
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        started = time.monotonic()
        response = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={**body, "stream": stream},
            headers={"authorization": f"Bearer {TENANT_KEY}"},
            timeout=10,
        )
        elapsed = time.monotonic() - started
        assert response.status_code == 502, (mode, response.status_code, response.text[:200])
        error = response.json()["error"]
        assert error["type"] == "upstream_error", error
        assert len(response.content) < 1000 and "127.0.0.1" not in error["message"]
        if mode in ("400", "json", "sse"):
            assert error["code"] == "upstream_too_large" and "1048576 bytes" in error["message"]
        assert elapsed < 2.0, (mode, elapsed)
        wait_until(lambda: not gateway.on_loop(lambda: len(pool.connections)), 5, "dropped")
        flood.mode = "ok"
        started = time.monotonic()
        assert chat(gateway, OTHER_KEY, stream).status_code == 200
        assert time.monotonic() - started < 1.0
