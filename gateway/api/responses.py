"""What an HTTP front end sends back for an exchange: the SSE response, and the operator's
debug headers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from gateway.pipeline.exchange import Exchange


def debug_headers(exchange: Exchange, enabled: bool) -> dict[str, str]:
    """`x-kvgate-*` headers naming the replica and why it was chosen (operators only: they
    reveal cache state, so `debug_headers` is off by default)."""
    if not enabled:
        return {}
    routed = exchange.routed
    return {
        "x-kvgate-replica": exchange.replica_url,
        "x-kvgate-matched-blocks": str(routed.route.overlap.get(exchange.record.replica, 0)),
        "x-kvgate-decision": routed.decision.reason,
    }


class ExchangeSSE(Response):
    """Streams an exchange to the client as server-sent events; subclasses say what bytes.

    Starlette's StreamingResponse watches for a disconnect through an anyio task group, which
    cost ~10% of the gateway's CPU per streamed request; here one plain task watches, and a
    disconnect closes the upstream connection (the stream then ends and the engine aborts).
    """

    def __init__(self, exchange: Exchange, headers: dict[str, str]) -> None:
        # no body and no content-length: the server sends it chunked
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]
        self.exchange = exchange

    def events(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        exchange = self.exchange

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            exchange.abort()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            watcher.cancel()
            with contextlib.suppress(Exception):  # the client may be gone already
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            await exchange.finish()


class OpenAISSE(ExchangeSSE):
    """The engine's own SSE bytes, relayed a network read at a time."""

    def events(self) -> AsyncIterator[bytes]:
        return self.exchange.batches(self.exchange.parsed.include_usage)
