"""The upstream proxy: one attempt at one replica, and the SSE relay.

An attempt either commits (a stream whose first event has arrived, or a non-stream body read
whole) or fails retryably before the client has seen a byte: a connection error, a 5xx, no first
byte within `first_byte_timeout_s`, or a stream that ends before its first event. A 4xx from the
engine is the client's problem and passes through as is. The caller retries retryable failures
on the next replica.

After the commit a stream is watched (`StallWatch`): an engine that sends nothing for
`idle_timeout_s` has its connection closed, so a hung engine costs a client a bounded wait and
a clean error, never a stream that never ends.

Attempts go over raw keep-alive connections (`gateway.pipeline.upstream`), so a committed
stream can be spliced to the client (`EventReader.splice`): each engine read is written to the
client's transport in the read's own callback, with no task step per chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

from gateway.errors import too_large
from gateway.pipeline.upstream import (
    BodyTooLarge,
    HeadersTooLarge,
    UpstreamBroke,
    UpstreamConnection,
    UpstreamPool,
)
from gateway.settings import DEFAULT_UPSTREAM_MAX_BODY_BYTES

ERROR_TEXT_BYTES = 200
"""What of a 5xx's body is read, for the log; the rest is never read (the connection closes)."""


class EventTooLarge(UpstreamBroke):
    """An SSE event longer than the reader holds back (`EventReader.max_event_bytes`)."""


class RetryableFailure(Exception):
    """The attempt failed before the client saw a byte.

    `connection`: the replica could not be reached at all."""

    def __init__(self, message: str, *, connection: bool = False) -> None:
        super().__init__(message)
        self.connection = connection


@dataclass(slots=True)
class Passthrough:
    """An engine's 4xx answer, relayed unchanged."""

    status: int
    body: bytes


@dataclass(slots=True)
class Complete:
    """A whole non-streamed answer (the engine was not asked to stream, or did not)."""

    body: dict[str, Any]


CR = 0x0D
"""A carriage return, asked of a read as an int (`CR in data`): CPython 3.11's `bytes in bytes`
first tries its argument as an integer, and for a bytes argument builds and clears a formatted
TypeError before it searches, ~0.4 µs of a relayed chunk's ~2 µs of Python (perf of the relay's
path alone). An int is a plain memchr."""
USAGE = b'"usage"'
"""The text only an engine's usage events hold, looked for with `data.find(USAGE) >= 0` (no
TypeError built, as `CR`'s note says)."""


class Closable(Protocol):
    def close(self) -> None: ...


class ClientOut(Protocol):
    """The client's side of a spliced relay: bytes written straight to its connection (framed
    by the front end), `paused` while the client's socket buffer is over its high-water mark,
    `drain()` until it is not, `cut()` to drop the connection (a client too slow to read)."""

    @property
    def paused(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def cut(self) -> None: ...


class StallWatch:
    """An attempt's one timer: its first-byte deadline until the commit, then its idle watch.

    Before the commit (`start`), an attempt that has not committed within `first_byte_s` has
    its task cancelled (`expired`: `Forwarder.attempt` turns that cancellation into a
    retryable failure, as `asyncio.timeout` would). After it, a response that has sent nothing
    for `idle_s` is closed (a pending read then raises).

    One timer per attempt, not one per deadline: it is armed once, at `min(first_byte_s,
    idle_s)` after the attempt starts, and never re-armed at the commit (py-spy: arming
    `asyncio.timeout` and then the idle timer was ~12% of a small request's routing and
    forwarding). It may fire early, never late: when it fires it either acts or sleeps again
    until the deadline then due (the first byte's, or `idle_s` after the last read, which is
    never before `idle_s` after the attempt's start); before the commit it sleeps at most
    `idle_s`, so a commit while it sleeps is watched from then. A read only stores the time
    (`touch`)."""

    __slots__ = (
        "_cancelling",
        "_first_byte_due_s",
        "_handle",
        "_loop",
        "_task",
        "committed",
        "expired",
        "idle_s",
        "last_s",
        "response",
        "stalled",
    )

    def __init__(
        self,
        response: Closable | None,
        idle_s: float,
        first_byte_s: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        task: asyncio.Task[Any] | None = None,
    ) -> None:
        """`loop` and `task`: the running ones when the caller knows them (each asked of
        asyncio is a `getpid` call)."""
        self._loop = loop or asyncio.get_running_loop()
        self.response = response
        self.idle_s = idle_s
        self.last_s = self._loop.time()
        self.stalled = False
        self.expired = False
        self.committed = False
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._first_byte_due_s = 0.0
        if first_byte_s is not None:  # armed now, for the attempt's first byte
            self._task = task or asyncio.current_task()
            assert self._task is not None, "an attempt runs in a task"
            self._cancelling = self._task.cancelling()
            self._first_byte_due_s = self.last_s + first_byte_s
            self._handle = self._loop.call_at(self.last_s + min(first_byte_s, idle_s), self._check)

    def start(self, response: Closable | None = None) -> None:
        """The commit: from now on the idle timeout rules (the armed timer stays)."""
        if response is not None:
            self.response = response
        self.committed = True
        self.last_s = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self.last_s + self.idle_s, self._check)

    def touch(self) -> None:
        self.last_s = self._loop.time()

    def ours(self) -> bool:
        """A cancellation the attempt's task is seeing came from the first-byte deadline (not
        from outside): it is uncounted, like `asyncio.timeout`'s."""
        task = self._task
        return self.expired and task is not None and task.uncancel() <= self._cancelling

    def _check(self) -> None:
        now = self._loop.time()
        if not self.committed:
            if now >= self._first_byte_due_s:
                self.expired = True
                self._handle = None
                assert self._task is not None
                self._task.cancel()
            else:  # no later than `idle_s` from now: a commit meanwhile is watched in time
                self._handle = self._loop.call_at(
                    min(self._first_byte_due_s, now + self.idle_s), self._check
                )
            return
        due = self.last_s + self.idle_s
        if now >= due:
            self.stalled = True
            self._handle = None
            assert self.response is not None
            self.response.close()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class EventReader:
    """SSE events off an engine's response as they arrive, in either of two shapes that share
    one held-back tail (so a consumer may switch from the first to the second mid-stream):

    - `batches()`: the complete events of each network read, each without its blank-line
      separator (what a consumer that parses events wants);
    - `blocks()`: the same reads as bytes, whole events with their separators, not split at
      all (the relay's pass-through: one slice at most per read, no list, no join).

    - `splice(out)`: the same blocks written to the client as they arrive, in the connection's
      read callback, until a read holds `"usage"` (or the client's buffer is full): that read
      is then `held` for `block()`, the slow path that may await the usage hooks.

    Nothing is held back but the incomplete tail of an event, so the stream stays unbuffered
    while one network read costs one write to the client, whatever the number of events in it.
    Engines end lines with \\n (vLLM, SGLang); a \\r\\n stream is normalised. `watch` hears of
    every read."""

    __slots__ = ("content", "held", "max_event_bytes", "out", "tail", "watch")

    def __init__(
        self,
        content: UpstreamConnection,
        watch: StallWatch | None = None,
        max_event_bytes: int = DEFAULT_UPSTREAM_MAX_BODY_BYTES,
    ) -> None:
        self.content = content
        self.watch = watch
        self.max_event_bytes = max_event_bytes
        """The longest event held back whole (`EventTooLarge` past it: an engine that never
        ends its event would grow the tail for ever)."""
        self.tail = b""
        self.held = b""
        self.out: ClientOut | None = None

    async def _read(self) -> bytes:
        """What the socket delivered next, with the tail before it (b"": the stream ended)."""
        if self.held:  # a spliced read the sink left for this path (its tail already in it)
            data, self.held = self.held, b""
            return data
        data = await self.content.readany()
        return self._arrived(data) if data else b""

    def _arrived(self, data: bytes) -> bytes:
        """A read as the events see it: the idle watch touched, CRLF folded, the tail first."""
        if self.watch is not None:
            self.watch.touch()
        if CR in data:
            data = data.replace(b"\r\n", b"\n")
        if self.tail:
            data, self.tail = self.tail + data, b""
        return data

    def _whole(self, data: bytes) -> bytes:
        """The read's whole events, the rest kept as the tail (b"": none is whole yet)."""
        if data.endswith(b"\n\n"):
            return data
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._hold(data)
            return b""
        data, tail = data[:cut], data[cut:]
        self._hold(tail)
        return data

    def _hold(self, tail: bytes) -> None:
        if len(tail) > self.max_event_bytes:
            raise EventTooLarge(f"the engine sent an event over {self.max_event_bytes} bytes")
        self.tail = tail

    def _last(self) -> bytes:
        """The stream's unterminated last event, if any (without its separator)."""
        tail, self.tail = self.tail, b""
        return tail.rstrip(b"\n") if tail.strip() else b""

    async def batches(self) -> AsyncGenerator[list[bytes], None]:
        while data := await self._read():
            *events, tail = data.split(b"\n\n")
            self._hold(tail)
            events = [e for e in events if e]
            if events:
                yield events
        if last := self._last():
            yield [last]

    async def blocks(self) -> AsyncGenerator[bytes, None]:
        while block := await self.block():
            yield block

    async def block(self) -> bytes:
        """The next read's whole events (b"": the stream ended; its unterminated last event,
        if any, comes just before that)."""
        while data := await self._read():
            if whole := self._whole(data):
                return whole
        if last := self._last():
            return last + b"\n\n"
        return b""

    async def splice(self, out: ClientOut) -> None:
        """Write whole events to `out` as each read arrives, until a read must take the slow
        path (`held`: it holds `"usage"`, or `out` is paused) or the stream ends. The caller
        then goes on with `block()`."""
        self.out = out
        try:
            await self.content.splice(self._sink)
        finally:
            self.out = None

    def _sink(self, data: bytes) -> None:
        """One read, in the connection's callback (no await here: see `splice`)."""
        out = self.out
        assert out is not None
        data = self._arrived(data)
        if data.find(USAGE) >= 0 or out.paused or len(data) > self.max_event_bytes:
            self.held = data  # the slow path: it may await, or raise (`_whole`)
            self.content.end_splice()
            return
        if whole := self._whole(data):
            out.write(whole)


@dataclass(slots=True)
class Streaming:
    """An open SSE stream whose first batch of events (with a data event) has arrived.

    `batches` goes on where `first_batch` ended; `reader.blocks()` does too, for a relay that
    passes bytes through (the two share the reader's tail: use one or the other)."""

    response: UpstreamConnection
    first_batch: list[bytes]
    batches: AsyncGenerator[list[bytes], None]
    reader: EventReader
    watch: StallWatch | None = field(default=None)

    @property
    def stalled(self) -> bool:
        """The stream ended because the engine sent nothing for the idle timeout."""
        return self.watch is not None and self.watch.stalled

    def close(self) -> None:
        """Drop the connection (the engine aborts the request)."""
        if self.watch is not None:
            self.watch.cancel()
        self.response.close()

    def release(self) -> None:
        """The exchange is over: an unfinished response closes its connection."""
        if self.watch is not None:
            self.watch.cancel()
        self.response.release()


def _is_json(response: UpstreamConnection) -> bool:
    return response.content_type == "application/json"


class Forwarder:
    """Attempts over the gateway's `UpstreamPool` (bound by the lifespan, with the shared
    `aiohttp.ClientSession` that probes and scrapes use).

    `first_byte_timeout_s` bounds an attempt up to its commit (the engine's first event, or
    its whole answer when it does not stream); `idle_timeout_s` bounds each silence after it."""

    def __init__(
        self,
        first_byte_timeout_s: float,
        idle_timeout_s: float,
        max_body_bytes: int = DEFAULT_UPSTREAM_MAX_BODY_BYTES,
    ) -> None:
        self.session: aiohttp.ClientSession | None = None
        self.pool: UpstreamPool | None = None
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of the last attempt: its current task asked of it directly (asking
        asyncio for the running loop, or the task without a loop, is a `getpid` syscall in
        CPython 3.11: two an attempt, ~1% of a small request's CPU, py-spy native)."""
        self.max_body_bytes = max_body_bytes
        """A body read whole (a 4xx, a non-streamed answer) over it is a 502, not retried: the
        answer's size is the request's doing, not the replica's."""

    async def attempt(
        self, url: str, payload: bytes, stream: bool, headers: Mapping[str, str] | None = None
    ) -> Passthrough | Complete | Streaming:
        loop = self._loop
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:  # the first attempt, or one on another loop than the last
            loop = self._loop = asyncio.get_running_loop()
            task = asyncio.current_task(loop)
        watch = StallWatch(None, self.idle_timeout_s, self.first_byte_timeout_s, loop, task)
        try:
            return await self._attempt(url, payload, stream, headers, watch)
        except asyncio.CancelledError:
            if watch.ours():
                raise RetryableFailure(
                    f"no first byte within {self.first_byte_timeout_s:g} s"
                ) from None
            raise
        finally:
            if not watch.committed:
                watch.cancel()

    async def _attempt(
        self,
        url: str,
        payload: bytes,
        stream: bool,
        headers: Mapping[str, str] | None,
        watch: StallWatch,
    ) -> Passthrough | Complete | Streaming:
        assert self.pool is not None, "the lifespan binds the pool"
        try:
            response = await self.pool.post(url, payload, headers)
        except HeadersTooLarge as exc:  # it answered, badly: try another, it is not down
            raise RetryableFailure(str(exc)) from None
        except OSError as exc:
            raise RetryableFailure(f"{type(exc).__name__}: {exc}", connection=True) from None
        committed = False
        try:
            if response.status >= 500:
                text = (await response.read_head(ERROR_TEXT_BYTES)).decode(errors="replace")
                raise RetryableFailure(f"engine answered {response.status}: {text}")
            if response.status >= 400:
                return Passthrough(response.status, await response.read(self.max_body_bytes))
            if not stream or _is_json(response):  # asked not to stream, or would not
                try:
                    body = orjson.loads(await response.read(self.max_body_bytes))
                except orjson.JSONDecodeError:
                    raise RetryableFailure("engine sent malformed JSON") from None
                if not isinstance(body, dict):
                    raise RetryableFailure("engine sent a non-object JSON body")
                return Complete(body)
            reader = EventReader(response, watch, self.max_body_bytes)
            batches = reader.batches()
            async for first in batches:
                if any(event.startswith(b"data:") for event in first):
                    committed = True
                    watch.start(response)
                    return Streaming(response, first, batches, reader, watch)
            raise RetryableFailure("engine closed the stream before its first event")
        except BodyTooLarge as exc:
            raise too_large(exc.limit) from None
        except UpstreamBroke as exc:
            raise RetryableFailure(f"{type(exc).__name__}: {exc}") from None
        finally:
            if not committed:
                response.release()
