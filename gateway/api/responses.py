"""What an HTTP front end sends back for an exchange: the SSE response, and the operator's
debug headers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import orjson
from starlette.responses import Response

from gateway.api.asgi import (
    ChunkedOut,
    StatusSend,
    client_paused,
    cut_client,
    raw_send,
    send_whole,
    start_chunked,
)
from gateway.api.errors import openai_error_body
from gateway.errors import GatewayError
from gateway.pipeline.exchange import ClientTooSlow, Exchange
from gateway.request.receipt import receipt_fields, receipt_header


class ShuttingDown(GatewayError):
    """503 mid-stream: the gateway's drain grace ran out before the stream did."""

    status = 503
    type = "service_unavailable_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="shutting_down")


def debug_headers(exchange: Exchange, enabled: bool) -> dict[str, str]:
    """The answer's `x-request-id` (the gateway's id of the exchange: what the access log and
    the console's request lookup know it by); `x-kvgate-*` headers naming the replica and why
    it was chosen (operators only: they reveal cache state, so `debug_headers` is off by
    default); and the route receipt `x-kvgate-route` (gateway.request.receipt) with them or
    for a tenant given `route_receipts`."""
    routed = exchange.routed
    headers = {"x-request-id": exchange.record.request_id}
    if not (enabled or routed.tenant.policy.route_receipts):
        return headers
    headers["x-kvgate-route"] = receipt_header(receipt_fields(routed, exchange.record.replica))
    if enabled:
        headers["x-kvgate-replica"] = exchange.replica_url
        headers["x-kvgate-matched-blocks"] = str(
            routed.route.overlap.get(exchange.record.replica, 0)
        )
        headers["x-kvgate-decision"] = routed.decision.reason
    return headers


class JSONBytes(Response):
    """A JSON body serialized already, its head built here: the bytes Starlette's `Response`
    would send (the given headers, then content-length and content-type), without its
    `init_headers` (a lowercasing, encoding and scanning pass on every answer)."""

    media_type = "application/json"

    def __init__(
        self, body: bytes, headers: dict[str, str] | None = None, status_code: int = 200
    ) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body
        raw = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()
        ]
        raw.append((b"content-length", b"%d" % len(body)))
        raw.append((b"content-type", b"application/json"))
        self.raw_headers = raw

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """The start and the body in one write to the client (`send_whole`) from here: past
        Starlette's `Response.__call__` and the app's hold of a start (`StatusSend`), which
        would only scan the headers for the length this answer knows it has."""
        start = {
            "type": "http.response.start",
            "status": self.status_code,
            "headers": self.raw_headers,
        }
        body = {"type": "http.response.body", "body": self.body}
        if isinstance(send, StatusSend):
            send.status = self.status_code
            send = send.raw
        await send_whole(send, start, body)


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

    splices = False
    """`relay` writes the body to the client's connection itself (when the server allows)."""

    def events(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def relay(self, out: ChunkedOut) -> None:
        raise NotImplementedError

    def error_event(self, err: GatewayError) -> bytes:
        """A mid-stream error in the API's shape (the stream ends after it)."""
        raise NotImplementedError

    async def _within_drain_deadline(self, sending: Awaitable[None]) -> bool:
        """A write that waits for the client, at most the exchange's drain deadline; False (the
        exchange cut, as `Exchange.drain` does) when the client did not read in time."""
        exchange = self.exchange
        try:
            async with asyncio.timeout(exchange.drain_timeout_s):
                await sending
        except TimeoutError:
            exchange.cut_slow_client()
            return False
        return True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        exchange = self.exchange
        body = raw_send(send)  # the start goes through the app's layers, the body past them

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            exchange.abort()

        watcher = asyncio.create_task(watch())
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        out: ChunkedOut | None = None
        try:
            if self.splices:  # the start goes out with the first events, in one write
                out = await start_chunked(send, start)
            else:
                await send(start)
            if out is not None:
                await self.relay(out)
            else:
                async for chunk in self.events():
                    message = {"type": "http.response.body", "body": chunk, "more_body": True}
                    if not client_paused(body):
                        await body(message)  # written at once: nothing to wait for
                    elif not await self._within_drain_deadline(body(message)):
                        cut_client(body)
                        break
        except asyncio.CancelledError:  # the drain's grace ran out: say so, then end
            exchange.abort()
            if out is not None:
                out.flush()
            with contextlib.suppress(Exception):
                cut = self.error_event(ShuttingDown("the gateway is shutting down; retry"))
                await body({"type": "http.response.body", "body": cut, "more_body": True})
            raise
        finally:
            watcher.cancel()
            if out is not None:
                out.flush()  # a stream that wrote nothing: its start, before its end
            with contextlib.suppress(Exception):  # the client may be gone already
                await body({"type": "http.response.body", "body": b"", "more_body": False})
            await exchange.finish()


class OpenAISSE(ExchangeSSE):
    """The engine's own SSE bytes, relayed a network read at a time. A stream that ends early
    ends as an engine's does on an error: an `error` object in a data event, then `[DONE]`
    (the OpenAI SDKs raise an `APIError` with the message)."""

    splices = True

    async def events(self) -> AsyncIterator[bytes]:
        exchange = self.exchange
        async for batch in exchange.batches(exchange.parsed.include_usage):
            yield batch
        if exchange.failure is not None and not exchange.client_gone:
            yield self.error_event(exchange.failure)

    async def relay(self, out: ChunkedOut) -> None:
        exchange = self.exchange
        await exchange.relay(out, exchange.parsed.include_usage)
        if exchange.failure is not None and not exchange.client_gone:
            if out.paused:
                try:
                    await exchange.drain(out)
                except ClientTooSlow:
                    return
            out.write(self.error_event(exchange.failure))

    def error_event(self, err: GatewayError) -> bytes:
        return b"data: " + orjson.dumps(openai_error_body(err)) + b"\n\ndata: [DONE]\n\n"
