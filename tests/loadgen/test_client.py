"""The measured client: one retry when a pooled connection was closed under it; a "retry later"
(429, 503, 529) retried after its Retry-After, as the SDKs do."""

from __future__ import annotations

import asyncio

import aiohttp

from loadgen.client import stream_chat

SSE = (
    b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,'
    b'"prompt_tokens_details":{"cached_tokens":3}}}\n\n'
    b"data: [DONE]\n\n"
)


async def _serve(
    drop_first: int, refuse_first: int = 0, retry_after: bytes = b"0.01"
) -> tuple[asyncio.Server, list[int]]:
    """A raw HTTP server on loopback that hangs up on the first `drop_first` requests after
    reading them (the keep-alive race, seen from the client), answers the next `refuse_first`
    with a 429 and `retry_after`, then answers with SSE."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        seen[0] += 1
        if seen[0] <= drop_first:
            writer.close()
            return
        if seen[0] <= drop_first + refuse_first:
            body = b'{"error":{"type":"rate_limit_exceeded","code":"queue_full"}}'
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\nretry-after: %s\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (retry_after, len(body), body)
            )
            await writer.drain()
            writer.close()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(SSE) + SSE
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


async def _run(drop_first: int) -> tuple[bool, str, int, int]:
    server, seen = await _serve(drop_first)
    port = server.sockets[0].getsockname()[1]
    async with server, aiohttp.ClientSession() as http:
        result = await stream_chat(http, f"http://127.0.0.1:{port}", None, {"model": "m"})
    return result.ok, result.error, result.cached_tokens, seen[0]


def test_a_connection_closed_before_any_response_is_retried_once() -> None:
    ok, error, cached, requests = asyncio.run(_run(drop_first=1))
    assert ok and error == "" and cached == 3 and requests == 2


def test_a_second_hang_up_is_an_error() -> None:
    ok, error, _, requests = asyncio.run(_run(drop_first=2))
    assert not ok and error.startswith("ServerDisconnectedError") and requests == 2


async def _refused(refuse_first: int, retry_after: bytes = b"0.01") -> tuple[int, int, int]:
    server, seen = await _serve(0, refuse_first, retry_after)
    port = server.sockets[0].getsockname()[1]
    async with server, aiohttp.ClientSession() as http:
        result = await stream_chat(
            http, f"http://127.0.0.1:{port}", None, {"model": "m"}, overload_retries=2
        )
    return result.status, result.retries, seen[0]


def test_a_429_is_retried_after_its_retry_after_as_the_sdks_do() -> None:
    assert asyncio.run(_refused(2)) == (200, 2, 3)


def test_a_third_429_is_the_answer() -> None:
    assert asyncio.run(_refused(3)) == (429, 2, 3)


def test_a_retry_after_past_two_minutes_is_not_waited_out() -> None:
    assert asyncio.run(_refused(1, retry_after=b"600")) == (429, 0, 1)
