"""Reading a request body: what every HTTP front end does before it parses its own shape.

`read_body` holds the limits a body meets while it arrives, so no client can make the gateway
buffer or wait without bound: at most `max_body_bytes` (a declared Content-Length over it is
refused before a byte is read; a chunked body once what arrived passes it: 413), within
`body_read_timeout_s` for the whole body (408), and a client that leaves meanwhile is a
`ClientGone` (counted as 499, never a 500). `load_json_object` then parses it: a JSON object,
nested at most `MAX_JSON_DEPTH` levels (400).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from cachemap.rendering import MAX_JSON_DEPTH, too_deep
from gateway.api.asgi import body_arrived
from gateway.errors import (
    ClientGone,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)


def client_left(request: Request) -> Callable[[], Awaitable[None]]:
    """Once the body is read: a wait that returns when the client disconnects (the server's
    next message is then `http.disconnect`), for the pipeline to race while a request waits
    for room (`gateway.pipeline.flow`). Called only then: nothing runs on the hot path."""
    receive = request.receive

    async def left() -> None:
        while (await receive())["type"] != "http.disconnect":  # bounded: the body was read
            pass

    return left


WATCH_AFTER_S = 0.1
"""How long an answer is awaited before the client's connection is watched (`ClientWatch`):
most answers commit sooner, and they pay one timer, not a task."""


class ClientWatch:
    """While the answer is awaited (the route, the engine's first byte, a whole non-streamed
    answer): a client that disconnects cancels the work, so its engine request is aborted
    (the upstream connection closes, as vLLM's own front end aborts on a disconnect) and its
    replica's lease ends, instead of the engine computing an answer nobody reads. The block
    then raises `ClientGone` (499, counted, never sent).

    The connection is watched only once the answer has taken `WATCH_AFTER_S` (a timer, then a
    task on `left`): a client that left sooner is seen at once then, so the engine computes at
    most that long for nobody. A streamed answer is watched by its relay once it commits."""

    __slots__ = ("_left", "_task", "_timer", "_watcher", "left")

    def __init__(
        self, left: Callable[[], Awaitable[object]] | None, after_s: float = WATCH_AFTER_S
    ) -> None:
        self._left = left
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Future[None] | None = None
        self.left = False
        """The client disconnected and the work was cancelled for it."""
        if left is not None:
            self._task = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(after_s, self._watch)

    def _watch(self) -> None:
        self._timer = None
        self._watcher = asyncio.ensure_future(self._until_left())

    async def _until_left(self) -> None:
        assert self._left is not None and self._task is not None
        await self._left()
        # the task is suspended inside the block (this runs only while it is): the
        # cancellation is delivered there, at its current await
        self.left = True
        self._task.cancel("the client disconnected")

    def __enter__(self) -> ClientWatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            # let go of it: its CancelledError's traceback holds `_until_left`'s frame, which
            # holds this watch; kept, the pair was a cycle (~17 objects) for the collector
            self._watcher = None
        if self.left:
            assert self._task is not None
            self._task.uncancel()
            raise ClientGone("the client disconnected before its answer") from None


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, within the limits in the module docstring."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("content-length must be a number of bytes")
        if int(declared) > max_bytes:
            raise _too_large(int(declared), max_bytes)
    if body_arrived(request.receive):  # one message, no wait: no timer to arm and cancel
        message = await request.receive()
        whole: bytes = message.get("body", b"")
        if len(whole) > max_bytes:
            raise _too_large(len(whole), max_bytes)
        return whole
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(size, max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes read)"
        ) from None
    except ClientDisconnect:
        raise ClientGone("the client disconnected before sending its whole body") from None
    return b"".join(chunks)


def check_json_media_type(content_type: str | None) -> None:
    """Bodies are JSON: one declared as anything else (text/plain, a form) is a 415. A body with
    no Content-Type at all is read as JSON (some HTTP clients send none)."""
    if content_type is None:
        return
    media = content_type.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(media or content_type)


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is {size} bytes or more; this gateway accepts at most {limit}"
    )


def load_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):  # orjson's own guard, at 1,024 levels
            raise InvalidRequest(
                f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
            ) from None
        raise InvalidRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    # not a count of the raw brackets first: two `bytes.count` passes cost ~50 µs on an 80 KB
    # body (a byte at a time, not memchr), where `too_deep` answers a body of few containers
    # in ~1 µs and any other in ~20
    if too_deep(body):
        raise InvalidRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def take_priority(body: dict[str, Any]) -> int | None:
    """Pop a request's `priority` (flow control's band, vLLM's field name; the engine never
    sees it): an integer, else a 400 naming the field. The tenant's range is checked at
    admission (`gateway.pipeline.flow.request_priority`). Every HTTP front end takes it."""
    if "priority" not in body:
        return None
    value = body.pop("priority")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(
            "'priority' must be an integer (lower is served first)", param="priority"
        )
    return value
