"""The request path when an engine fails under it: a stream cut by a dead engine ends with a
clean error in the API's own shape; a hung engine (no first byte) costs a bounded wait and a
retry on another replica; a stalled stream ends with a clean error, or, when the client did not
stream and has seen nothing, moves to another replica. Real engines and gateways on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import MODEL, TENANT_KEY, engine_of
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

SLOW_DECODE = TimingModel(decode_s_per_token=0.02)
"""300 tokens take 6 s: time to kill or stall the engine mid-answer."""
HEADERS = {"authorization": f"Bearer {TENANT_KEY}"}
LIBRARY_WORDS = ("TransferEncodingError", "400", "Payload", "aiohttp", "http://", "127.0.0.1")
"""What the client must never read in an upstream failure: the HTTP library's internals, a
misleading status, a replica's URL."""


def conversation(tag: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": words(f"{tag}/system", 600)},
        {"role": "user", "content": words(f"{tag}/task", 50)},
    ]


def home_of(gateway: Served, messages: list[dict[str, Any]]) -> str:
    """Where the conversation's prefix is cached (a first turn writes it)."""
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    return raw.headers["x-kvgate-replica"]


def sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def assert_clean(message: str) -> None:
    assert "upstream failure" in message, message
    for word in LIBRARY_WORDS:
        assert word not in message, (word, message)


def test_an_engine_that_dies_mid_stream_ends_the_openai_stream_with_a_clean_error(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """Before: `upstream stream broke: Response payload is not completed: <TransferEncodingError:
    400, ...>` and no end of stream. Now: an `error` data event naming an upstream failure, then
    `[DONE]`, as an engine ends a stream on an error."""
    engines = start_engines(1, timing=SLOW_DECODE)
    gateway = start_gateway(engines)
    body = {"model": MODEL, "messages": conversation("dies"), "max_tokens": 300, "stream": True}
    url = gateway.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=30) as r:
        chunks = r.iter_bytes()
        assert next(chunks).startswith(b"data: ")
        engines[0].server.should_exit = engines[0].server.force_exit = True  # the engine dies
        rest = b"".join(chunks)
    events = sse_events(rest)
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "upstream_error" and error["code"] == "upstream_stream_broken"
    assert_clean(error["message"])


def test_the_sdk_raises_the_clean_error_of_a_stream_cut_by_a_dead_engine(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, timing=SLOW_DECODE)
    gateway = start_gateway(engines)
    stream = client(gateway).chat.completions.create(
        model=MODEL, messages=conversation("sdk"), max_tokens=300, stream=True
    )
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk)
            if len(received) == 2:
                engines[0].server.should_exit = engines[0].server.force_exit = True
    assert len(received) >= 2
    assert_clean(raised.value.message)


def test_a_non_streamed_answer_whose_engine_dies_mid_decode_moves_to_another_replica(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """The gateway streams from the engine even for a client that did not ask to; when that
    stream breaks before the answer is whole, the client has seen nothing, so the exchange moves
    to the next replica rather than failing (as a whole-body read that broke always did)."""
    engines = start_engines(2, timing=SLOW_DECODE)
    gateway = start_gateway(engines)
    messages = conversation("moves")
    home = home_of(gateway, messages)
    holder = next(e for e in engines if e.url == home)
    core = engine_of(holder).core

    def kill_when_decoding() -> None:
        deadline = time.monotonic() + 10
        while core.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a few tokens into the answer
        holder.server.should_exit = holder.server.force_exit = True

    killer = threading.Thread(target=kill_when_decoding)
    killer.start()
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=100
    )
    killer.join()
    reply = raw.parse()
    other = next(e for e in engines if e.url != home)
    assert raw.headers["x-kvgate-replica"] == other.url  # who answered in the end
    assert reply.usage is not None and reply.usage.completion_tokens == 100
    assert reply.choices[0].message.content


def test_a_hung_engine_costs_a_bounded_wait_and_a_retry_on_another_replica(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """An engine that accepts the request and never sends a byte: after `first_byte_timeout_s`
    the attempt moves to the next replica (before: a wait of up to 600 s)."""
    engines = start_engines(2)
    gateway = start_gateway(engines, first_byte_timeout_s=0.5)
    messages = conversation("hung")
    home = home_of(gateway, messages)
    holder = next(e for e in engines if e.url == home)
    retries = director(gateway).stats.retries
    for stream in (False, True):
        engine_of(holder).num_hangs_left = 1
        started = time.monotonic()
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream}
        response = httpx.post(
            gateway.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=10
        )
        elapsed = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert 0.5 <= elapsed < 5, elapsed
        assert engine_of(holder).num_hangs_left == 0  # the holder was tried first
        if not stream:
            assert response.headers["x-kvgate-replica"] != home
    assert director(gateway).stats.retries == retries + 2


def test_a_stream_that_stalls_ends_with_a_clean_error_after_the_idle_timeout(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, stall_after_tokens=3)
    gateway = start_gateway(engines, stream_idle_timeout_s=0.5)
    body = {"model": MODEL, "messages": conversation("stall"), "max_tokens": 50, "stream": True}
    started = time.monotonic()
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=10
    )
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 5, elapsed
    events = sse_events(response.content)
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_stalled" and "0.5 s" in error["message"]
    assert_clean(error["message"])
    assert len(events) >= 3  # the tokens before the stall reached the client
    engine = engine_of(engines[0])
    wait_until(lambda: engine.num_stalled == 0, 5, "the stalled connection dropped")


def test_a_non_streamed_answer_that_stalls_moves_to_another_replica(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines, stream_idle_timeout_s=0.5)
    messages = conversation("stall-moves")
    home = home_of(gateway, messages)
    holder = next(e for e in engines if e.url == home)
    engine_of(holder).stall_after_tokens = 2
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=20
    )
    assert raw.headers["x-kvgate-replica"] != home
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.completion_tokens == 20
    assert reply.choices[0].message.content
    wait_until(lambda: engine_of(holder).num_stalled == 0, 5, "the stalled connection dropped")
