"""The measured client: one retry when a pooled connection was closed under it."""

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


async def _serve(drop_first: int) -> tuple[asyncio.Server, list[int]]:
    """A raw HTTP server on loopback that hangs up on the first `drop_first` requests after
    reading them (the keep-alive race, seen from the client), then answers with SSE."""
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
