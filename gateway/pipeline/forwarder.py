"""The upstream proxy: one attempt at one replica, and the SSE relay.

An attempt either commits (a stream whose first event has arrived, or a non-stream body read
whole) or fails retryably before the client has seen a byte: a connection error, a 5xx, no first
byte within `first_byte_timeout_s`, or a stream that ends before its first event. A 4xx from the
engine is the client's problem and passes through as is. The caller retries retryable failures
on the next replica.

After the commit a stream is watched (`StallWatch`): an engine that sends nothing for
`idle_timeout_s` has its connection closed, so a hung engine costs a client a bounded wait and
a clean error, never a stream that never ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

_JSON = {"content-type": "application/json"}


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


class StallWatch:
    """Closes a response that has sent nothing for `idle_s`.

    Armed at the commit (`start`: before it, the first-byte timeout rules). One timer per idle
    period, not per read: a read only stores the time (`touch`), and the timer, when it fires,
    either closes the response (a pending read then raises) or sleeps again until `idle_s`
    after the last read."""

    __slots__ = ("_handle", "_loop", "idle_s", "last_s", "response", "stalled")

    def __init__(self, response: aiohttp.ClientResponse, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.response = response
        self.idle_s = idle_s
        self.last_s = self._loop.time()
        self.stalled = False
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.last_s = self._loop.time()
        self._handle = self._loop.call_at(self.last_s + self.idle_s, self._check)

    def touch(self) -> None:
        self.last_s = self._loop.time()

    def _check(self) -> None:
        due = self.last_s + self.idle_s
        if self._loop.time() >= due:
            self.stalled = True
            self._handle = None
            self.response.close()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


@dataclass(slots=True)
class Streaming:
    """An open SSE stream whose first batch of events (with a data event) has arrived."""

    response: aiohttp.ClientResponse
    first_batch: list[bytes]
    batches: AsyncIterator[list[bytes]]
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


async def iter_event_batches(
    content: aiohttp.StreamReader, watch: StallWatch | None = None
) -> AsyncIterator[list[bytes]]:
    """SSE events as they arrive: each batch holds the complete events of what the socket
    delivered (each event without its blank-line separator). Nothing is held back but the
    incomplete tail of an event, so the stream stays unbuffered while one network read costs
    one write to the client, whatever the number of events in it. Engines end lines with
    \\n (vLLM, SGLang); a \\r\\n stream is normalised. `watch` hears of every read."""
    tail = b""
    async for data in content.iter_any():
        if watch is not None:
            watch.touch()
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        tail += data
        if b"\n\n" not in tail:
            continue
        *events, tail = tail.split(b"\n\n")
        events = [e for e in events if e]
        if events:
            yield events
    if tail.strip():
        yield [tail.rstrip(b"\n")]


def _is_json(response: aiohttp.ClientResponse) -> bool:
    return response.content_type == "application/json"


class Forwarder:
    """Attempts over the gateway's one shared `aiohttp.ClientSession` (bound by the lifespan).

    `first_byte_timeout_s` bounds an attempt up to its commit (the engine's first event, or
    its whole answer when it does not stream); `idle_timeout_s` bounds each silence after it."""

    def __init__(self, first_byte_timeout_s: float, idle_timeout_s: float) -> None:
        self.session: aiohttp.ClientSession | None = None
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s

    async def attempt(
        self, url: str, payload: bytes, stream: bool, headers: Mapping[str, str] | None = None
    ) -> Passthrough | Complete | Streaming:
        try:
            async with asyncio.timeout(self.first_byte_timeout_s):
                return await self._attempt(url, payload, stream, headers)
        except TimeoutError:
            raise RetryableFailure(
                f"no first byte within {self.first_byte_timeout_s:g} s"
            ) from None

    async def _attempt(
        self, url: str, payload: bytes, stream: bool, headers: Mapping[str, str] | None
    ) -> Passthrough | Complete | Streaming:
        assert self.session is not None, "the lifespan binds the session"
        sent = _JSON if headers is None else {**_JSON, **headers}
        try:
            response = await self.session.post(url, data=payload, headers=sent)
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise RetryableFailure(f"{type(exc).__name__}: {exc}", connection=True) from None
        committed = False
        try:
            if response.status >= 500:
                text = (await response.read())[:200].decode(errors="replace")
                raise RetryableFailure(f"engine answered {response.status}: {text}")
            if response.status >= 400:
                return Passthrough(response.status, await response.read())
            if not stream or _is_json(response):  # asked not to stream, or would not
                try:
                    body = orjson.loads(await response.read())
                except orjson.JSONDecodeError:
                    raise RetryableFailure("engine sent malformed JSON") from None
                if not isinstance(body, dict):
                    raise RetryableFailure("engine sent a non-object JSON body")
                return Complete(body)
            watch = StallWatch(response, self.idle_timeout_s)
            batches = iter_event_batches(response.content, watch)
            try:
                async for first in batches:
                    if any(event.startswith(b"data:") for event in first):
                        committed = True
                        watch.start()
                        return Streaming(response, first, batches, watch)
            finally:
                if not committed:
                    watch.cancel()
            raise RetryableFailure("engine closed the stream before its first event")
        except aiohttp.ClientError as exc:
            raise RetryableFailure(f"{type(exc).__name__}: {exc}") from None
        finally:
            if not committed:
                response.release()
