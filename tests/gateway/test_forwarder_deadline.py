"""An attempt's one timer (`StallWatch`): the first-byte deadline before the commit, the idle
watch after it, over a real loopback engine.

The timer is armed once per attempt and may fire early (it then sleeps again): these pin that it
never fires late nor wrongly (a committed stream outliving the first-byte deadline is not cut),
and that only its own cancellation becomes a retryable failure, like `asyncio.timeout`'s."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.pipeline.forwarder import Forwarder, RetryableFailure, Streaming
from gateway.pipeline.upstream import UpstreamPool

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
LAST = b"data: [DONE]\n\n"

Engine = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))


@contextlib.asynccontextmanager
async def _serve(engine: Engine) -> AsyncIterator[str]:
    """The engine on a loopback port; on exit, its handlers are waited for (bounded)."""
    handlers: list[asyncio.Future[None]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.ensure_future(engine(reader, writer)))
        await handlers[-1]

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    finally:
        server.close()
        if handlers:
            await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)


async def _hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _request(reader)
    await reader.read()  # never answers; ends when the gateway drops the connection
    writer.close()
    await writer.wait_closed()


async def _first_then(
    pause_s: float,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    head_after_s: float = 0.0,
) -> None:
    """The head and first event after `head_after_s` (the engine's prefill), then `pause_s` of
    silence, then the end (bounded)."""
    await _request(reader)
    if head_after_s:
        await asyncio.sleep(head_after_s)
    writer.write(HEAD + _chunk(FIRST))
    await writer.drain()
    try:
        await asyncio.wait_for(reader.read(), pause_s)  # b"" early: the gateway closed it
    except TimeoutError:
        writer.write(_chunk(LAST) + b"0\r\n\r\n")
        await writer.drain()
    writer.close()
    await writer.wait_closed()


@pytest.fixture
def forwarder() -> Forwarder:
    return Forwarder(0.2, 30.0)


async def _attempt(forwarder: Forwarder, url: str) -> Streaming:
    forwarder.pool = UpstreamPool(4, 2.0)
    opened = await forwarder.attempt(url, b"{}", stream=True)
    assert isinstance(opened, Streaming)
    return opened


async def test_no_first_byte_is_a_retryable_failure_and_leaves_the_task_uncancelled(
    forwarder: Forwarder,
) -> None:
    async with _serve(_hung) as url:
        forwarder.pool = UpstreamPool(4, 2.0)
        started = time.monotonic()
        with pytest.raises(RetryableFailure, match=r"no first byte within 0\.2 s"):
            await forwarder.attempt(url, b"{}", stream=True)
        assert 0.2 <= time.monotonic() - started < 2
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # no cancellation is left pending for the caller
        forwarder.pool.close()


async def test_a_cancellation_from_outside_stays_a_cancellation(forwarder: Forwarder) -> None:
    forwarder = Forwarder(30.0, 30.0)
    arrived = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrived.set()
        await _hung(reader, writer)

    async with _serve(engine) as url:
        forwarder.pool = UpstreamPool(4, 2.0)
        attempt = asyncio.ensure_future(forwarder.attempt(url, b"{}", stream=True))
        await asyncio.wait_for(arrived.wait(), 2)
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        forwarder.pool.close()


async def test_a_committed_stream_outlives_the_first_byte_deadline(forwarder: Forwarder) -> None:
    """First byte 0.2 s, idle 30 s: the timer armed at 0.2 s finds the stream committed and
    sleeps until the idle deadline, so a 0.5 s silence after the first event is not cut."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _first_then(0.5, reader, writer)

    async with _serve(engine) as url:
        opened = await _attempt(forwarder, url)
        blocks = [await opened.reader.block(), await opened.reader.block()]
        assert blocks == [LAST, b""]
        assert opened.watch is not None and not opened.watch.stalled
        opened.release()
        assert forwarder.pool is not None
        forwarder.pool.close()


async def test_a_stall_after_the_commit_closes_the_stream_after_the_idle_timeout() -> None:
    """Idle 0.3 s, first byte 30 s: the one timer is armed at 0.3 s and closes the stream."""
    forwarder = Forwarder(30.0, 0.3)

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _first_then(5.0, reader, writer)

    async with _serve(engine) as url:
        opened = await _attempt(forwarder, url)
        started = time.monotonic()
        with pytest.raises(Exception, match="mid-response"):
            await opened.reader.block()
        assert 0.25 <= time.monotonic() - started < 2
        assert opened.watch is not None and opened.watch.stalled
        opened.release()
        assert forwarder.pool is not None
        forwarder.pool.close()


async def test_a_head_slower_than_the_idle_timeout_still_gets_the_idle_watch() -> None:
    """Idle 0.3 s, first byte 30 s, the head after 0.5 s: the timer armed at 0.3 s fires before
    the commit. It must not then sleep until the first-byte deadline (30 s), which would leave
    the committed stream unwatched that long: the stall after the first event is cut within
    about the idle timeout, not when the engine ends it 5 s later."""
    forwarder = Forwarder(30.0, 0.3)

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _first_then(5.0, reader, writer, head_after_s=0.5)  # a prefill past idle_s

    async with _serve(engine) as url:
        opened = await _attempt(forwarder, url)
        started = time.monotonic()
        with pytest.raises(Exception, match="mid-response"):
            await opened.reader.block()
        assert time.monotonic() - started < 2
        assert opened.watch is not None and opened.watch.stalled
        opened.release()
        assert forwarder.pool is not None
        forwarder.pool.close()
