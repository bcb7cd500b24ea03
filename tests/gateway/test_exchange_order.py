"""The first-token hook runs before the client is given the first bytes of a stream.

The billing meter writes a stream's open WAL entry in that hook (the record it is billed by if
the gateway dies mid-body, docs/billing.md): a client that holds tokens before the entry exists
is a stream a `kill -9` leaves unbilled (`kvgate chaos`'s gateway-kill scenario caught it in 1 of
20 runs). The order is pinned here with the real `Exchange` and `EventReader` over an in-memory
engine stream, so it fails deterministically rather than once in a while under load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.pipeline.exchange import Exchange
from gateway.pipeline.forwarder import EventReader, Streaming

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


def _exchange(log: list[str]) -> Exchange:
    reader = EventReader(_Content(EVENTS[1:]))  # type: ignore[arg-type]
    stream = Streaming(
        SimpleNamespace(close=lambda: None, release=lambda: None),  # type: ignore[arg-type]
        [EVENTS[0].rstrip(b"\n")],
        reader.batches(),
        reader,
    )
    lease = SimpleNamespace(state=SimpleNamespace(id="r0", heard_s=0.0), release=lambda: None)
    return Exchange(_Hooks(log), SimpleNamespace(), lease, None, stream)  # type: ignore[arg-type]


def _consume(stream: str, log: list[str]) -> None:
    async def run() -> None:
        exchange = _exchange(log)
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


def test_parsed_chunks_run_the_first_token_hook_before_the_first_chunk() -> None:
    log: list[str] = []
    _consume("chunks", log)
    assert log[0] == "first_token", log
    assert log.count("first_token") == 1
    assert log[-1] == "finish"
