"""The harness's servers start on ports `free_port` chose a moment before: when one is taken in
between (another process's outgoing connection draws its source port from the same range), the
server exits at once, and the harness starts it again on another port instead of failing the
run (`make run` once failed so on a fresh clone)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from loadgen.harness import processes


@contextlib.contextmanager
def first_port_taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """From here `free_port` hands out a port a listening socket holds, then free ones."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        real = processes.free_port
        given = iter([port])
        monkeypatch.setattr(processes, "free_port", lambda: next(given, None) or real())
        yield port


def port_of(proc: processes.Proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def test_an_engine_whose_port_was_taken_starts_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    with first_port_taken(monkeypatch) as taken, processes.engines(2) as engines:
        ports = [port_of(e) for e in engines]
        assert taken not in ports and len(set(ports)) == 2
        assert all(e.popen.poll() is None for e in engines)


def test_a_gateway_whose_port_was_taken_starts_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        processes.engines(1) as engines,
        first_port_taken(monkeypatch) as taken,
        processes.gateway([engines[0].url]) as gw,
    ):
        assert port_of(gw) != taken and gw.popen.poll() is None


def test_a_port_asked_for_is_not_traded_for_another(monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        first_port_taken(monkeypatch) as taken,
        pytest.raises(processes.ExitedBeforeReady),
        processes.engines(1, ports=[taken]),
    ):
        pass
