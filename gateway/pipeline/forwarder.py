"""The upstream proxy: one attempt at one replica, and the SSE relay.

An attempt either commits (a non-stream body read whole, or a stream whose first event has
arrived) or fails retryably before the client has seen a byte: a connection error, a timeout, a
5xx, or a stream that ends before its first event. A 4xx from the engine is the client's
problem and passes through as is. The caller retries retryable failures on the next replica.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
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
    """A whole non-streamed answer."""

    body: dict[str, Any]


@dataclass(slots=True)
class Streaming:
    """An open SSE stream whose first batch of events (with a data event) has arrived."""

    response: aiohttp.ClientResponse
    first_batch: list[bytes]
    batches: AsyncIterator[list[bytes]]


async def iter_event_batches(content: aiohttp.StreamReader) -> AsyncIterator[list[bytes]]:
    """SSE events as they arrive: each batch holds the complete events of what the socket
    delivered (each event without its blank-line separator). Nothing is held back but the
    incomplete tail of an event, so the stream stays unbuffered while one network read costs
    one write to the client, whatever the number of events in it. Engines end lines with
    \\n (vLLM, SGLang); a \\r\\n stream is normalised."""
    tail = b""
    async for data in content.iter_any():
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


class Forwarder:
    """Attempts over the gateway's one shared `aiohttp.ClientSession` (bound by the lifespan)."""

    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None

    async def attempt(
        self, url: str, payload: bytes, stream: bool, headers: Mapping[str, str] | None = None
    ) -> Passthrough | Complete | Streaming:
        assert self.session is not None, "the lifespan binds the session"
        sent = _JSON if headers is None else {**_JSON, **headers}
        try:
            response = await self.session.post(url, data=payload, headers=sent)
        except (aiohttp.ClientConnectionError, TimeoutError, OSError) as exc:
            raise RetryableFailure(f"{type(exc).__name__}: {exc}", connection=True) from None
        committed = False
        try:
            if response.status >= 500:
                text = (await response.read())[:200].decode(errors="replace")
                raise RetryableFailure(f"engine answered {response.status}: {text}")
            if response.status >= 400:
                return Passthrough(response.status, await response.read())
            if not stream:
                try:
                    body = orjson.loads(await response.read())
                except orjson.JSONDecodeError:
                    raise RetryableFailure("engine sent malformed JSON") from None
                if not isinstance(body, dict):
                    raise RetryableFailure("engine sent a non-object JSON body")
                return Complete(body)
            batches = iter_event_batches(response.content)
            async for first in batches:
                if any(event.startswith(b"data:") for event in first):
                    committed = True
                    return Streaming(response, first, batches)
            raise RetryableFailure("engine closed the stream before its first event")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RetryableFailure(f"{type(exc).__name__}: {exc}") from None
        finally:
            if not committed:
                response.release()
