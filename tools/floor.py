"""The floor under the gateway's CPU per request: a proxy with nothing of the gateway's own.

    python -m tools.floor --port PORT --engine URL

(`kvgate bench-cpu --floor` starts it beside the gateway, on the same engine, and measures
both in the same passes.)

It serves on the stack the gateway serves on and talks to the engine as the gateway does: the
gateway's own uvicorn configuration (`server_config`: uvloop, httptools, no access log, no date
header) and collector tuning (`tune_collector`), one raw ASGI callable, the gateway's engine
client (`UpstreamPool`), and the gateway's writes to the client (`send_whole`: an answer's head
and body in one write; `start_chunked` and `ChunkedOut`: a stream's head with its first events,
then each engine read spliced to one client write). Each POST's body is forwarded to the same
path on the one engine, its answer returned as it came. No parse, no auth, no routing, no
records, no metrics, no disconnect watch: its CPU per request is what this stack alone costs,
the floor under `bench-cpu`'s goal (issue 41) for any gateway built on it.

It lives in tools, not loadgen: it is the gateway's own code that it runs, and loadgen meets the
gateway only over the wire or a process boundary.
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from gateway.api.asgi import ChunkedOut, send_whole, start_chunked
from gateway.pipeline.upstream import UpstreamConnection, UpstreamPool
from gateway.server.cli import server_config
from gateway.server.cyclic_gc import tune_collector
from gateway.settings import Settings

READY = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
STREAM_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class Floor:
    """The ASGI app: /readyz answers, every POST is forwarded (one engine, the same path)."""

    def __init__(self, engine: str, pool: UpstreamPool) -> None:
        self.engine = engine.rstrip("/")
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.pool)
        elif scope["type"] != "http":
            return
        elif scope["method"] != "POST":  # a readiness probe
            await send_whole(send, READY, {"type": "http.response.body", "body": b"ok"})
        else:
            await self.forward(scope, receive, send)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body", False):
            message = await receive()
            body += message.get("body", b"")
        conn = await self.pool.post(self.engine + scope["path"], body)
        try:
            if conn.content_type == "text/event-stream":
                await _relay(conn, send)
            else:
                answer = await conn.read()
                start = {
                    "type": "http.response.start",
                    "status": conn.status,
                    "headers": [
                        (b"content-length", b"%d" % len(answer)),
                        (b"content-type", conn.content_type.encode("latin-1")),
                    ],
                }
                await send_whole(send, start, {"type": "http.response.body", "body": answer})
        finally:
            conn.release()


async def _relay(conn: UpstreamConnection, send: Send) -> None:
    """The engine's stream to the client a read at a time, as the gateway's relay writes it
    (each read one chunk, in the connection's read callback while the client keeps up)."""
    start: Message = {
        "type": "http.response.start",
        "status": conn.status,
        "headers": STREAM_HEADERS,
    }
    out = await start_chunked(send, start)
    if out is None:  # not uvicorn's httptools protocol: body messages through `send`
        while data := await conn.readany():
            await send({"type": "http.response.body", "body": data, "more_body": True})
    else:
        await _splice(conn, out)
        out.flush()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _splice(conn: UpstreamConnection, out: ChunkedOut) -> None:
    def sink(data: bytes) -> None:
        out.write(data)
        if out.paused:
            conn.end_splice()

    while True:
        await conn.splice(sink)
        if not out.paused:
            break  # the response ended (or broke: the caller's release closes it)
        await out.drain()  # then the reads buffered meanwhile go first


async def _lifespan(receive: Receive, send: Send, pool: UpstreamPool) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    pool.close()
    await send({"type": "lifespan.shutdown.complete"})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.floor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True, help="the engine's URL")
    args = parser.parse_args()
    settings = Settings(port=args.port, engines=[args.engine], log_level="warning")
    pool = UpstreamPool(
        settings.upstream_max_connections,
        settings.connect_timeout_s,
        settings.upstream_max_header_bytes,
    )
    server = uvicorn.Server(server_config(Floor(args.engine, pool), settings))
    tune_collector()
    server.run()


if __name__ == "__main__":
    main()
