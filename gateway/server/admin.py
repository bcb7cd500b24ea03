"""The admin port: what operators and their tools read, never on the tenant-facing port.

    GET|HEAD /metrics        Prometheus exposition (the ServiceMonitor scrapes this port)
    GET      /openapi.json   the OpenAPI document of the tenant-facing HTTP routes
    GET      /docs, /redoc   that document rendered (Swagger UI, ReDoc)
    GET      /console[/...]  the operator's live console (gateway.server.console)
    POST     /reset_prefix_cache[?replica=URL]   every engine's (or one's) prefix cache reset
                             through the gateway, which stops routing on what they held before
                             the engines answer (`Keying.reset_prefix_cache`): {url: status}.
                             A write that costs every tenant its cache: it takes an `admin_keys`
                             key (`Authorization: Bearer KEY`; 401 without one, 403 when no
                             admin keys are configured), as the billing admin routes do.

With `admin_port_auth` every route takes that key (401 without): /metrics names every tenant's
token counts (`kvgate_tenant_tokens{tenant,kind}`), and the documents map the whole surface.

`/metrics` tells every tenant's token counts, hot-prefix rates and the replicas' queues, and
the documents map the whole surface, so none of them is served on `port`: they listen on
`metrics_port` (default 9090), which the Helm chart exposes on the pod for Prometheus but not
on the tenants' Service (docs/operations.md#admin-port). `HEAD /metrics` answers like GET
without the body (aiperf probes a metrics URL that way).

A small aiohttp server in the gateway's event loop (aiohttp is the upstream client already):
started and stopped by the app's lifespan, no signal handling of its own, nothing shared with
the request path but the registry it renders.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from gateway.request.tenant import hash_key
from gateway.server.console import Console
from gateway.tenancy.registry import bearer_key

log = logging.getLogger(__name__)

OPENAPI_PATH = "/openapi.json"
LOOPBACK = "127.0.0.1"


def admin_refusal(request: web.Request, admin_hashes: frozenset[str]) -> web.Response | None:
    """None for a request carrying an admin key; else the 401 / 403 that says what is missing
    (the pod's admin port asks the same of its requests: gateway.server.workers)."""
    if not admin_hashes:
        message = "no admin keys are configured (set admin_keys)"
        return web.json_response({"error": message}, status=403)
    key = bearer_key(request.headers.get("authorization"))
    if not key or hash_key(key) not in admin_hashes:
        log.warning("kvgate: admin port refused a %s without an admin key", request.path)
        message = "this needs an admin key: send it as 'Authorization: Bearer KEY'"
        return web.json_response({"error": message}, status=401)
    return None


CONSOLE_PREFIX = "/console"
"""The console checks the same keys itself, and also takes its sign-in cookie (a browser sends
no bearer key): the admin port's guard leaves its routes to it."""


def key_guard(admin_hashes: frozenset[str]) -> Any:
    """An aiohttp middleware: every route takes an admin key (`admin_port_auth`), but the
    console's, which do the same check themselves (with their sign-in cookie besides)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == CONSOLE_PREFIX or request.path.startswith(CONSOLE_PREFIX + "/"):
            return await handler(request)
        refusal = admin_refusal(request, admin_hashes)
        return refusal if refusal is not None else await handler(request)

    return guard


class AdminServer:
    """The admin listener of one gateway process."""

    def __init__(
        self,
        metrics: Callable[[], bytes],
        openapi: Callable[[], dict[str, Any]],
        title: str,
        reset: Callable[[str | None], Awaitable[dict[str, int]]] | None = None,
        admin_hashes: frozenset[str] = frozenset(),
        console: Console | None = None,
        every_route_needs_a_key: bool = False,
    ) -> None:
        self._console = console
        self._every_route_needs_a_key = every_route_needs_a_key
        self._metrics = metrics
        self._reset = reset
        self._admin_hashes = admin_hashes
        self._openapi = openapi
        self._title = title
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _app(self) -> web.Application:
        guards = [key_guard(self._admin_hashes)] if self._every_route_needs_a_key else []
        app = web.Application(middlewares=guards)
        app.router.add_get("/metrics", self._serve_metrics)  # HEAD too (aiohttp's allow_head)
        app.router.add_get(OPENAPI_PATH, self._serve_openapi)
        app.router.add_get("/docs", self._serve_docs)
        app.router.add_get("/redoc", self._serve_redoc)
        if self._reset is not None:
            app.router.add_post("/reset_prefix_cache", self._serve_reset)
        if self._console is not None:
            self._console.add_routes(app)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0: any free port); returns the port."""
        self._runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=False)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("kvgate: metrics and API documents on %s:%d", host, self.port)
        return self.port

    async def start_on(self, sock: socket.socket) -> int:
        """Listen on a socket already bound (a worker's, from its supervisor); returns the port."""
        self._runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.port = int(sock.getsockname()[1])
        log.info("kvgate: metrics and API documents on %s:%d", LOOPBACK, self.port)
        return self.port

    def _refusal(self, request: web.Request) -> web.Response | None:
        return admin_refusal(request, self._admin_hashes)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        body = self._metrics()
        # the classic text format, what `generate_latest` writes and every scraper reads
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_PLAIN_0_0_4})

    async def _serve_openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self._openapi()), content_type="application/json")

    async def _serve_docs(self, request: web.Request) -> web.Response:
        page = get_swagger_ui_html(openapi_url=OPENAPI_PATH, title=f"{self._title} - Swagger UI")
        return web.Response(body=bytes(page.body), content_type="text/html")

    async def _serve_redoc(self, request: web.Request) -> web.Response:
        page = get_redoc_html(openapi_url=OPENAPI_PATH, title=f"{self._title} - ReDoc")
        return web.Response(body=bytes(page.body), content_type="text/html")

    async def _serve_reset(self, request: web.Request) -> web.Response:
        assert self._reset is not None
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        statuses = await self._reset(request.query.get("replica"))
        if not statuses:
            return web.json_response({"error": "no such replica"}, status=404)
        ok = all(s == 200 for s in statuses.values())
        return web.json_response(statuses, status=200 if ok else 502)
