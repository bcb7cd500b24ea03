"""An engine that writes exact bytes: an asyncio server on loopback, in a thread of its own,
speaking just enough HTTP/1.1 for a gateway (`/health`, `/v1/models`, the completion routes),
whose answers a test shapes byte by byte to play a broken or hostile engine (issue 45)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future

import orjson

from tests.conftest import MODEL

Shape = Callable[[int, bytes], bytes]
"""The bytes answering the n-th completion request (from 1) given its body."""


def http_answer(status: int, content_type: bytes, body: bytes, head: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %b\r\n%bcontent-length: %d\r\n\r\n%b" % (
        status,
        content_type,
        head,
        len(body),
        body,
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def sse_answer(text: str, head: bytes = b"", num_events: int = 1) -> bytes:
    """A whole streamed chat answer: `num_events` content events, the usage event, [DONE]."""
    delta = {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}
    end = {"index": 0, "delta": {}, "finish_reason": "stop"}
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    base = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    events = [
        *[b"data: " + orjson.dumps({**base, "choices": [delta]}) + b"\n\n"] * num_events,
        b"data: " + orjson.dumps({**base, "choices": [end], "usage": usage}) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n%b"
        b"transfer-encoding: chunked\r\n\r\n"
        % head
        + b"".join(chunk(e) for e in events)
        + b"0\r\n\r\n"
    )


def json_answer(text: str) -> bytes:
    body = {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    return http_answer(200, b"application/json", orjson.dumps(body))


def default_shape(n: int, body: bytes) -> bytes:
    if orjson.loads(body).get("stream"):
        return sse_answer(f"answer {n}")
    return json_answer(f"answer {n}")


class RawEngine:
    """`shape` answers the completion requests; `writers` are its open connections' writers, for
    a test that writes on one whenever it likes (`write_on`)."""

    def __init__(self, shape: Shape = default_shape) -> None:
        self.shape = shape
        self.num_completions = 0
        self.num_connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> asyncio.Server:
        future: Future[asyncio.Server] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return future.result(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        completions = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.split(b"\r\n")
                length = 0
                for field in fields:
                    name, _, value = field.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                path = line.split(b" ")[1]
                if path == b"/health":
                    writer.write(http_answer(200, b"text/plain", b""))
                elif path == b"/v1/models":
                    models = {"object": "list", "data": [{"id": MODEL, "owned_by": "vllm"}]}
                    writer.write(http_answer(200, b"application/json", orjson.dumps(models)))
                elif path.startswith(b"/v1/"):
                    if not completions:
                        completions = True
                        self.writers.append(writer)
                    self.num_completions += 1
                    writer.write(self.shape(self.num_completions, body))
                else:
                    writer.write(http_answer(404, b"text/plain", b"no"))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def write_on(self, index: int, data: bytes) -> None:
        """Write `data` on the `index`-th connection that carried a completion."""

        async def write() -> None:
            writer = self.writers[index]
            writer.write(data)
            await writer.drain()

        asyncio.run_coroutine_threadsafe(write(), self.loop).result(10)

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for writer in self.writers:
                writer.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
