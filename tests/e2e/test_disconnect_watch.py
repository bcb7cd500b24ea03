"""A client's disconnect seen from uvicorn's httptools protocol itself (`watch_disconnect`):
while an answer is awaited (`ClientWatch`) or streamed, no task waits on `receive` and no timer
is armed per request, and a client that leaves cancels the work at once, not after
`WATCH_AFTER_S`. Under another server (a bare `receive`) the watch falls back to its timer.
Real uvicorn servers and sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from gateway.api.asgi import watch_disconnect
from gateway.api.body import WATCH_AFTER_S, ClientLeft, ClientWatch
from gateway.errors import ClientGone
from tests.servers import serve_lifespan, start_app, wait_until

pytestmark = pytest.mark.e2e

REQUEST = b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}"


def test_a_client_that_leaves_cancels_the_watched_work_at_once_without_a_task_or_timer() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await receive()  # the body
        tasks = len(asyncio.all_tasks())
        started = time.monotonic()
        try:
            with ClientWatch(ClientLeft(receive)) as watch:
                seen["timer"], seen["watched"] = watch._timer, watch._unwatch is not None
                seen["tasks"] = len(asyncio.all_tasks()) - tasks
                seen["waiting"] = True
                await asyncio.sleep(30)  # the answer nobody will read
        except ClientGone:
            seen["gone_after_s"] = time.monotonic() - started

    served = start_app(app)
    try:
        with socket.create_connection(("127.0.0.1", served.port)) as sock:
            sock.sendall(REQUEST)
            wait_until(lambda: seen.get("waiting", False), what="the answer awaited")
        wait_until(lambda: "gone_after_s" in seen, what="the work cancelled")
    finally:
        served.stop()
    assert seen["watched"] and seen["timer"] is None and seen["tasks"] == 0
    assert seen["gone_after_s"] < 5.0  # cancelled by the disconnect, not the 30 s sleep ending


def test_a_stream_is_aborted_by_the_servers_own_disconnect() -> None:
    aborted: list[float] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        done = asyncio.get_running_loop().create_future()
        unwatch = watch_disconnect(receive, lambda: done.set_result(None))
        assert unwatch is not None
        try:
            await asyncio.wait_for(done, 30)
            aborted.append(time.monotonic())
        finally:
            unwatch()

    served = start_app(app)
    try:
        with socket.create_connection(("127.0.0.1", served.port)) as sock:
            sock.sendall(REQUEST)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        wait_until(lambda: bool(aborted), what="the stream's disconnect seen")
    finally:
        served.stop()


async def test_elsewhere_the_watch_falls_back_to_a_timer_then_a_task() -> None:
    left = asyncio.get_running_loop().create_future()

    async def receive() -> dict[str, Any]:  # not uvicorn's: nothing to hook
        await left
        return {"type": "http.disconnect"}

    assert watch_disconnect(receive, lambda: None) is None
    started = time.monotonic()
    with pytest.raises(ClientGone), ClientWatch(ClientLeft(receive), after_s=0.01) as watch:
        assert watch._timer is not None and watch._unwatch is None
        left.set_result(None)
        await asyncio.sleep(30)
    assert time.monotonic() - started < 5.0 and WATCH_AFTER_S > 0
