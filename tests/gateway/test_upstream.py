"""The raw engine connections (`gateway.pipeline.upstream`) against real loopback servers that
answer with exact bytes: keep-alive reuse, a stale connection replaced, every HTTP chunk of one
network read handed over as one block, a body delimited by the connection's end, a cut or
malformed response, and buffering bounded when nobody reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.pipeline.forwarder import EventReader
from gateway.pipeline.upstream import (
    MAX_BUFFERED_BYTES,
    BodyTooLarge,
    HeadersTooLarge,
    UpstreamBroke,
    UpstreamPool,
    origin,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (it has a content-length: the pool always sends one)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a condition the loop's callbacks make true (bounded)."""
    for _ in range(int(timeout_s / 0.001)):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {predicate}")


class Server:
    """A loopback server running `handler` per connection, counting the connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        server = Server(handler)
        listening = await asyncio.start_server(server._serve, "127.0.0.1", 0)
        servers.append(listening)
        server.url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/v1/x"
        return server

    yield start
    for listening in servers:
        listening.close()
        await listening.wait_closed()


async def test_a_connection_is_reused_and_a_stale_one_replaced(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    closing = asyncio.Event()
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            assert request.endswith(b'{"a":1}')
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            writer.write(b"content-length: 2\r\n\r\n{}")
            await writer.drain()
            if closing.is_set():
                writer.close()  # the server drops the connection after this answer
                await writer.wait_closed()
                closed.set()
                return

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    for _ in range(3):
        conn = await pool.post(server.url, b'{"a":1}')
        assert (conn.status, conn.content_type, await conn.read()) == (
            200,
            "application/json",
            b"{}",
        )
        conn.release()
    assert server.num_connections == 1
    closing.set()
    conn = await pool.post(server.url, b'{"a":1}')
    assert await conn.read() == b"{}"
    conn.release()
    await closed.wait()  # whether or not its end has reached us yet: the next post works
    conn = await pool.post(server.url, b'{"a":1}')  # not the closed one: a new connection
    assert await conn.read() == b"{}"
    conn.release()
    assert server.num_connections == 2
    pool.close()


async def test_the_chunks_of_one_read_are_one_block_for_a_splice(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    go_on = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await go_on.wait()
        writer.write(chunk(b"data: 2\n\n") + chunk(b"data: 3\n\n") + chunk(b"data: 4\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert conn.status == 200 and conn.content_type == "text/event-stream"
    assert await conn.readany() == b"data: 1\n\n"
    blocks: list[bytes] = []
    go_on.set()
    await conn.splice(blocks.append)
    assert blocks == [b"data: 2\n\ndata: 3\n\ndata: 4\n\n"]
    assert await conn.readany() == b""  # the end, whole
    conn.release()
    pool.close()


class _Out:
    """A client's side of a splice that keeps what it was given (never paused)."""

    paused = False

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    async def drain(self) -> None:
        pass

    def cut(self) -> None:
        pass


async def test_a_splice_writes_whole_events_folds_crlf_and_holds_the_usage_read(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """`EventReader.splice`'s read tests (`CR in data`, `data.find(USAGE)`): a CRLF stream is
    folded, an event split across reads goes out whole, and the read with `"usage"` is held
    for `block()`, not written."""
    steps = [asyncio.Event() for _ in range(3)]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        await writer.drain()
        for step, data in zip(
            steps,
            (b"data: 1\r\n\r\ndata: 2\r\n\r\n", b'data: {"a":', b' 3}\n\ndata: {"usage": {}}\n\n'),
            strict=True,
        ):
            await step.wait()
            writer.write(chunk(data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    reader = EventReader(conn)
    out = _Out()
    splicing = asyncio.create_task(reader.splice(out))
    steps[0].set()
    await eventually(lambda: len(out.written) == 1)
    assert out.written == [b"data: 1\n\ndata: 2\n\n"]  # folded, written in the callback
    steps[1].set()
    await eventually(lambda: reader.tail != b"")
    assert len(out.written) == 1  # half an event: held back, nothing written
    steps[2].set()
    await splicing  # the usage read ended the splice
    assert out.written == [b"data: 1\n\ndata: 2\n\n"]
    assert await reader.block() == b'data: {"a": 3}\n\ndata: {"usage": {}}\n\n'
    assert await reader.block() == b""
    conn.release()
    pool.close()


async def test_a_body_delimited_by_the_connections_end_is_whole(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b"data: 1\n\ndata: [DONE]\n\n"
    conn.release()
    pool.close()


async def test_a_cut_or_malformed_response_fails_after_its_headers_and_before_them(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n") + b"40\r\ndata: 2")  # then gone
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 hello\r\n\r\n")
        await writer.drain()
        await reader.read()

    pool = UpstreamPool(8, 2.0)
    conn = await pool.post((await serve(cut)).url, b"{}")
    got = b""
    with pytest.raises(UpstreamBroke):
        while data := await conn.readany():
            got += data
    assert got == b"data: 1\n\ndata: 2"  # what arrived is passed on; then the break
    conn.release()
    with pytest.raises(ConnectionError):
        await pool.post((await serve(garbage)).url, b"{}")
    pool.close()


async def test_unread_body_bytes_stay_bounded_and_the_socket_is_paused(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    sent = 0
    event = b"data: " + b"x" * 16_000 + b"\n\n"

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(SSE_HEAD)
        while True:
            writer.write(chunk(event))
            sent += len(event)
            await writer.drain()

    pool = UpstreamPool(8, 2.0)
    conn = await pool.post((await serve(flood)).url, b"{}")
    assert conn.transport is not None
    transport = conn.transport
    await eventually(lambda: not transport.is_reading())
    buffered = conn._buffered
    assert MAX_BUFFERED_BYTES < buffered <= MAX_BUFFERED_BYTES + 256 * 1024
    for _ in range(50):  # a window in which nothing more may be buffered (the sockets are full)
        await asyncio.sleep(0.001)
    assert conn._buffered == buffered
    assert len(await conn.readany()) == buffered
    assert conn.transport.is_reading()  # a read resumes the socket
    conn.close()
    pool.close()


JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
STRAY_BODY = b'{"stray": "another request\'s '
"""A partial answer an engine writes on an idle keep-alive connection (issue 45, item 4)."""


def answer_of(body: bytes) -> bytes:
    return JSON_HEAD + b"content-length: %d\r\n\r\n%b" % (len(body), body)


def stray_swallowing(real: bytes) -> bytes:
    """A partial response whose content-length swallows the `real` answer written after it."""
    return JSON_HEAD + b"content-length: %d\r\n\r\n%b" % (len(STRAY_BODY) + len(real), STRAY_BODY)


class StrayEngine:
    """Answers the i-th request (on any connection) with `{"n": i}`; the test writes stray
    bytes on its connection (`writers`) whenever it likes."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.num_answered = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        while True:
            await read_request(reader)
            self.num_answered += 1
            writer.write(answer_of(b'{"n": %d}' % self.num_answered))
            await writer.drain()


async def test_a_stray_response_waiting_unread_on_an_idle_connection_never_reaches_the_next(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Item 4, at the pool. The stray bytes are in the gateway's socket, not yet read, when the
    next request takes the connection (a busy loop: they arrived after its last poll). Before:
    that request's answer was the stray response, its body the stray bytes and the engine's real
    answer swallowed by the stray's length. Now the connection is not reused."""
    engine = StrayEngine()
    server = await serve(engine)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b'{"n": 1}'
    conn.release()
    (writer,) = engine.writers
    writer.transport.write(stray_swallowing(answer_of(b'{"n": 2}')))  # sent now, not read yet
    conn = await pool.post(server.url, b"{}")  # no await before the request is written
    async with asyncio.timeout(2):
        body = await conn.read()
    assert body == b'{"n": 2}'  # its own answer, on a new connection
    assert server.num_connections == 2
    conn.release()
    pool.close()


async def test_a_byte_arriving_on_an_idle_connection_closes_it(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Item 4: the stray bytes are read while the connection sits idle in the pool. Before: they
    were parsed and kept, the connection reused, and the next answer swallowed by the stray's
    length (the next request waited for headers that had come already). Now the connection is
    closed at once, and the next request gets its own answer on a new one."""
    engine = StrayEngine()
    server = await serve(engine)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b'{"n": 1}'
    conn.release()
    (writer,) = engine.writers
    writer.write(stray_swallowing(answer_of(b'{"n": 2}')))
    await eventually(lambda: not pool.connections, timeout_s=2)  # closed by the gateway
    conn = await pool.post(server.url, b"{}")
    async with asyncio.timeout(2):
        assert await conn.read() == b'{"n": 2}'  # its own answer, on a new connection
    conn.release()
    assert server.num_connections == 2
    pool.close()


async def test_bytes_after_the_end_of_a_response_are_not_part_of_it(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Item 4: the stray response follows the real one in the same network read. Before: its
    body was handed to the reader as more of this response's body, and the connection went back
    to the pool mid-stray. Now this answer is exactly its own, and the connection is dropped."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer_of(b'{"n": 1}') + stray_swallowing(answer_of(b'{"n": 2}')))
        await writer.drain()
        await read_request(reader)
        writer.write(answer_of(b'{"n": 2}'))
        await writer.drain()
        await reader.read()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b'{"n": 1}'
    conn.release()
    conn = await pool.post(server.url, b"{}")
    async with asyncio.timeout(2):
        assert await conn.read() == b'{"n": 1}'  # a new connection: its first answer
    conn.release()
    assert server.num_connections == 2
    pool.close()


async def test_a_head_or_a_whole_body_over_its_limit_fails_and_the_connection_closes(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Item 5, at the pool: llhttp is fed at most `max_header_bytes` of a head (however the
    engine splits it), and `read(limit)` stops past its limit; neither connection is reused."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            if request.endswith(b'"head"}'):
                writer.write(JSON_HEAD + b"x-big: ")
                for _ in range(40):  # 40 reads' worth of a 4 KB header line
                    writer.write(b"a" * 4096)
                    await writer.drain()
                writer.write(b"\r\ncontent-length: 2\r\n\r\n{}")
            else:
                writer.write(answer_of(b"b" * 1_000_000))  # more than is read ahead
            await writer.drain()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0, max_header_bytes=16 * 1024)
    with pytest.raises(HeadersTooLarge, match="over 16384 bytes"):
        await pool.post(server.url, b'{"a":"head"}')
    conn = await pool.post(server.url, b'{"a":"body"}')
    with pytest.raises(BodyTooLarge, match="larger than 4096 bytes"):
        await conn.read(4096)
    conn.release()  # its response had not ended: closed, not pooled
    await eventually(lambda: not pool.connections)
    conn = await pool.post(server.url, b'{"a":"body"}')
    assert len(await conn.read(1_000_000)) == 1_000_000
    conn.release()
    assert server.num_connections == 3
    pool.close()


async def test_an_engine_ending_a_kept_alive_connection_is_reported(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Issue 45, item 17: an idle pooled connection the engine ends before its keep-alive ran
    out (a SIGKILL closes every socket of the process) is reported at once, so the replica
    becomes suspect before any request finds it restarted; ours closing one is not."""
    drop = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        writer.write(b"content-length: 2\r\n\r\n{}")
        await writer.drain()
        await drop.wait()  # then the engine dies: its socket closes

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    reported: list[tuple[str, int, bool]] = []
    pool.on_peer_closed = reported.append
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b"{}"
    conn.release()  # idle in the pool
    assert reported == []
    drop.set()
    await eventually(lambda: bool(reported))
    assert reported == [origin(server.url)[:3]]
    conn = await pool.post(server.url, b"{}")  # a new connection: the pool has none idle
    pool.close()  # ours: not reported
    await eventually(lambda: not pool.connections)
    assert len(reported) == 1


async def test_a_request_of_any_size_reaches_the_engine_byte_for_byte(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Small payloads go out in one write with their head, large ones (16 KiB and more) with
    the head in one gathered write: either way the engine reads exactly the head and the body,
    and the connection serves the next request."""
    received: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            received.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            writer.write(b"content-length: 2\r\n\r\n{}")
            await writer.drain()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    sizes = (7, 16383, 16384, 65536, 300_000)
    for size in sizes:
        payload = b'{"p":"' + bytes(48 + i % 64 for i in range(size)) + b'"}'
        conn = await pool.post(server.url, payload, {"x-kvgate-attempt": "1"})
        assert await conn.read() == b"{}"
        conn.release()
        head, _, body = received[-1].partition(b"\r\n\r\n")
        assert body == payload
        assert b"content-length: %d" % len(payload) in head
        assert b"x-kvgate-attempt: 1" in head
    assert server.num_connections == 1
    pool.close()
