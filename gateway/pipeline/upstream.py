"""Raw HTTP/1.1 to the engines: one asyncio protocol per connection, llhttp (httptools) parsing.

The relay's hot path is one engine read → one client write. Through aiohttp each read cost a
parser callback into a `StreamReader`, a future, a task step and the generator chain above it;
here the read ends in `data_received`, which hands the body bytes of that read (every HTTP
chunk in it, joined: whatever has arrived, without waiting) to a *sink* synchronously when one is
attached (`splice`), or buffers them for `readany` when none is. No task wakes per chunk.

    engine socket ──recv──▶ UpstreamConnection.data_received ──llhttp──▶ body of this read
                                                              ├─ sink attached: sink(body)
                                                              └─ else: buffer, wake readany()

Invariants:
- one request at a time per connection; a connection goes back to its pool only when its
  response ended whole and both sides keep it alive, else it is closed (`release`);
- buffered body bytes are bounded: past `MAX_BUFFERED_BYTES` the socket stops being read
  (`pause_reading`) until a reader takes them, so a slow consumer backs the engine up through
  TCP instead of growing the gateway's memory; a sink is bounded by its own consumer;
- a failure before the response's headers is a `ConnectionError` (the caller may try another
  replica); after them, reads raise `UpstreamBroke`;
- a response head is at most `max_header_bytes` (else a `HeadersTooLarge` before the
  headers), and `read(limit)` takes a whole body only up to its limit (`BodyTooLarge`);
- a response is parsed by a parser of its own (one per request), and the engine's bytes count
  only while a request is in flight and its response has not ended: a byte that arrives on an
  idle connection, or after the response's end, closes the connection (never reused), and an
  idle connection whose socket is readable (unread bytes, or the engine's FIN) is not taken
  from the pool. Else a stray response, whose length could swallow the next real answer, would
  be read as the answer to the next request on the connection, another tenant's perhaps.
"""

from __future__ import annotations

import asyncio
import functools
import select
import ssl
import time
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.settings import DEFAULT_UPSTREAM_MAX_HEADER_BYTES

KEEPALIVE_S = 4.0
"""How long an idle connection is reused: under uvicorn's default keep-alive of 5 s (vLLM's and
SGLang's servers), so the engine does not close it under a request we are writing."""
MAX_BUFFERED_BYTES = 64 * 1024
"""Body bytes read ahead of a consumer before the socket is paused (asyncio's own high-water)."""

Sink = Callable[[bytes], None]


class UpstreamBroke(Exception):
    """The engine's connection ended, or sent bytes that are not HTTP, mid-response."""


class HeadersTooLarge(ConnectionError):
    """The engine's response head passed the pool's `max_header_bytes` (nothing was relayed)."""


class BodyTooLarge(UpstreamBroke):
    """A body read whole (`read(limit)`) passed its limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the engine's answer is larger than {limit} bytes")
        self.limit = limit


@functools.lru_cache(maxsize=1024)
def _request_start(url: str) -> tuple[tuple[str, int, bool], bytes]:
    """(host, port, tls) of an engine URL and its POST's head up to the content length's
    value, built once per URL: the host's IDNA encoding is a pure-Python codec (~2% of a
    small request's forwarding, py-spy native)."""
    host, port, tls, path = origin(url)
    named = host.encode("idna") if ":" not in host else b"[%s]" % host.encode("ascii")
    start = (
        b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
        b"content-length: " % (path, named, port)
    )
    return (host, port, tls), start


class _Stray(Exception):
    """A second response began on a request's connection: bytes the request never asked for."""


@functools.lru_cache(maxsize=1024)
def origin(url: str) -> tuple[str, int, bool, bytes]:
    """(host, port, tls, path) of an engine URL, parsed once per URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"an engine URL is http:// or https://, not {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, port, tls, path.encode("latin-1")


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to an engine, and the response it is reading (one at a time).

    The response side: `status` and `content_type` once the headers are in, then `readany()`
    (the next bytes of the body, b"" at its end) or `splice(sink)`, `read()` (the rest, whole),
    and `close()` or `release()` at the end."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self._pool = pool
        self._key = key
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)  # a new one per request: `send`
        self._poll: select.poll | None = None
        self.num_requests = 0
        self.idle_since_s = 0.0
        self.lost = False
        self.in_flight = False
        """A request was written and its connection not yet released or closed."""
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = ""
        self._header_name = b""
        self._keep_alive = True
        self._framed = False  # a content-length or chunked body (else it ends at EOF)
        self._headers_done: asyncio.Future[None] | None = None
        self._head_bytes = 0
        self._began = False
        self._bytes_seen = False
        self._pieces: list[bytes] = []
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._spliced: asyncio.Future[None] | None = None
        self._holding_slot = False

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # poll, not select: a busy gateway's descriptors pass 1024
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)
        self._pool.opened(self)

    def data_received(self, data: bytes) -> None:
        if not self.in_flight or self._complete:
            self._stray()  # nobody asked for these bytes: the connection is done
            return
        self._bytes_seen = True
        try:
            if self.status:
                self._parser.feed_data(data)
            else:
                self._feed_head(data)
        except HeadersTooLarge as exc:
            self._failed(UpstreamBroke(str(exc)), exc)
            self._close_transport()
            return
        except httptools.HttpParserError as exc:  # a callback's error is one too
            if not isinstance(exc.__context__, _Stray):
                self._failed(UpstreamBroke(f"the engine sent malformed HTTP: {exc}"))
                self._close_transport()
                return
            self._stray()  # after this response's end: what came before it stands
        if self._pieces:
            pieces = self._pieces
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            sink = self._sink
            if sink is not None:
                sink(body)
            else:
                self._buffer.append(body)
                self._buffered += len(body)
                if self._buffered > MAX_BUFFERED_BYTES and not self._paused:
                    self._paused = True
                    assert self.transport is not None
                    self.transport.pause_reading()
                self._wake()
        if self._complete:
            self._wake()
            self.end_splice()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._pool.forget(self)
        if self._complete:
            return
        if not self._framed and self.status and exc is None:
            self._complete = True  # a body delimited by the end of the connection
            self._keep_alive = False
        else:
            reason = f": {exc}" if exc is not None else ""
            self._failed(UpstreamBroke(f"the engine closed the connection mid-response{reason}"))
        self._wake()
        self.end_splice()

    def _feed_head(self, data: bytes) -> None:
        """Feed bytes while the head is still coming, never more than `max_header_bytes` of it
        (llhttp has no limit of its own)."""
        limit = self._pool.max_header_bytes
        room = limit - self._head_bytes
        self._head_bytes += len(data)
        if len(data) <= room:
            self._parser.feed_data(data)
            return
        self._parser.feed_data(data[:room])
        if not self.status:
            raise HeadersTooLarge(f"the engine sent a response head over {limit} bytes")
        self._parser.feed_data(data[room:])

    # -- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._began:
            raise _Stray  # stops the parser before any byte of it is taken
        self._began = True

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif name == b"content-length" or (
            name == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        waiter = self._headers_done
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        self._complete = True

    # -- internals ---------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _failed(self, exc: BaseException, before_headers: ConnectionError | None = None) -> None:
        if self._error is None:
            self._error = exc
        waiter = self._headers_done
        if waiter is not None and not waiter.done():
            waiter.set_exception(before_headers or ConnectionError(str(exc)))
        self._wake()
        self.end_splice()

    def _close_transport(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _stray(self) -> None:
        """Bytes no request asked for: the connection is closed, never reused."""
        self._keep_alive = False
        if self.transport is not None and not self.transport.is_closing():
            self._pool.num_strays += 1
        self._close_transport()

    def readable(self) -> bool:
        """Bytes (or the engine's FIN) wait unread in the socket: an idle connection that is
        readable is not reused (`UpstreamPool._connection`)."""
        if self._poll is None:
            return False  # not a socket the loop exposes: data_received still guards it
        return bool(self._poll.poll(0))  # ~1.5 µs

    # -- the request -------------------------------------------------------------------------
    async def send(self, head: bytes, payload: bytes) -> None:
        """Write one request and wait for its response's headers (`ConnectionError` if the
        connection ends before them)."""
        assert self.transport is not None
        self.num_requests += 1
        self.in_flight = True
        self._parser = httptools.HttpResponseParser(self)
        self._headers_done = self._loop.create_future()
        if len(payload) < 16384:
            self.transport.write(head + payload)
        else:  # one write(v) with no copy of the payload: a syscall and a wake-up fewer
            self.transport.writelines((head, payload))
        if self.lost:
            raise ConnectionError("the engine closed the connection")
        await self._headers_done

    # -- the response ------------------------------------------------------------------------
    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waits for some); b"": the end."""
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        buffer = self._buffer
        data = buffer[0] if len(buffer) == 1 else b"".join(buffer)
        buffer.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body, whole; past `limit` bytes, `BodyTooLarge` (the caller then
        releases the connection: closed unless the whole response had arrived)."""
        parts = []
        size = 0
        while data := await self.readany():
            size += len(data)
            if limit is not None and size > limit:
                raise BodyTooLarge(limit)
            parts.append(data)
        return b"".join(parts)

    async def read_head(self, size: int) -> bytes:
        """The body's first `size` bytes at most (an error's text for the log); the rest is
        never read (the connection is then closed at its release, not drained)."""
        parts = []
        got = 0
        while got < size and (data := await self.readany()):
            parts.append(data)
            got += len(data)
        return b"".join(parts)[:size]

    async def splice(self, sink: Sink) -> None:
        """Hand every body read to `sink` as it arrives, in `data_received`, until the sink
        calls `end_splice()` or the response ends (whole or not: `readany` then says which).
        Bytes already buffered go to the sink first."""
        if self._buffer:
            self._sink = sink
            sink(b"".join(self._buffer) if len(self._buffer) > 1 else self._buffer[0])
            self._buffer.clear()
            self._buffered = 0
            if self._paused:
                self._paused = False
                assert self.transport is not None
                self.transport.resume_reading()
            if self._sink is None:
                return  # the sink ended the splice already
        if self._complete or self._error is not None:
            self._sink = None
            return
        self._sink = sink
        self._spliced = self._loop.create_future()
        try:
            await self._spliced
        finally:
            self._sink = None
            self._spliced = None

    def end_splice(self) -> None:
        """Stop handing reads to the sink; the next ones are buffered for `readany`."""
        self._sink = None
        spliced = self._spliced
        if spliced is not None and not spliced.done():
            spliced.set_result(None)

    def close(self) -> None:
        """Drop the connection (an engine aborts the request it was answering)."""
        self._keep_alive = False
        self.in_flight = False
        self._close_transport()
        self._pool.done(self, reuse=False)

    def release(self) -> None:
        """The response is over: back to the pool if it ended whole, else closed."""
        self.in_flight = False
        reuse = self._complete and self._error is None and self._keep_alive and not self.lost
        if not reuse:
            self._close_transport()
        self._pool.done(self, reuse=reuse)


class UpstreamPool:
    """Keep-alive connections per engine origin, at most `max_connections` in use at once.

    Idle connections are reused newest first and dropped after `KEEPALIVE_S`. A reused
    connection that ends before any byte of its response (the engine closed it while we wrote)
    is replaced once by a new one; any other failure is the caller's."""

    def __init__(
        self,
        max_connections: int,
        connect_timeout_s: float,
        max_header_bytes: int = DEFAULT_UPSTREAM_MAX_HEADER_BYTES,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self._slots: asyncio.Semaphore | None = None
        self._idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}
        self.connections: set[UpstreamConnection] = set()
        """Every open connection, idle or in use."""
        self.num_strays = 0
        """Connections dropped for bytes no request asked for, or found readable when idle."""
        self._tls: ssl.SSLContext | None = None
        self.on_peer_closed: Callable[[tuple[str, int, bool]], None] | None = None
        """Called with an engine's (host, port, tls) when it ended a keep-alive connection it
        had let us keep (idle, younger than `KEEPALIVE_S`, or reset as we reused it): the
        engine may have restarted (`gateway.fleet.replicas`, "Suspicion")."""

    async def post(
        self, url: str, payload: bytes, headers: Mapping[str, str] | None = None
    ) -> UpstreamConnection:
        """POST `payload` as JSON to `url`; returns once the response's headers are in."""
        key, start = _request_start(url)
        head = [b"%b%d\r\n" % (start, len(payload))]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"a header with a line break: {name!r}")
            head.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        head.append(b"\r\n")
        request = b"".join(head)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        await self._slots.acquire()
        try:
            for _ in range(2):
                conn = await self._connection(key)
                conn._holding_slot = True
                try:
                    await conn.send(request, payload)
                    return conn
                except ConnectionError:
                    conn._holding_slot = False
                    conn._close_transport()
                    if conn.num_requests > 1 and not conn._bytes_seen:
                        self._peer_closed(conn._key)  # the engine may have restarted
                        continue  # a stale keep-alive connection: once more on a new one
                    raise
                except BaseException:
                    conn._holding_slot = False
                    conn._close_transport()
                    raise
            raise ConnectionError("the engine closed two connections in a row")
        except BaseException:
            self._slots.release()
            raise

    async def _connection(self, key: tuple[str, int, bool]) -> UpstreamConnection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since_s < KEEPALIVE_S:
                if not conn.readable():
                    conn._reset()
                    return conn
                self.num_strays += 1  # unread bytes (or the engine's FIN) on an idle one
            conn._close_transport()
        host, port, tls = key
        loop = asyncio.get_running_loop()
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, key),
                    host,
                    port,
                    ssl=self._tls if tls else None,
                )
        except TimeoutError:
            raise ConnectionError(
                f"no connection to {host}:{port} within {self.connect_timeout_s:g} s"
            ) from None
        return conn

    def done(self, conn: UpstreamConnection, reuse: bool) -> None:
        if conn._holding_slot:
            conn._holding_slot = False
            assert self._slots is not None
            self._slots.release()
        if reuse:
            conn.idle_since_s = time.monotonic()
            self._idle.setdefault(conn._key, []).append(conn)

    def opened(self, conn: UpstreamConnection) -> None:
        self.connections.add(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        """A connection ended: it is no longer idle (its slot, if in use, is freed by `done`).
        An idle one the engine ended before its keep-alive ran out is reported."""
        self.connections.discard(conn)
        idle = self._idle.get(conn._key)
        if idle and conn in idle:
            idle.remove(conn)
            if time.monotonic() - conn.idle_since_s < KEEPALIVE_S:
                self._peer_closed(conn._key)

    def _peer_closed(self, key: tuple[str, int, bool]) -> None:
        if self.on_peer_closed is not None:
            self.on_peer_closed(key)

    def close(self) -> None:
        for conn in list(self.connections):
            conn._close_transport()
        self._idle.clear()
