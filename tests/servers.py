"""Real servers on loopback sockets for the tests: uvicorn in a thread (in-process, so a test
can reach into an engine's state) or a subprocess (see loadgen.harness.processes)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")

READY_TIMEOUT_S = 20.0


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll a condition until it holds (bounded); the condition, not a sleep, synchronises."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(0.01)


async def serve_lifespan(receive: Any, send: Any) -> None:
    """An ASGI app's lifespan scope, answered: startup complete, then shutdown complete (for a
    test's own bare app, which uvicorn runs with `lifespan="on"`)."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


@dataclass
class Served:
    app: Any
    port: int
    server: uvicorn.Server
    thread: threading.Thread
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def on_loop(self, read: Callable[[], T], timeout_s: float = 10.0) -> T:
        """`read()` called on the server's event loop, its result returned here: the app's
        state is only ever used from that loop, and some reads tidy as they go (an eviction
        order drops its emptied runs), so a read from the test's thread can race a write."""

        async def call() -> T:
            return read()

        loop = self.server.servers[0].get_loop()
        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout_s)


def start_app(app: Any, port: int | None = None, host: str = "127.0.0.1") -> Served:
    """Serve `app` on loopback (any 127.x address: a test may give each replica its own, the
    way pods have their own IPs behind one port). Without a port, the socket is bound here to
    one the kernel picks and handed to uvicorn: a port chosen first and bound later could be
    taken in between (an outgoing connection drew it once, in a suite run: "address already
    in use")."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port or 0))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"server on port {port} failed to start: {exc}") from None
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), READY_TIMEOUT_S, "server start")
    if not server.started:
        sock.close()
        raise RuntimeError(f"server on port {port} failed to start")
    return Served(app, port, server, thread, host)


def stop_all(servers: list[Served]) -> None:
    """Stop servers together: each shutdown waits on uvicorn's tick, so do them in parallel."""
    for s in servers:
        s.server.should_exit = True
    for s in servers:
        s.thread.join(timeout=15)


@contextlib.contextmanager
def serve(app: Any, port: int | None = None) -> Iterator[Served]:
    served = start_app(app, port)
    try:
        yield served
    finally:
        served.stop()


class CountedWrites:
    """A server's transport for one connection, keeping each write that reaches it (a test swaps it
    into uvicorn's cycle to count what a response costs in writes)."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
