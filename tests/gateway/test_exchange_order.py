"""The first-token hook runs before the client is given the first bytes of a stream.

The billing meter writes a stream's open WAL entry in that hook (the record it is billed by if
the gateway dies mid-body, docs/billing.md): a client that holds tokens before the entry exists
is a stream a `kill -9` leaves unbilled (`kvgate chaos`'s gateway-kill scenario caught it in 1 of
20 runs). The order is pinned here with the real `Exchange` and `EventReader` over an in-memory
engine stream, so it fails deterministically rather than once in a while under load."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.errors import UpstreamError
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.forwarder import EventReader, Forwarder, Streaming
from gateway.pipeline.upstream import UpstreamPool

EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]


class _Content:
    """What aiohttp's StreamReader gives the reader: one network read per call."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)

    async def readany(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


class _Hooks:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def first_token(self, exchange: Any) -> None:
        self.log.append("first_token")

    async def usage(self, exchange: Any, fields: dict[str, Any]) -> Any:
        self.log.append("usage")
        return None

    async def moved(self, exchange: Any) -> None: ...

    async def finish(self, exchange: Any) -> None:
        self.log.append("finish")

    def stream_broke(self, exchange: Any, exc: BaseException | str) -> None: ...


def _exchange(
    log: list[str], first: int = 1, events: list[bytes] = EVENTS, reads: list[bytes] | None = None
) -> Exchange:
    """The first `first` events arrive in the first read (all of them: a short answer), the
    rest a read each (or as `reads`)."""
    reader = EventReader(_Content(events[first:] if reads is None else reads))  # type: ignore[arg-type]
    stream = Streaming(
        SimpleNamespace(close=lambda: None, release=lambda: None),  # type: ignore[arg-type]
        [e.rstrip(b"\n") for e in events[:first]],
        reader.batches(),
        reader,
    )
    lease = SimpleNamespace(state=SimpleNamespace(id="r0", heard_s=0.0), release=lambda: None)
    return Exchange(_Hooks(log), SimpleNamespace(), lease, None, stream)  # type: ignore[arg-type]


def _consume(stream: str, log: list[str], first: int = 1) -> None:
    async def run() -> None:
        exchange = _exchange(log, first)
        chunks = exchange.batches(include_usage=True) if stream == "bytes" else exchange.chunks()
        async for chunk in chunks:
            log.append(f"client:{len(chunk)}")

    asyncio.run(run())


def test_the_relay_runs_the_first_token_hook_before_the_first_bytes_go_out() -> None:
    log: list[str] = []
    _consume("bytes", log)
    assert log[0] == "first_token", log
    assert log.count("first_token") == 1
    assert any(entry.startswith("client:") for entry in log)
    assert log[-1] == "finish"


def test_a_first_read_holding_the_usage_runs_the_first_token_hook_before_the_usage() -> None:
    for shape in ("bytes", "chunks"):
        log: list[str] = []
        _consume(shape, log, first=len(EVENTS))
        assert log[0] == "first_token", (shape, log)  # then the usage (once), then finish
        assert log.count("usage") == 1 and log[-1] == "finish"


def test_parsed_chunks_run_the_first_token_hook_before_the_first_chunk() -> None:
    log: list[str] = []
    _consume("chunks", log)
    assert log[0] == "first_token", log
    assert log.count("first_token") == 1
    assert log[-1] == "finish"


def test_a_non_streamed_answer_is_assembled_from_any_reads_with_the_hooks_in_order() -> None:
    """`complete` reads on where the first batch ended, whatever the reads' boundaries (an
    event split across reads, several in one, [DONE] and a comment skipped)."""
    rest = b": a comment\n\n" + b"".join(EVENTS[1:])
    for reads in ([rest], [rest[i : i + 7] for i in range(0, len(rest), 7)]):
        log: list[str] = []

        async def run(reads: list[bytes] = reads, log: list[str] = log) -> dict[str, object]:
            return await _exchange(log, reads=reads).complete()

        body = asyncio.run(run())
        choices = body["choices"]
        assert isinstance(choices, list) and choices[0]["message"]["content"] == "ab"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
        assert log == ["first_token", "usage", "finish"], log


def test_an_engine_error_event_fails_a_non_streamed_answer() -> None:
    error = b'data: {"error":{"message":"boom","code":500}}\n\n'
    log: list[str] = []

    async def run() -> None:
        await _exchange(log, events=[EVENTS[0], error]).complete()

    with pytest.raises(UpstreamError) as raised:
        asyncio.run(run())
    assert raised.value.code == "upstream_error_event" and "boom" not in str(raised.value)
    assert log == ["first_token", "finish"], log


class _Client:
    """The client's side of a spliced relay (`ClientOut`), logging each write."""

    paused = False

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.received = b""

    def write(self, data: bytes) -> None:
        self.log.append(f"client:{len(data)}")
        self.received += data

    async def drain(self) -> None: ...


async def test_the_spliced_relay_runs_the_hooks_in_order_over_a_real_connection() -> None:
    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in EVENTS:  # a read each, or several per read: the order must not change
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    forwarder = Forwarder(5.0, 5.0)
    forwarder.pool = UpstreamPool(8, 2.0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    try:
        opened = await forwarder.attempt(url, b"{}", stream=True)
        assert isinstance(opened, Streaming)
        log: list[str] = []
        lease = SimpleNamespace(state=SimpleNamespace(id="r0", heard_s=0.0), release=lambda: None)
        exchange = Exchange(_Hooks(log), SimpleNamespace(), lease, None, opened)  # type: ignore[arg-type]
        client = _Client(log)
        await exchange.relay(client, include_usage=True)
    finally:
        forwarder.pool.close()
        server.close()
        await server.wait_closed()
    assert log[0] == "first_token", log
    assert log.count("first_token") == 1 and log.count("usage") == 1
    usage_at = log.index("usage")  # before the client is given the usage event
    assert sum(int(e.split(":")[1]) for e in log[:usage_at] if e.startswith("client:")) <= len(
        EVENTS[0] + EVENTS[1]
    )
    assert log[-1] == "finish"
    assert client.received == b"".join(EVENTS)


def test_a_finished_exchange_leaves_no_cycle_for_the_collector() -> None:
    """The director's `on_closed` closes over its exchange (the count of requests in flight):
    kept after the exchange finished, the pair was a reference cycle, so every request's whole
    graph (exchange, stream, reader, routed request, trace, the director's closures: ~50 objects)
    waited for the cyclic GC, whose passes were 7-15% of the gateway's CPU at `bench-cpu`. With
    the collector off, the finished exchange must be freed by its reference count alone."""
    log: list[str] = []
    gone: list[weakref.ref[Exchange]] = []

    async def run() -> None:
        exchange = _exchange(log)
        exchange.on_closed = lambda: log.append(f"closed cut={exchange.cut}")
        async for chunk in exchange.batches(include_usage=True):
            log.append(f"client:{len(chunk)}")
        gone.append(weakref.ref(exchange))

    gc.collect()
    gc.disable()
    try:
        asyncio.run(run())
        assert log[-2:] == ["finish", "closed cut=False"], log
        assert gone[0]() is None, gc.get_referrers(gone[0]())
    finally:
        gc.enable()
