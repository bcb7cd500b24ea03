"""`kvgate serve --workers N`: a supervisor and N gateway processes, every core of a pod.

The workers bind the public ports themselves with SO_REUSEPORT (HTTP here, gRPC and ext-proc
through `grpc.so_reuseport`) instead of inheriting one socket bound by the supervisor: the
kernel spreads new connections evenly over the listening sockets (a hash of the 4-tuple), where
one shared socket hands each connection to whichever worker wakes first in accept (the least
busy one, or one of them most of the time); a worker joins only when it listens, after its
lifespan started (replicas probed, Redis open), so no connection queues on a worker still
starting; and one mechanism serves the three ports. The price: connections still in a closing
worker's accept queue are reset, at SIGTERM only, when the pod has left its Service.

The workers agree on placement because they share the Redis directory (`redis_url`, required):
the directory, hot-prefix rates, fan-out leaders and holds and rate limits are all in Redis
already, as for N gateways (docs/operations.md#workers has the table of every piece of state).

The supervisor restarts nothing: when a worker exits unasked, the others are stopped and the
supervisor exits non-zero, so Kubernetes restarts the pod whole. SIGTERM (or SIGINT) is
forwarded to every worker, each drains as a lone gateway does, and the supervisor waits for
them. It serves the admin port itself: `/metrics` merged over the workers' own admin ports
(gateway.server.pod_metrics), the API documents from worker 0, and `/pod` (the workers' pids
and admin ports, JSON). A worker's admin socket is bound by the supervisor on loopback to a port
the kernel picks and handed to the worker as an open file descriptor (`worker_admin_fd`), so no
fixed port beside `metrics_port` has to be free and no other process can take it in between.

One prober and scraper per pod (issue 17 item 4): worker 0 alone probes and scrapes the
replicas and sends its view of them to the others over a datagram socket pair per other worker
(`worker_view_fds`, made here, inherited by both ends; gateway.fleet.podview). A worker whose
view goes silent probes and scrapes for itself after a bound (`ReplicaSet.stale_after_s`).
Kubernetes discovery likewise: worker 0 alone watches the EndpointSlices and sends its endpoint
set on the same channel; a worker whose sets lapse watches for itself (gateway.fleet.discovery).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Sequence

import aiohttp
import orjson
from aiohttp import web

from gateway.billing.service import admin_key_hashes
from gateway.directory.routing import RoutingDirectory
from gateway.directory.siblings import Siblings
from gateway.fleet.podview import ViewReceiver, ViewSender
from gateway.fleet.replicas import ReplicaSet
from gateway.server.admin import key_guard
from gateway.server.pod_metrics import merge
from gateway.settings import Settings

log = logging.getLogger(__name__)

WORKER_INDEX_ENV = "KVGATE_WORKER_INDEX"
WORKER_ADMIN_FD_ENV = "KVGATE_WORKER_ADMIN_FD"
WORKER_VIEW_FDS_ENV = "KVGATE_WORKER_VIEW_FDS"
WORKER_PLACEMENT_FDS_ENV = "KVGATE_WORKER_PLACEMENT_FDS"
LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1
SCRAPE_TIMEOUT_S = 5.0
"""A worker's /metrics renders in milliseconds; 5 s means it is stuck, and the pod's page fails
(503) rather than showing a partial sum that Prometheus would read as a counter reset."""
RESET_TIMEOUT_S = 15.0
"""A worker's reset waits on every engine's (10 s each, in parallel): 15 s bounds the pod's."""
STOP_AFTER_GRACE_S = 15.0
"""Past its drain grace (and its 5 s settle) a worker that has not exited is killed."""


def worker_settings(settings: Settings) -> Settings:
    """A worker's own settings: its own WAL directory (one lock per writer); its admin socket
    comes from the supervisor (`worker_admin_fd`)."""
    index = settings.worker_index
    assert index is not None
    update: dict[str, object] = {}
    if settings.billing_wal_dir is not None:
        update["billing_wal_dir"] = settings.billing_wal_dir / f"worker-{index}"
    return settings.model_copy(update=update)


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` beside the other workers' (not yet listening: uvicorn
    listens once the lifespan has started)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def loopback_socket() -> socket.socket:
    """A TCP socket bound to a free loopback port (not listening: its worker listens on it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    return sock


def view_sockets(workers: int) -> list[list[socket.socket]]:
    """Each worker's ends of the pod view's channel: worker 0 one sending end per other worker,
    worker i > 0 the receiving end of its own pair (`AF_UNIX` datagrams: gateway.fleet.podview)."""
    ends: list[list[socket.socket]] = [[] for _ in range(workers)]
    for index in range(1, workers):
        send, receive = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        ends[0].append(send)
        ends[index].append(receive)
    return ends


def placement_sockets(workers: int) -> list[list[socket.socket]]:
    """Each worker's ends of the placement channel (gateway.directory.siblings): the receiving
    end of its own pair first, then the sending ends of every other worker's pair."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(workers)]
    return [
        [pairs[i][1], *(send for j, (send, _) in enumerate(pairs) if j != i)]
        for i in range(workers)
    ]


def share_placements(settings: Settings, directory: RoutingDirectory) -> None:
    """A worker's part in the pod's placements: what it places reaches the other workers'
    local indexes, and theirs reach its own (a lone gateway has no such channel)."""
    if len(settings.worker_placement_fds) < 2:
        return
    socks = [socket.socket(fileno=fd) for fd in settings.worker_placement_fds]
    directory.siblings = Siblings(socks[0], socks[1:])
    # the others' records arrive as runs of a chain (a long one in several datagrams, any of
    # which a full queue may drop), not always from its first block: the index walks
    directory.local.index.whole_chains = False


def share_fleet_view(settings: Settings, replicas: ReplicaSet) -> None:
    """A worker's part in the pod's one prober (before the replicas start): worker 0 leads,
    the others follow; a lone gateway (no `worker_view_fds`) probes for itself."""
    if not settings.worker_view_fds:
        return
    socks = [socket.socket(fileno=fd) for fd in settings.worker_view_fds]
    if settings.worker_index == 0:
        replicas.lead(ViewSender(socks))
    else:
        replicas.follow(ViewReceiver(socks[0], replicas.adopt))


def refusal(settings: Settings) -> str | None:
    """Why these settings cannot run as a pod of workers, or None."""
    if settings.port == 0 or settings.grpc_port == 0 or settings.metrics_port == 0:
        return "--workers N needs fixed ports (port, grpc_port, metrics_port), not 0"
    if settings.mode == "epp" and settings.epp_port == 0:
        return "--workers N needs a fixed epp_port, not 0"
    return None


def supervise(settings: Settings, argv: Sequence[str]) -> int:
    """Run `argv` (this `kvgate serve` command line) as `settings.workers` workers; returns
    the pod's exit status. The pod's admin port is bound first, before any worker starts: a
    taken port is refused at once (status 2), and no worker's own socket can take it."""
    admin: socket.socket | None = None
    if settings.metrics_port is not None:
        try:
            admin = listening_socket(settings.host, settings.metrics_port)
        except OSError as exc:
            print(
                f"kvgate serve: the admin port {settings.host}:{settings.metrics_port} is taken "
                f"({exc.strerror}); set another with --metrics-port or KVGATE_METRICS_PORT"
            )
            return 2
    return asyncio.run(Supervisor(settings, argv, admin).run())


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` (the pod's admin port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Supervisor:
    def __init__(
        self, settings: Settings, argv: Sequence[str], admin: socket.socket | None = None
    ) -> None:
        self.settings = settings
        self.argv = list(argv)
        self.admin = admin
        """The pod's admin port, bound and listening (`supervise`), or None without one."""
        self.workers: list[asyncio.subprocess.Process] = []
        self.draining = False

    def _environment(
        self,
        index: int,
        admin: socket.socket | None,
        views: list[socket.socket],
        placements: list[socket.socket],
    ) -> dict[str, str]:
        env = {**os.environ, WORKER_INDEX_ENV: str(index)}
        env.pop(WORKER_ADMIN_FD_ENV, None)
        if admin is not None:
            env[WORKER_ADMIN_FD_ENV] = str(admin.fileno())
        env[WORKER_VIEW_FDS_ENV] = str([v.fileno() for v in views])
        env[WORKER_PLACEMENT_FDS_ENV] = str([p.fileno() for p in placements])
        if self.settings.server_secret is None and self.settings.server_secret_file is None:
            # the workers must salt alike; a random secret per worker would split the directory
            env["KVGATE_SERVER_SECRET"] = self._secret
        return env

    async def run(self) -> int:
        self._secret = secrets.token_hex(32)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.drain)
        admin_sockets: list[socket.socket] = []
        if self.settings.metrics_port is not None:
            admin_sockets = [loopback_socket() for _ in range(self.settings.workers)]
        views = view_sockets(self.settings.workers)
        placements = placement_sockets(self.settings.workers)
        try:
            for index in range(self.settings.workers):
                if self.draining:  # asked to stop while starting: start no more
                    break
                inherited = admin_sockets[index] if admin_sockets else None
                fds = [] if inherited is None else [inherited.fileno()]
                fds += [v.fileno() for v in views[index]]
                fds += [p.fileno() for p in placements[index]]
                self.workers.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "kvgate_cli",
                        *self.argv,
                        env=self._environment(index, inherited, views[index], placements[index]),
                        pass_fds=fds,
                        process_group=0,  # a terminal's ^C reaches the supervisor only
                        preexec_fn=_drain_with_the_supervisor,
                    )
                )
            ports = [int(s.getsockname()[1]) for s in admin_sockets]
        finally:
            owned = [s for ends in views + placements for s in ends]
            for sock in admin_sockets + owned:
                sock.close()  # the workers hold their own copies
        log.info(
            "kvgate: %d workers (pids %s) on port %d",
            len(self.workers),
            ", ".join(str(w.pid) for w in self.workers),
            self.settings.port,
        )
        async with contextlib.AsyncExitStack() as stack:
            if self.admin is not None:
                admin = PodAdmin(self.settings, ports, [w.pid for w in self.workers])
                stack.push_async_callback(admin.stop)
                await admin.start(self.admin)
            return await self._wait()

    def drain(self) -> None:
        if not self.draining:
            log.info("kvgate: draining %d workers", len(self.workers))
        self.draining = True
        for worker in self.workers:
            if worker.returncode is None:
                worker.send_signal(signal.SIGTERM)

    async def _wait(self) -> int:
        waits: list[asyncio.Future[int]] = [asyncio.ensure_future(w.wait()) for w in self.workers]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not self.draining:
            first = next(i for i, w in enumerate(waits) if w in done)
            log.error(
                "kvgate: worker %d exited with status %s; stopping the pod",
                first,
                self.workers[first].returncode,
            )
            self.drain()
            await self._wait_all(waits)
            return exit_status(self.workers[first].returncode) or 1
        await self._wait_all(waits)
        # uvicorn re-raises the SIGTERM it drained on: that death is a worker's clean exit
        failed = [w.returncode for w in self.workers if w.returncode not in (0, -signal.SIGTERM)]
        return exit_status(failed[0]) if failed else 0

    async def _wait_all(self, waits: list[asyncio.Future[int]]) -> None:
        _, pending = await asyncio.wait(waits, timeout=self.settings.shutdown_grace_s + 20.0)
        for worker in self.workers:
            if worker.returncode is None:
                log.error("kvgate: worker pid %d did not stop; killing it", worker.pid)
                worker.kill()
        if pending:
            await asyncio.wait(pending, timeout=STOP_AFTER_GRACE_S)


def _drain_with_the_supervisor() -> None:
    """In the worker before exec: SIGTERM when the supervisor dies (even by SIGKILL), so no
    worker outlives its pod's supervisor (Linux prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_status(returncode: int | None) -> int:
    """A worker's status as a shell reports it (killed by signal s: 128 + s)."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


class PodAdmin:
    """The pod's admin port: `/metrics` merged over the workers, `POST /reset_prefix_cache`
    sent to every worker (each keeps its own wipe state and event index), the rest from worker
    0. A request's `Authorization` goes with it to the workers, which check it as a lone
    gateway does; with `admin_port_auth` the pod checks it first too (`/pod` is its own)."""

    def __init__(self, settings: Settings, ports: list[int], pids: list[int]) -> None:
        assert settings.metrics_port is not None
        self.settings = settings
        self.ports = ports
        self.pids = pids
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self, sock: socket.socket) -> None:
        """Serve on `sock`, the admin port the supervisor bound before its workers started."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(SCRAPE_TIMEOUT_S))
        guards = []
        if self.settings.admin_port_auth:
            guards.append(key_guard(admin_key_hashes(self.settings.admin_keys)))
        app = web.Application(middlewares=guards)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/pod", self._pod)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_get("/{path:.*}", self._from_worker_0)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _get(self, port: int, request: web.Request, path: str) -> tuple[bytes, str]:
        assert self._session is not None
        url = f"http://{LOOPBACK}:{port}{path}"
        async with self._session.get(url, headers=_forwarded(request)) as response:
            response.raise_for_status()
            return await response.read(), response.headers.get("content-type", "text/plain")

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            pages = await asyncio.gather(*(self._get(p, request, "/metrics") for p in self.ports))
        except aiohttp.ClientResponseError as exc:
            if exc.status in (401, 403):  # the workers' refusal is the pod's
                return web.json_response({"error": exc.message}, status=exc.status)
            return web.Response(status=503, text=f"a worker's /metrics did not answer: {exc}\n")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.Response(status=503, text=f"a worker's /metrics did not answer: {exc}\n")
        body = merge([page.decode() for page, _ in pages])
        return web.Response(body=body, headers={"content-type": pages[0][1]})

    async def _pod(self, request: web.Request) -> web.Response:
        workers = [
            {"index": i, "pid": pid, "admin_port": port}
            for i, (pid, port) in enumerate(zip(self.pids, self.ports, strict=False))
        ]
        return web.json_response({"workers": workers})

    async def _reset(self, request: web.Request) -> web.Response:
        """Every worker resets (each forwards to the engines and forgets what they held, in its
        own state): `{url: status}` with each engine's worst status over the workers, 200 only
        when every worker's was; a refusal (401, 403, 404) or a silent worker (503) passes
        through as the first worker to say it said it."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=RESET_TIMEOUT_S)

        async def one(port: int) -> tuple[int, bytes]:
            assert self._session is not None
            url = f"http://{LOOPBACK}:{port}{request.path_qs}"
            try:
                async with self._session.post(
                    url, headers=_forwarded(request), timeout=timeout
                ) as response:
                    return response.status, await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                return 503, orjson.dumps({"error": f"a worker did not answer: {exc}"})

        answers = await asyncio.gather(*(one(port) for port in self.ports))
        refused = next(((s, b) for s, b in answers if s not in (200, 502)), None)
        if refused is not None:  # no key, an unknown replica, a worker away: as it was said
            return web.Response(status=refused[0], body=refused[1], content_type="application/json")
        statuses: dict[str, int] = {}
        for _, page in answers:
            for url, engine_status in orjson.loads(page).items():
                statuses[url] = max(statuses.get(url, 0), int(engine_status))
        ok = all(s == 200 for s, _ in answers)
        return web.json_response(statuses, status=200 if ok else 502)

    async def _from_worker_0(self, request: web.Request) -> web.Response:
        try:
            body, content_type = await self._get(self.ports[0], request, request.path_qs)
        except aiohttp.ClientResponseError as exc:
            return web.Response(status=exc.status)
        except (aiohttp.ClientError, TimeoutError):
            return web.Response(status=503, text="worker 0 did not answer\n")
        return web.Response(body=body, headers={"content-type": content_type})


FORWARDED_HEADERS = ("authorization", "cookie")
"""What a worker is told of the pod's request: its key (a bearer key, or the console's cookie)."""


def _forwarded(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
