"""Start and stop engines and gateways as subprocesses on loopback, and wait for them.

Every wait is bounded by a deadline; every process is stopped (terminate, then kill) on exit.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

STARTUP_TIMEOUT_S = 60.0
"""The bound on a server process's start (a bound, not a wait: a quiet machine starts one in
1-3 s). A pod of two workers, each importing the gateway, missed 30 s at a load average of 18
while the suite ran on two pytest-xdist workers."""


LOWEST_PORT = 10_000
"""The lowest port `free_port` hands out: above the well-known and most services' ports."""


def _ephemeral_low() -> int:
    """The lowest port the kernel draws outgoing connections' source ports from."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _port_block() -> range:
    """This process's ports: below the ephemeral range, a block of their own per
    pytest-xdist worker (`PYTEST_XDIST_WORKER`), the whole span otherwise."""
    high = max(_ephemeral_low(), LOWEST_PORT + 1_000)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1"), 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % count if worker[2:].isdigit() else 0
    size = (high - LOWEST_PORT) // count
    return range(LOWEST_PORT + index * size, LOWEST_PORT + (index + 1) * size)


_cursor: list[int] = []
"""Where in `_port_block` the next `free_port` looks (it starts at random: two processes
sharing a block seldom look at the same ports at once)."""


def free_port() -> int:
    """A port no socket holds now, for a server another process will bind. Not one the kernel
    hands out itself (`bind(0)`): those are drawn from the range outgoing connections' source
    ports come from, and one was taken by a connection between the choice and the server's
    bind (a gateway exited at start, uvicorn's status 3, with three test workers). These are
    below that range, from this worker's block, each handed out once a cycle of it."""
    block = _port_block()
    if not _cursor:
        _cursor.append(random.randrange(len(block)))
    for _ in range(len(block)):
        _cursor[0] = (_cursor[0] + 1) % len(block)
        port = block[_cursor[0]]
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    metrics_url: str | None = None
    """A gateway's admin port (/metrics, the API documents), apart from its tenant port."""

    @property
    def pid(self) -> int:
        return self.popen.pid


def _kvgate(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate_cli", *args]


def run_kvgate(args: list[str], timeout_s: float) -> str:
    """A `kvgate` command run to its end (bounded), its stdout; a failure raises with its
    stderr. How loadgen reads what only the gateway's own code knows (its WAL, its memory),
    over a process boundary rather than an import."""
    done = subprocess.run(_kvgate(*args), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"kvgate {' '.join(args)}: exit {done.returncode}: {done.stderr}")
    return done.stdout


class ExitedBeforeReady(RuntimeError):
    """A server process ended before it answered its readiness path."""


def wait_ready(url: str, path: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as http:  # one TLS context a wait, not a poll (~27 ms of CPU)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ExitedBeforeReady(f"{url}: process exited with status {proc.returncode}")
            try:
                if http.get(url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f} s")


START_ATTEMPTS = 3
"""Starts of a server on ports `free_port` chose, before it is given up: a port can still be
taken between the choice and the server's bind (by another process's server), and the server
then exits at once (uvicorn: status 3); it is started again on new ports."""


def wait_all(procs: list[Proc], path: str, restart: Callable[[], Proc] | None) -> None:
    """Until each of `procs` answers `path`. One that exits first is replaced in `procs` by
    `restart()` (on new ports: `START_ATTEMPTS` starts in all) when given, else it raises."""
    for i in range(len(procs)):
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                wait_ready(procs[i].url, path, procs[i].popen, STARTUP_TIMEOUT_S)
                break
            except ExitedBeforeReady:
                if restart is None or attempt == START_ATTEMPTS:
                    raise
                procs[i] = restart()


def start_engine(port: int, engine_args: Sequence[str] = (), quiet: bool = True) -> Proc:
    url = f"http://127.0.0.1:{port}"
    popen = subprocess.Popen(
        _kvgate("engine", "--port", str(port), *engine_args),
        stdout=subprocess.DEVNULL if quiet else None,
        stderr=subprocess.DEVNULL if quiet else None,
    )
    return Proc(f"engine:{port}", url, popen)


def start_gateway(
    port: int,
    engines: Sequence[str],
    gateway_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    quiet: bool = True,
    cwd: str | None = None,
    preexec_fn: Callable[[], None] | None = None,
    wrapper: Sequence[str] = (),
) -> Proc:
    """`kvgate serve` on `port`; `cwd` runs another checkout's code (it comes first on the
    module path of `python -m`); `preexec_fn` runs in the child before exec (a resource limit);
    `wrapper` is a command the gateway runs under (valgrind)."""
    url = f"http://127.0.0.1:{port}"
    metrics_port = free_port()  # never the default 9090: several gateways run side by side
    args = ["serve", "--port", str(port)]
    args += [a for e in engines for a in ("--engine", e)]
    # the admin port by environment, not by flag: an older checkout (`cwd`) that has no such
    # setting ignores the variable instead of refusing the flag
    popen = subprocess.Popen(
        [*wrapper, *_kvgate(*args, *gateway_args)],
        stdout=subprocess.DEVNULL if quiet else None,
        stderr=subprocess.DEVNULL if quiet else None,
        env={**os.environ, "KVGATE_METRICS_PORT": str(metrics_port), **(env or {})},
        cwd=cwd,
        preexec_fn=preexec_fn,
    )
    return Proc(f"gateway:{port}", url, popen, f"http://127.0.0.1:{metrics_port}")


def stop(procs: Sequence[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.terminate()
    for p in procs:
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait(timeout=10)


@contextlib.contextmanager
def engines(
    num: int, engine_args: Sequence[str] = (), ports: Sequence[int] | None = None
) -> Iterator[list[Proc]]:
    chosen = list(ports) if ports else [free_port() for _ in range(num)]
    procs = [start_engine(p, engine_args) for p in chosen]
    try:
        restart = None if ports else lambda: start_engine(free_port(), engine_args)
        wait_all(procs, "/health", restart)
        yield procs
    finally:
        stop(procs)


@contextlib.contextmanager
def engines_with_events(
    num: int, engine_args: Sequence[str] = ()
) -> Iterator[tuple[list[Proc], dict[str, str]]]:
    """`engines`, each publishing KV events (vLLM's ZMQ PUB) on a port of its own: yields the
    engines and engine URL -> events endpoint (what `kvgate serve` takes as
    `kv_events_endpoints`, for precise mode)."""
    procs: list[Proc] = []
    events: dict[str, str] = {}

    def start() -> Proc:
        port = free_port()
        config = orjson.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        proc = start_engine(free_port(), [*engine_args, "--kv-events-config", config.decode()])
        events[proc.url] = f"tcp://127.0.0.1:{port}"
        return proc

    try:
        procs += [start() for _ in range(num)]
        wait_all(procs, "/health", start)
        events = {p.url: events[p.url] for p in procs}  # (not a start that exited)
        yield procs, events
    finally:
        stop(procs)


def precise_gateway_args(
    events: dict[str, str], tokenizer_dir: str
) -> tuple[list[str], dict[str, str]]:
    """The flags and environment that put `kvgate serve` in precise mode over `events`."""
    return ["--tokenizer-dir", tokenizer_dir], {
        "KVGATE_KV_EVENTS_ENDPOINTS": orjson.dumps(events).decode()
    }


@contextlib.contextmanager
def gateway(
    engine_urls: Sequence[str],
    gateway_args: Sequence[str] = (),
    port: int | None = None,
    env: dict[str, str] | None = None,
    quiet: bool = True,
    cwd: str | None = None,
) -> Iterator[Proc]:
    """`cwd`: another checkout's code (`start_gateway`)."""

    def start() -> Proc:
        return start_gateway(port or free_port(), engine_urls, gateway_args, env, quiet, cwd)

    procs = [start()]
    try:
        wait_all(procs, "/readyz", None if port else start)
        yield procs[0]
    finally:
        stop(procs)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc): a `--workers N` gateway's
    workers."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if parent == pid:
            found.append(int(entry))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` of a process and its live children: a supervisor and its workers."""
    total = cpu_seconds(pid)
    for child in children(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(child)
    return total
