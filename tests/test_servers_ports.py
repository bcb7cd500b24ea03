"""The tests' in-process servers take a port no other socket holds: the socket is bound before
uvicorn is given it (a port chosen, closed and bound later was once taken in between)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import httpx
import pytest

from tests import servers


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await servers.serve_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def test_a_server_without_a_port_never_gets_one_another_socket_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        # the port chooser handing out a port already in use (what the race did)
        monkeypatch.setattr(servers, "free_port", lambda: held, raising=False)
        served = servers.start_app(hello)
        try:
            assert served.port != held
            assert httpx.get(served.url).text == "hello"
        finally:
            served.stop()


def test_a_port_asked_for_that_is_taken_is_an_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="failed to start"):
            servers.start_app(hello, taken.getsockname()[1])


def test_on_loop_reads_on_the_servers_own_thread() -> None:
    """A test reads an app's state where the app uses it: on its event loop's thread."""
    with servers.serve(hello) as served:
        assert served.on_loop(threading.current_thread) is served.thread
        with pytest.raises(ZeroDivisionError):  # the read's error reaches the test
            served.on_loop(lambda: 1 // 0)
