"""The ASGI app uvicorn serves: the completion routes dispatched straight to their handlers,
everything else through FastAPI, each HTTP request counted by route and status.

The last resort lives here too: an exception no handler mapped (a bug) is logged with its
traceback under a request id, and the client gets a 500 in its API's error shape naming only
that id (`gateway.api.errors.report_internal`); after a response has started it can only be
logged, and the connection ends.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.api.errors import report_internal, to_anthropic_http, to_http
from gateway.errors import GatewayError, NoSuchRoute
from gateway.observability.logs import log_refusal
from gateway.observability.metrics import RequestMetrics

Handler = Callable[[Request], Awaitable[Response]]
ANTHROPIC_PATH = "/v1/messages"


def error_response(path: str, err: GatewayError) -> Response:
    """`err` in the shape of the API at `path`: Anthropic's under /v1/messages, else OpenAI's."""
    anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
    return to_anthropic_http(err) if anthropic else to_http(err)


def internal_error_response(path: str, exc: BaseException) -> Response:
    """The 500 an unexpected exception becomes, in the shape of the API at `path`."""
    return error_response(path, report_internal(exc, path))


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """The framework's own 404 / 405 (an unknown path, a wrong method), in the API's shape."""
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path
    if exc.status_code not in (404, 405):
        err = GatewayError(str(exc.detail))
        err.status = exc.status_code
        return error_response(path, err)
    allow = (exc.headers or {}).get("Allow")
    return error_response(path, NoSuchRoute(exc.status_code, request.method, path, allow))


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """FastAPI's handler of last resort (its routes: billing, models, health)."""
    return internal_error_response(request.url.path, exc)


class StatusSend:
    """The server's `send`, noting the response's status as it starts (None: not yet).

    `raw` is the server's own `send`: a streaming response sends its body messages there,
    past this layer, once it has started (a frame less per relayed chunk, where the relay's
    budget is a few µs).

    A response of known length (a `content-length` header: every JSON answer and error) is
    held at its start and goes out with its body in one socket write (`send_whole`): uvicorn
    writes the head and the body apart, two `write` calls and two wake-ups of the client for
    each small answer."""

    __slots__ = ("_start", "raw", "status")

    def __init__(self, raw: Send) -> None:
        self.raw = raw
        self.status: int | None = None
        self._start: Message | None = None

    async def __call__(self, message: Message) -> None:
        start = self._start
        if start is not None:
            self._start = None
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await send_whole(self.raw, start, message)
                return
            await self.raw(start)
        elif message["type"] == "http.response.start":
            self.status = message["status"]
            if _has_length(message):
                self._start = message
                return
        await self.raw(message)


def _has_length(start: Message) -> bool:
    return any(name == b"content-length" for name, _ in start.get("headers", ()))


class _Gathered:
    """What uvicorn writes for one response, kept for one `write` (`send_whole`); a close it
    asks for (a response without keep-alive) is kept for after that write."""

    __slots__ = ("closing", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closing = True


def _gatherable(send: Send) -> RequestResponseCycle | None:
    """uvicorn's httptools cycle behind `send` when a response's start can be gathered into
    the writes after it (`send_whole`, `start_chunked`): nothing sent yet and the client
    neither gone nor paused (uvicorn would wait there: nothing to gather meanwhile)."""
    cycle = getattr(send, "__self__", None)
    if (
        not isinstance(cycle, RequestResponseCycle)
        or cycle.response_started
        or cycle.disconnected
        or cycle.flow.write_paused
    ):
        return None
    return cycle


async def send_whole(send: Send, start: Message, body: Message) -> None:
    """A response's start and its only body message through uvicorn's httptools `send`, its
    bytes in one write to the client's transport. uvicorn's `send` still does everything else
    it does (headers checked, keep-alive, content-length, the next pipelined request), so its
    state of the response stays its own. Under any other server, or when the connection is
    paused or gone, the two messages simply go through `send`."""
    cycle = _gatherable(send)
    if cycle is None:
        await send(start)
        await send(body)
        return
    transport = cycle.transport
    gathered = _Gathered()
    cycle.transport = gathered  # type: ignore[assignment]
    try:
        await send(start)  # neither waits: the connection is not paused, nothing is written
        await send(body)
    finally:
        cycle.transport = transport
        if gathered.parts:
            transport.write(b"".join(gathered.parts))
        if gathered.closing:
            transport.close()


def raw_send(send: Send) -> Send:
    """The server's own `send` under a `StatusSend` (for body messages after the start)."""
    return send.raw if isinstance(send, StatusSend) else send


class ChunkedOut:
    """The client's connection under uvicorn's httptools protocol, written to directly: each
    write one HTTP chunk (`%x\\r\\n` body `\\r\\n`, what uvicorn's own `send` writes), with
    uvicorn's flow control (`paused`, `drain`) and its view of a disconnect (nothing is written
    after one). The response's start and its end still go through `send`, so uvicorn's state
    of the response stays its own. `head`: the start's bytes, held back by `start_chunked`, go
    out with the first chunk in one write (or alone at `flush`)."""

    __slots__ = ("_cycle", "_flow", "_head", "_transport")

    def __init__(self, cycle: RequestResponseCycle, head: bytes = b"") -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport
        self._head = head

    @property
    def paused(self) -> bool:
        return self._flow.write_paused

    def write(self, data: bytes) -> None:
        if not self._cycle.disconnected:
            head, self._head = self._head, b""
            self._transport.write(b"%b%x\r\n%b\r\n" % (head, len(data), data))

    def flush(self) -> None:
        """The held start, written if no chunk took it (before anything else is sent)."""
        head, self._head = self._head, b""
        if head and not self._cycle.disconnected:
            self._transport.write(head)

    async def drain(self) -> None:
        await self._flow.drain()

    def cut(self) -> None:
        """Drop the client's connection now, its unsent bytes with it (uvicorn then sees a
        disconnect: `drain` returns and nothing more is written)."""
        self._transport.abort()


def chunked_out(send: Send, head: bytes = b"") -> ChunkedOut | None:
    """A direct writer for a started, chunked response served by uvicorn's httptools protocol
    (None otherwise, e.g. under h11: the caller then sends body messages through `send`);
    `head`: the start's bytes it writes first (`start_chunked`)."""
    cycle = getattr(raw_send(send), "__self__", None)
    if (
        isinstance(cycle, RequestResponseCycle)
        and cycle.chunked_encoding
        and (cycle.response_started and not cycle.response_complete)
    ):
        return ChunkedOut(cycle, head)
    return None


async def start_chunked(send: Send, start: Message) -> ChunkedOut | None:
    """Send a chunked response's `start` through `send` and return its direct writer
    (`chunked_out`), the start's bytes held for the writer's first chunk: the head and the
    first events in one write to the client instead of two (uvicorn writes the head at once).
    The caller `flush`es the writer before it sends anything else through `send`. Where
    `chunked_out` gives no writer (another server, a paused or gone client, a body not
    chunked), the start is sent as it is."""
    cycle = _gatherable(raw_send(send))
    if cycle is None:
        await send(start)
        return chunked_out(send)
    transport = cycle.transport
    gathered = _Gathered()
    cycle.transport = gathered  # type: ignore[assignment]
    try:
        await send(start)  # does not wait: the connection is not paused, nothing is written
    finally:
        cycle.transport = transport
    head = b"".join(gathered.parts)
    out = None if gathered.closing else chunked_out(send, head)
    if out is None:  # no writer to hold it for
        transport.write(head)
        if gathered.closing:
            transport.close()
    return out


def client_paused(send: Send) -> bool:
    """Whether uvicorn's httptools protocol holds the client's writes back (its buffer is over
    the high-water mark): its `send` would wait for the client (False under another server)."""
    cycle = getattr(raw_send(send), "__self__", None)
    return isinstance(cycle, RequestResponseCycle) and cycle.flow.write_paused


def cut_client(send: Send) -> None:
    """Drop the client's connection under uvicorn's httptools protocol (see `ChunkedOut.cut`)."""
    cycle = getattr(raw_send(send), "__self__", None)
    if isinstance(cycle, RequestResponseCycle):
        cycle.transport.abort()


def body_arrived(receive: Receive) -> bool:
    """Whether uvicorn's httptools protocol already holds the request's whole body, so that
    `receive` hands it over at once: nothing to wait for, so no deadline to arm (a small
    request's body arrives with its headers)."""
    cycle = getattr(receive, "__self__", None)
    return (
        isinstance(cycle, RequestResponseCycle)
        and not cycle.more_body
        and not (cycle.disconnected or cycle.response_complete)
    )


class GatewayASGI:
    """The completion routes (OpenAI's two and Anthropic's /v1/messages) go straight to their
    handlers (the same functions FastAPI routes to), everything else through FastAPI.

    FastAPI's middleware stack cost ~0.15 ms of CPU per proxied request here, about a fifth of
    the gateway's whole budget, and the completion handlers parse their bodies themselves
    anyway. The routes stay declared in FastAPI, so the OpenAPI document describes them.
    """

    def __init__(self, api: FastAPI, hot: dict[str, Handler]) -> None:
        self.api = api
        self.state = api.state
        self._hot = hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        await self.serve(scope, receive, StatusSend(send))

    async def serve(self, scope: Scope, receive: Receive, send: StatusSend) -> None:
        try:
            handler = self._hot.get(scope["path"]) if scope["method"] == "POST" else None
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
            else:
                await self.api(scope, receive, send)
        except Exception as exc:
            response = internal_error_response(scope["path"], exc)  # logs it (once)
            if send.status is None:
                await response(scope, receive, send)


class MeteredASGI(GatewayASGI):
    """The gateway's ASGI app, counting each HTTP request by route and status and timing it
    to its last byte (a stream's included)."""

    def __init__(self, api: FastAPI, hot: dict[str, Handler], metrics: RequestMetrics) -> None:
        super().__init__(api, hot)
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        started = time.perf_counter()
        tracked = StatusSend(send)
        try:
            await self.serve(scope, receive, tracked)
        finally:
            # 500: what the client sees if the app fails before answering
            status = 500 if tracked.status is None else tracked.status
            seconds = time.perf_counter() - started
            if status >= 400:  # logged before counted: a reader of the count sees the line out
                log_refusal(scope["method"], scope["path"], status, seconds)
            self.metrics.observe_http(scope["path"], status, seconds)
