"""Real Redis servers for tests and benchmarks: never the instance on 6379.

A standalone server listens on a unix socket in a temporary directory (no port at all); a
cluster is three masters on free loopback ports. Where a Docker engine answers, testcontainers
runs the standalone server instead; here (no Docker engine) the local `redis-server` binary runs.
Servers keep nothing on disk (`--save ""`, no AOF) unless a test asks for persistence.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from loadgen.harness.processes import free_port

START_TIMEOUT_S = 20.0
PORT_ATTEMPTS = 5
"""A port picked as free may be taken before the server binds it: pick again so often."""


class PortTaken(RuntimeError):
    """The server could not listen on its port: another process holds it."""


def docker_engine_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _wait_for(predicate: object, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not up after {START_TIMEOUT_S} s")
        time.sleep(0.02)


@dataclass
class RedisServer:
    """One redis-server process (port or unix socket) that a test may stop and restart."""

    workdir: Path
    port: int = 0
    host: str = "127.0.0.1"
    extra: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        return self.workdir / "redis.sock"

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://{self.host}:{self.port}"
        return f"unix://{self.socket}"

    def cli_args(self) -> list[str]:
        if self.port:
            return ["-h", self.host, "-p", str(self.port)]
        return ["-s", str(self.socket)]

    def start(self) -> None:
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if not self.port:
            args += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        proc = subprocess.Popen([*args, *self.extra])
        try:
            _wait_for(lambda: self._answers_as(proc), f"redis-server {self.url}")
        except BaseException:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            raise
        self.proc = proc

    def _answers_as(self, proc: subprocess.Popen[bytes]) -> bool:
        """Whether the server on our address is `proc` itself. A PING alone is not enough: when
        the port is taken the new server exits, and the other one answers."""
        if proc.poll() is not None:
            log = self.workdir / "redis.log"
            tail = log.read_text(errors="replace")[-300:] if log.exists() else ""
            raise PortTaken(f"redis-server could not listen on {self.url}: {tail.strip()}")
        result = subprocess.run(
            ["redis-cli", *self.cli_args(), "info", "server"], capture_output=True, text=True
        )
        return f"process_id:{proc.pid}" in result.stdout

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def cli(self, *command: str) -> str:
        result = subprocess.run(
            ["redis-cli", *self.cli_args(), *command], capture_output=True, text=True, check=True
        )
        return result.stdout


def _start_on_a_free_port(
    server: RedisServer, *, retry: bool, pick: Callable[[], int] = free_port
) -> None:
    """Start `server`; where its port was only picked as free (and another process took it
    since), pick another one."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            server.start()
            return
        except PortTaken:
            if not retry or attempt == PORT_ATTEMPTS - 1:
                raise
            server.port = pick()


@contextlib.contextmanager
def redis_server(port: int | None = None, extra: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A standalone server; `port=None` means a unix socket, `port=0` a free TCP port."""
    if (
        docker_engine_available() and port is None and not extra
    ):  # pragma: no cover - no Docker here
        from testcontainers.redis import RedisContainer

        with RedisContainer() as container:
            host = container.get_container_host_ip()
            mapped = int(container.get_exposed_port(6379))
            yield RedisServer(Path(tempfile.gettempdir()), port=mapped, host=host)
        return
    with tempfile.TemporaryDirectory(prefix="kvgate-redis-") as tmp:
        server = RedisServer(Path(tmp), port=free_port() if port == 0 else (port or 0), extra=extra)
        _start_on_a_free_port(server, retry=port == 0)
        try:
            yield server
        finally:
            server.stop()


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 < 65536:
            try:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class RedisCluster:
    """Masters (and their replicas) on free loopback ports, slots spread by `redis-cli --cluster
    create`; `nodes` in start order (the roles change on a failover: ask `masters()`)."""

    nodes: list[RedisServer]

    def masters(self) -> list[RedisServer]:
        """The running nodes that say they are masters and serve slots."""
        up = [n for n in self.nodes if n.proc is not None]
        return [n for n in up if "role:master" in n.cli("info", "replication") and _serves_slots(n)]

    def replicas_synced(self) -> bool:
        """Every running replica has its master link up (its first sync done)."""
        up = [n for n in self.nodes if n.proc is not None]
        infos = [n.cli("info", "replication") for n in up]
        return all("master_link_status:up" in i for i in infos if "role:slave" in i)

    def healthy(self) -> bool:
        """Every running node reports cluster_state:ok."""
        up = [n for n in self.nodes if n.proc is not None]
        return all("cluster_state:ok" in n.cli("cluster", "info") for n in up)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(n.host, n.port) for n in self.nodes]


def _serves_slots(node: RedisServer) -> bool:
    myself = next(line for line in node.cli("cluster", "nodes").splitlines() if "myself" in line)
    return len(myself.split()) > 8  # slot ranges follow the eight fixed fields


@contextlib.contextmanager
def redis_cluster(num_masters: int = 3, replicas: int = 0) -> Iterator[RedisCluster]:
    """`num_masters` masters, each with `replicas` replicas (promoted when their master dies:
    the node timeout is 2 s)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-cluster-") as tmp:
        nodes = []
        try:
            for i in range(num_masters * (1 + replicas)):
                workdir = Path(tmp) / f"node{i}"
                workdir.mkdir()
                node = RedisServer(
                    workdir,
                    port=_free_cluster_port(),
                    extra=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(workdir / "nodes.conf"),
                        "--cluster-node-timeout",
                        "2000",
                        # a replica's first sync starts at once (Redis 7 waits 5 s for more
                        # replicas to share a diskless transfer), so it can be promoted soon
                        "--repl-diskless-sync-delay",
                        "0",
                    ),
                )
                _start_on_a_free_port(node, retry=True, pick=_free_cluster_port)
                nodes.append(node)
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *[f"127.0.0.1:{n.port}" for n in nodes],
                    "--cluster-replicas",
                    str(replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                check=True,
                timeout=60,
            )
            cluster = RedisCluster(nodes)
            _wait_for(cluster.healthy, "redis cluster")
            if replicas:
                _wait_for(lambda: len(cluster.masters()) == num_masters, "cluster replicas")
                # a replica that never finished its first sync is never promoted: its data's
                # age is unknown (cluster-replica-validity-factor)
                _wait_for(cluster.replicas_synced, "cluster replicas synced")
            yield cluster
        finally:
            for node in nodes:
                node.stop()


def without_pubsub(url: str) -> str:
    """`url` as a new Redis user allowed everything but subscribing, on every node of a cluster:
    its publishes (inside scripts too) work, its SUBSCRIBE is refused with NOPERM — a broken
    pub/sub path for real, as a proxy or a managed Redis that drops pub/sub would give."""
    user, password = f"deaf-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = ["on", f">{password}", "~*", "&*", "+@all", "-subscribe", "-psubscribe"]
    rules.append("-ssubscribe")
    probe = redis.Redis.from_url(url)
    try:
        nodes = [probe]
        if probe.info("cluster").get("cluster_enabled"):
            nodes = [redis.Redis(host=host, port=port) for host, port in _cluster_nodes(probe)]
        for node in nodes:
            node.acl_setuser(user, reset=True)
            node.execute_command("ACL", "SETUSER", user, *rules)  # type: ignore[no-untyped-call]
            if node is not probe:
                node.close()
    finally:
        probe.close()
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


def _cluster_nodes(client: redis.Redis) -> list[tuple[str, int]]:
    nodes = []
    raw = client.execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
    for line in raw.decode().splitlines():
        host, port = line.split()[1].split("@")[0].rsplit(":", 1)
        nodes.append((host, int(port)))
    return nodes
