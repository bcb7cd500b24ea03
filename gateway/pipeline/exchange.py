"""An exchange: one request committed to one replica (its first byte has arrived).

Front ends consume an exchange in the shape they speak: the OpenAI HTTP API relays the engine's
SSE bytes (`batches`), other front ends read parsed chunks (`chunks`) or the whole body
(`complete`). Whatever the shape, the exchange calls its hooks in order — `first_token` once,
`usage` exactly once before the client sees the usage, `finish` exactly once — and keeps its
`ExchangeRecord`, which observers read.

The hooks are the record step of the pipeline (`gateway.pipeline.record.Recorder`), declared
here as a protocol, so the exchange knows nothing of the director.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import orjson

from gateway.fleet.replicas import Lease
from gateway.pipeline.forwarder import Streaming
from gateway.request.parsed import ParsedRequest
from gateway.request.state import ExchangeRecord, Routed
from gateway.request.trace import RequestTrace
from gateway.request.usage import EngineUsage


class ExchangeHooks(Protocol):
    async def first_token(self, exchange: Exchange) -> None: ...

    async def usage(self, exchange: Exchange, fields: dict[str, Any]) -> EngineUsage: ...

    async def finish(self, exchange: Exchange) -> None: ...

    def stream_broke(self, exchange: Exchange, exc: BaseException) -> None: ...


class Exchange:
    def __init__(
        self,
        hooks: ExchangeHooks,
        routed: Routed,
        lease: Lease,
        trace: RequestTrace,
        *,
        body: dict[str, Any] | None = None,
        stream: Streaming | None = None,
    ) -> None:
        self.hooks = hooks
        self.lease = lease
        self.trace = trace
        self.record = ExchangeRecord(routed, lease.state.id, body)
        self.stream = stream
        self.client_gone = False
        self.closed = False

    @property
    def routed(self) -> Routed:
        return self.record.routed

    @property
    def parsed(self) -> ParsedRequest:
        return self.record.routed.parsed

    @property
    def replica_url(self) -> str:
        return self.lease.state.url

    @property
    def usage(self) -> dict[str, Any] | None:
        """The usage object as the client will see it, once it has arrived."""
        usage = self.record.usage
        return usage.fields if usage is not None else None

    # -- non-streamed --------------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole body, its usage passed through the hooks; finishes the exchange."""
        body = self.record.body
        assert body is not None
        try:
            await self.hooks.first_token(self)
            usage = body.get("usage")
            if isinstance(usage, dict):
                await self.hooks.usage(self, usage)
            return body
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
                    await self.hooks.usage(self, usage)
                if isinstance(chunk, dict):
                    yield chunk

    async def _raw_batches(self) -> AsyncIterator[list[bytes]]:
        stream = self.stream
        assert stream is not None
        try:
            yield stream.first_batch
            await self.hooks.first_token(self)
            async for batch in stream.batches:
                yield batch
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.record.ok = False
            if not self.client_gone:
                self.hooks.stream_broke(self, exc)
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
        await self.hooks.usage(self, usage)
        if not include_usage:
            if not chunk.get("choices"):
                return b""
            chunk.pop("usage", None)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    # -- lifecycle -------------------------------------------------------------------------------
    def abort(self) -> None:
        """The client left: drop the upstream connection, so the engine aborts the request."""
        self.client_gone = True
        self.record.ok = False
        if self.stream is not None:
            self.stream.response.close()

    async def finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.response.release()  # an unfinished response closes its connection
        self.lease.release()
        await self.hooks.finish(self)
