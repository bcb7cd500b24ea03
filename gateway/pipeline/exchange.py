"""An exchange: one request committed to one replica (its first byte has arrived), and the hooks
that later stages (reconciliation, billing, metrics) attach to it.

Front ends consume an exchange in the shape they speak: the OpenAI HTTP API relays the engine's
SSE bytes (`batches`), other front ends read parsed chunks (`chunks`) or the whole body
(`body`). Whatever the shape, the usage object passes through `Director._on_usage` exactly once
before the client sees it, and `finish()` runs exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson
from starlette.responses import Response

from cachemap.keys import BlockHash
from gateway.fleet.replicas import ReplicaState
from gateway.pipeline.flights import Flight
from gateway.pipeline.forwarder import Streaming
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from router.types import Decision, RouteRequest

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.pipeline.director import Director


@dataclass(slots=True)
class Routed:
    """A request after routing: its hashes, the decision and the estimates behind it."""

    parsed: ParsedRequest
    tenant: Tenant
    hashes: list[BlockHash]
    route: RouteRequest
    decision: Decision
    last_use: dict[str, float] = field(default_factory=dict)
    """replica -> last use of the deepest matched block (see `RoutingDirectory.Lookup`)"""
    start_s: float = field(default_factory=time.monotonic)
    """When the request was routed (monotonic; after any fan-out hold, so a held sibling's
    clock starts at its release): TTFT and billing clocks start here."""
    flight: Flight | None = None
    """Set when this request leads a fan-out: its siblings wait for its first byte."""
    admitted_tokens: int = 0
    """Tokens charged to the tenant's tokens/min budget at admission; usage settles the rest."""
    # -- observability (issue 9) --
    opened_s: float = 0.0
    """When `Director.open` began (monotonic): TTFT as the client sees it starts here."""
    span: Span | None = None
    """The request's trace span (gateway.observability.tracing), when tracing is on; ends
    with the exchange."""
    upstream_span: Span | None = None
    """The committed attempt's span."""
    trace_headers: dict[str, str] | None = None
    """The client's W3C trace-context headers, passed to the engine when kvgate does not trace
    the request itself."""


class ExchangeObserver(Protocol):
    """Hooks around a committed exchange. All are awaited on the request's path.

    - `on_first_token`: the engine has written the prompt's KV (placement is known).
    - `on_usage`: the engine's usage object, before the client sees it; may rewrite it in place
      (the usage fields of a billing profile), and a durable write here happens before the
      response completes.
    - `on_finish`: once, when the exchange ends; `ok` is False when it broke or the client left.
    """

    async def on_first_token(self, exchange: Exchange) -> None: ...

    async def on_usage(self, exchange: Exchange, usage: dict[str, Any]) -> None: ...

    async def on_finish(self, exchange: Exchange, ok: bool) -> None: ...


class Exchange:
    def __init__(
        self,
        director: Director,
        routed: Routed,
        replica: ReplicaState,
        *,
        body: dict[str, Any] | None = None,
        stream: Streaming | None = None,
    ) -> None:
        self.director = director
        self.routed = routed
        self.replica = replica
        self.body = body
        self.stream = stream
        self.first_token_s: float | None = None
        self.usage: dict[str, Any] | None = None
        self.client_gone = False
        self.closed = False
        self.ok = True

    @property
    def parsed(self) -> ParsedRequest:
        return self.routed.parsed

    # -- non-streamed --------------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole body, its usage passed through the hooks; finishes the exchange."""
        assert self.body is not None
        try:
            await self.director._on_first_token(self)
            usage = self.body.get("usage")
            if isinstance(usage, dict):
                await self.director._on_usage(self, usage)
            return self.body
        finally:
            await self.finish()

    # -- streamed --------------------------------------------------------------------------------
    async def batches(self, include_usage: bool) -> AsyncIterator[bytes]:
        """The engine's SSE events as bytes, a batch per network read; the usage event passes
        through the hooks and is dropped when the client did not ask for usage."""
        async for events in self._raw_batches():
            out = []
            for event in events:
                if b'"usage"' in event and event.startswith(b"data: {"):
                    rewritten = await self._usage_event(event, include_usage)
                    if rewritten:
                        out.append(rewritten)
                else:
                    out.append(event + b"\n\n")
            if out:
                yield b"".join(out)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The engine's SSE chunks, parsed (the usage chunk after the hooks)."""
        async for events in self._raw_batches():
            for event in events:
                if not event.startswith(b"data:"):
                    continue
                data = event[5:].strip()
                if data == b"[DONE]":
                    # not `return`: the batches must run out, or the first-token hook (which
                    # runs after the first batch) is skipped when [DONE] is in that batch
                    continue
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue
                usage = chunk.get("usage") if isinstance(chunk, dict) else None
                if isinstance(usage, dict):
                    await self.director._on_usage(self, usage)
                if isinstance(chunk, dict):
                    yield chunk

    async def _raw_batches(self) -> AsyncIterator[list[bytes]]:
        stream = self.stream
        assert stream is not None
        try:
            yield stream.first_batch
            await self.director._on_first_token(self)
            async for batch in stream.batches:
                yield batch
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.ok = False
            if not self.client_gone:
                self.director.stream_broke(self, exc)
                error = {
                    "error": {"message": f"upstream stream broke: {exc}", "type": "upstream_error"}
                }
                yield [b"data: " + orjson.dumps(error)]
        finally:
            await self.finish()

    async def _usage_event(self, event: bytes, include_usage: bool) -> bytes:
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if not isinstance(usage, dict):
            return event + b"\n\n"
        await self.director._on_usage(self, usage)
        if not include_usage:
            if not chunk.get("choices"):
                return b""
            chunk.pop("usage", None)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    # -- lifecycle -------------------------------------------------------------------------------
    def abort(self) -> None:
        """The client left: drop the upstream connection, so the engine aborts the request."""
        self.client_gone = True
        self.ok = False
        if self.stream is not None:
            self.stream.response.close()

    async def finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.response.release()  # an unfinished response closes its connection
        await self.director._on_finish(self)


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
