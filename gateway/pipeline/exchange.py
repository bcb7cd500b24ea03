"""An exchange: one request committed to one replica (its first byte has arrived).

Front ends consume an exchange in the shape they speak: the OpenAI HTTP API relays the engine's
SSE bytes (`relay`, spliced to the client's connection; `batches` where the server gives no
transport), other front ends read parsed chunks (`chunks`), and a client that did not
ask to stream gets the whole answer (`complete`: the engine streams anyway, and its chunks are
assembled by `gateway.pipeline.assemble`). Whatever the shape, the exchange calls its hooks in
order — `first_token` once, `usage` exactly once before the client sees the usage, `finish`
exactly once — and keeps its `ExchangeRecord`, which observers read.

How it ends (typed, so a front end renders it in its own shape and a faster relay keeps it):
- whole: the engine's stream ran out;
- `failure` set, a `GatewayError`: the engine's stream broke or stalled (an `UpstreamError`
  whose text names no library and no replica — the log has both), or a hook refused to go on
  (billing could not write its record). The front end sends it as its API documents a
  mid-stream error and ends the stream; a non-streamed answer raises it.
- moved: a client that did not stream has seen nothing when the engine's stream breaks before
  its usage, so the exchange moves to the next replica (`reforward`, the director's walk)
  instead of failing.
- cut: the client did not read what fills its socket buffer within `drain_timeout_s`
  (`drain`): its connection and the engine's are dropped, as if it had left (`client_gone`),
  and billing records what it would for a client that left (aborted, before the usage).

The hooks are the record step of the pipeline (`gateway.pipeline.record.Recorder`), declared
here as a protocol, so the exchange knows nothing of the director.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from gateway.errors import TOO_LARGE, GatewayError, UpstreamError, too_large
from gateway.fleet.replicas import Lease
from gateway.pipeline.assemble import Assembler
from gateway.pipeline.forwarder import USAGE, ClientOut, Complete, Streaming
from gateway.pipeline.upstream import UpstreamBroke
from gateway.request.parsed import ParsedRequest
from gateway.request.state import ExchangeRecord, Routed
from gateway.request.trace import RequestTrace
from gateway.request.usage import EngineUsage

log = logging.getLogger(__name__)

STREAM_BROKE = "the engine's stream ended before the answer was complete (an upstream failure)"
STREAM_STALLED = "the engine sent nothing for {:g} s (an upstream failure)"
ENGINE_ERROR = "the engine reported an error mid-stream (an upstream failure)"

_UPSTREAM_ERRORS = (UpstreamBroke, TimeoutError)

Reforward = Callable[[], Awaitable[tuple[Lease, Complete | Streaming]]]
"""The director's walk, resumed: the next replica's committed attempt (raises a GatewayError
when no replica is left)."""


class ExchangeHooks(Protocol):
    async def first_token(self, exchange: Exchange) -> None: ...

    async def usage(self, exchange: Exchange, fields: dict[str, Any]) -> EngineUsage: ...

    async def moved(self, exchange: Exchange) -> None: ...

    async def finish(self, exchange: Exchange) -> None: ...

    def stream_broke(self, exchange: Exchange, exc: BaseException | str) -> None: ...


class Exchange:
    def __init__(
        self,
        hooks: ExchangeHooks,
        routed: Routed,
        lease: Lease,
        trace: RequestTrace,
        opened: Complete | Streaming | None = None,
        *,
        reforward: Reforward | None = None,
        drain_timeout_s: float | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.hooks = hooks
        self.max_body_bytes = max_body_bytes
        """The largest answer `complete` assembles (a 502 `upstream_too_large` past it)."""
        self.drain_timeout_s = drain_timeout_s
        """How long a write to the client may wait for it to read (None: as long as it takes)."""
        self.cut = False
        """The client was too slow to read: the stream was cut (`drain`)."""
        self.lease = lease
        lease.state.heard_s = time.monotonic()  # it answered: no health probe needed now
        self.trace = trace
        body = opened.body if isinstance(opened, Complete) else None
        self.record = ExchangeRecord(routed, lease.state.id, body)
        self.stream: Streaming | None = opened if isinstance(opened, Streaming) else None
        self.failure: GatewayError | None = None
        """Why the exchange ended early (see the module docstring), or None."""
        self.client_gone = False
        self.closed = False
        self._reforward = reforward
        self._first_token_done = False
        self.on_closed: Callable[[], None] | None = None
        """Called once the exchange has finished (the director's count of active requests)."""

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

    async def first_token(self) -> None:
        """Run the first-token hook now, once (a fan-out leader does, before it releases its
        siblings; otherwise the exchange does just before the first batch goes out)."""
        if not self._first_token_done:
            self._first_token_done = True
            await self.hooks.first_token(self)

    # -- non-streamed ------------------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole answer, its usage passed through the hooks; finishes the exchange. Raises
        `failure` when it ends early and cannot move."""
        try:
            while True:
                if self.stream is None:
                    return await self._whole_body()
                assembler = Assembler()
                try:
                    await self._assemble(self.stream, assembler)
                except GatewayError as exc:  # a hook refused (billing could not write)
                    self._fail(exc)
                if self.failure is None:
                    body = self.record.body = assembler.body()
                    return body
                if not await self._move():
                    raise self.failure
        finally:
            await self.finish()

    async def _assemble(self, stream: Streaming, assembler: Assembler) -> None:
        """The stream's chunks into `assembler`, as `_parsed(_events())` gives them, in one
        loop: no async generator per answer (py-spy: the three generators and their
        `aclosing` were a fixed cost of every non-streamed answer). The reader goes on where
        the first batch ended (`block`, as the relay does). The usage hook's refusal is raised
        (`complete` fails the exchange); a failing stream ends it with `failure` set."""
        await stream.batches.aclose()
        try:
            await self.first_token()  # before any chunk: see `_events`
        except _UPSTREAM_ERRORS as exc:
            self._broke(stream, exc)
            return
        except GatewayError as exc:
            self._fail(exc)
            return
        reader = stream.reader
        events = stream.first_batch
        size = 0
        while True:
            size += sum(len(e) for e in events)
            if self.max_body_bytes is not None and size > self.max_body_bytes:
                self._fail(too_large(self.max_body_bytes))
                return
            for event in events:
                chunk = await self._answer_chunk(event)
                if chunk is _ENDED:
                    return
                if chunk is not None:
                    assembler.add(chunk)
            try:
                block = await reader.block()
            except _UPSTREAM_ERRORS as exc:
                self._broke(stream, exc)
                return
            if not block:
                return
            events = [e for e in block.split(b"\n\n") if e]

    async def _whole_body(self) -> dict[str, Any]:
        body = self.record.body
        assert body is not None
        await self.first_token()
        usage = body.get("usage")
        if isinstance(usage, dict):
            await self.hooks.usage(self, usage)
        return body

    async def _move(self) -> bool:
        """The engine's stream failed before the usage and the client has seen nothing: take
        the next replica's attempt in its place."""
        if (
            self._reforward is None
            or not isinstance(self.failure, UpstreamError)
            or self.failure.code == TOO_LARGE  # the request's doing: as large elsewhere
            or self.record.usage is not None
            or self.client_gone
        ):
            return False
        if self.stream is not None:
            self.stream.close()
        self.lease.release()
        self.lease, opened = await self._reforward()
        self.lease.state.heard_s = time.monotonic()
        self.record.replica = self.lease.state.id
        self.record.ok = True
        self.failure = None
        if isinstance(opened, Complete):
            self.stream, self.record.body = None, opened.body
        else:
            self.stream = opened
        await self.hooks.moved(self)
        return True

    # -- streamed ----------------------------------------------------------------------------
    async def batches(self, include_usage: bool) -> AsyncIterator[bytes]:
        """The engine's SSE events as bytes, a block per network read; the usage event passes
        through the hooks and is dropped when the client did not ask for usage.

        The relay's hot loop, so it looks only at what it must: a read is passed through as
        the bytes that arrived (whole events, `EventReader.blocks`) unless it holds the text
        `"usage"`, which only the engine's last events do; only those are split and parsed.
        The first-token hook runs before the first batch goes out."""
        stream = self.stream
        assert stream is not None
        try:
            first = await self._opening(stream, include_usage)
            if first:
                yield first
            async with contextlib.aclosing(stream.reader.blocks()) as blocks:
                async for block in blocks:
                    if block.find(USAGE) >= 0:
                        block = await self._usage_block(block, include_usage)
                        if not block:
                            continue
                    yield block
        except _UPSTREAM_ERRORS as exc:
            self._broke(stream, exc)
        except GatewayError as exc:
            self._fail(exc)
        finally:
            await self.finish()

    async def relay(self, out: ClientOut, include_usage: bool) -> None:
        """`batches`, written to the client's connection by the engine connection's own read
        callback (`EventReader.splice`): a read without `"usage"` costs one parse of its HTTP
        framing and one write, and wakes no task. A read that holds the usage, or arrives while
        the client's buffer is full, comes back here (`block`), where the hooks may await and
        `out.drain()` waits for the client, so the gateway holds at most one read per stream
        beyond the sockets' own buffers. Ends the exchange as `batches` does."""
        stream = self.stream
        assert stream is not None
        try:
            first = await self._opening(stream, include_usage)
            if first:
                out.write(first)
            reader = stream.reader
            while True:
                if out.paused:
                    await self.drain(out)
                await reader.splice(out)
                block = await reader.block()
                if not block:
                    break
                if block.find(USAGE) >= 0:
                    block = await self._usage_block(block, include_usage)
                    if not block:
                        continue
                if out.paused:
                    await self.drain(out)
                out.write(block)
        except ClientTooSlow:
            pass  # cut: `drain` has dropped both connections
        except _UPSTREAM_ERRORS as exc:
            self._broke(stream, exc)
        except GatewayError as exc:
            self._fail(exc)
        finally:
            await self.finish()

    async def drain(self, out: ClientOut) -> None:
        """Wait for the client to read (`out.drain()`), at most `drain_timeout_s`; past it the
        client is cut (`cut_slow_client`, then `out.cut()`) and `ClientTooSlow` raised."""
        if self.drain_timeout_s is None:
            await out.drain()
            return
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                await out.drain()
        except TimeoutError:
            self.cut_slow_client()
            out.cut()
            raise ClientTooSlow from None

    def cut_slow_client(self) -> None:
        """The client read nothing for `drain_timeout_s`: end the exchange as if it had left
        (the engine's connection dropped, so the engine aborts the request)."""
        self.cut = True
        log.warning(
            "a stream of tenant %s: its client did not read for %g s; cut",
            self.routed.tenant.name,
            self.drain_timeout_s,
        )
        self.abort()

    async def _opening(self, stream: Streaming, include_usage: bool) -> bytes:
        """The first batch to send, after the first-token hook: before the client holds a
        token (see `_events`), and before the usage hooks (a short answer's first read may
        hold its usage already). The reader then goes on where the batches stopped, unsplit."""
        await self.first_token()
        first = await self._rewrite(stream.first_batch, include_usage)
        await stream.batches.aclose()
        return first

    async def _usage_block(self, block: bytes, include_usage: bool) -> bytes:
        """A read holding the text `"usage"`: split, and its usage event through the hooks."""
        return await self._rewrite([e for e in block.split(b"\n\n") if e], include_usage)

    async def _rewrite(self, events: list[bytes], include_usage: bool) -> bytes:
        """Events with their separators, the usage event through the hooks."""
        out = []
        for event in events:
            if event.find(USAGE) >= 0 and event.startswith(b"data: {"):
                rewritten = await self._usage_event(event, include_usage)
                if rewritten:
                    out.append(rewritten)
            else:
                out.append(event + b"\n\n")
        return b"".join(out)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The engine's SSE chunks, parsed (the usage chunk after the hooks)."""
        try:
            async with contextlib.aclosing(self._parsed(self._events())) as chunks:
                async for chunk in chunks:
                    yield chunk
        except GatewayError as exc:
            self._fail(exc)
        finally:
            await self.finish()

    async def _events(self) -> AsyncGenerator[list[bytes], None]:
        """The current stream's event batches, the first-token hook before the first. A failure
        (upstream, or a hook's refusal) ends them with `failure` set; nothing is raised."""
        stream = self.stream
        assert stream is not None
        try:
            # the hook first: billing writes the stream's open entry there, so a client never
            # holds tokens of a stream a gateway crash could leave unbilled (docs/billing.md)
            await self.first_token()
            yield stream.first_batch
            async for batch in stream.batches:
                yield batch
        except _UPSTREAM_ERRORS as exc:
            self._broke(stream, exc)
        except GatewayError as exc:
            self._fail(exc)

    async def _parsed(
        self, events: AsyncGenerator[list[bytes], None]
    ) -> AsyncGenerator[dict[str, Any], None]:
        async with contextlib.aclosing(events):
            async for batch in events:
                for event in batch:
                    chunk = await self._answer_chunk(event)
                    if chunk is _ENDED:
                        return
                    if chunk is not None:
                        yield chunk

    async def _answer_chunk(self, event: bytes) -> dict[str, Any] | None:
        """An event's chunk of the answer (None: not a data chunk), its usage handed to the
        hooks; `_ENDED` when it is the engine's error event (the exchange has failed)."""
        chunk = _data_chunk(event)
        if chunk is None:
            return None
        if isinstance(chunk.get("error"), dict) and "choices" not in chunk:
            self._engine_error(chunk)
            return _ENDED
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            await self.hooks.usage(self, usage)
        return chunk

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

    # -- how it ends -------------------------------------------------------------------------
    def _broke(self, stream: Streaming, exc: BaseException) -> None:
        if self.client_gone:
            return  # our own close: `abort` has said what happened
        if self.record.usage is not None:
            return  # the answer was whole; only the engine's end of stream was lost
        self.record.ok = False
        if stream.stalled:
            assert stream.watch is not None
            message, code = STREAM_STALLED.format(stream.watch.idle_s), "upstream_stalled"
        else:
            message, code = STREAM_BROKE, "upstream_stream_broken"
        self.failure = UpstreamError(message, code=code)
        self.hooks.stream_broke(self, exc)

    def _engine_error(self, chunk: dict[str, Any]) -> None:
        """An error event the engine itself sent (its text goes to the log, not the client)."""
        self.record.ok = False
        self.failure = UpstreamError(ENGINE_ERROR, code="upstream_error_event")
        self.hooks.stream_broke(self, orjson.dumps(chunk["error"]).decode()[:500])

    def _fail(self, exc: GatewayError) -> None:
        self.record.ok = False
        self.failure = exc
        if self.stream is not None:
            self.stream.close()  # the engine stops generating what nobody will see

    # -- lifecycle ---------------------------------------------------------------------------
    def abort(self) -> None:
        """The client left: drop the upstream connection, so the engine aborts the request."""
        self.client_gone = True
        self.record.ok = False
        if self.stream is not None:
            self.stream.close()

    async def finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.release()
        self.lease.release()
        try:
            await self.hooks.finish(self)
        finally:
            # let go of the callbacks first: the director's close over this exchange, and a
            # cycle through them would leave the request's whole graph to the cyclic GC
            on_closed, self.on_closed, self._reforward = self.on_closed, None, None
            if on_closed is not None:
                on_closed()


class ClientTooSlow(Exception):
    """The client did not read within the drain deadline: its stream was cut."""


_ENDED: dict[str, Any] = {}
"""`Exchange._answer_chunk`'s answer for the engine's error event (compared by identity)."""


def _data_chunk(event: bytes) -> dict[str, Any] | None:
    """An SSE event's JSON object, or None for what carries no chunk: not a data event,
    `[DONE]` (skipped, not an end: the batches run out, so the stream ends the same way
    whichever network read holds it), malformed JSON, not an object."""
    if not event.startswith(b"data:"):
        return None
    data = event[5:].strip()
    if data == b"[DONE]":
        return None
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None
