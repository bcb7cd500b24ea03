"""The composition root: `create_app(settings)` builds every resource once; the lifespan
opens the one upstream `aiohttp.ClientSession` (explicit timeouts and connection limits), starts
health probing, and closes both."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from fastapi import FastAPI
from starlette.responses import Response

from cachemap.memory import MemoryDirectory, MemoryIndex
from gateway.admission import Admission
from gateway.director import Director
from gateway.forwarder import Forwarder
from gateway.http_api import GatewayASGI, build_router, install_openapi
from gateway.ratelimit import RateLimiter
from gateway.replicas import ReplicaSet
from gateway.settings import Settings
from gateway.telemetry import build_registry, render
from gateway.tenant_file import TenantFileWatcher
from gateway.tenants import TenantRegistry
from router.registry import RouterConfig, build_policy

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> GatewayASGI:
    tenants = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants)
    watcher = None
    if settings.tenants_file is not None:
        watcher = TenantFileWatcher(
            settings.tenants_file, tenants, settings.tenants_reload_interval_s
        )
        watcher.load_now()  # an invalid file fails the start (TenantFileError)
    policy = build_policy(
        settings.policy,
        RouterConfig(
            absolute_slack_tokens=settings.absolute_slack_tokens,
            relative_slack=settings.relative_slack,
            consistent_hash_blocks=settings.consistent_hash_blocks,
        ),
    )
    directory = MemoryDirectory(
        MemoryIndex(
            capacity_blocks=settings.directory_capacity_blocks, ttl_s=settings.directory_ttl_s
        )
    )
    replicas = ReplicaSet(
        settings.engines,
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        unhealthy_after=settings.unhealthy_after,
        on_restart=directory.forget,
    )
    forwarder = Forwarder()
    limiter = RateLimiter(settings.redis_url, settings.rate_limit_timeout_s)
    admission = Admission(tenants, limiter)
    director = Director(
        settings, directory, replicas, forwarder, policy, observers=[admission], admission=admission
    )
    registry = build_registry(director)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.connect_timeout_s,
            sock_read=settings.first_byte_timeout_s,
        )
        connector = aiohttp.TCPConnector(
            limit=settings.upstream_max_connections, keepalive_timeout=30
        )
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            forwarder.session = session
            await replicas.start(session)
            if watcher is not None:
                watcher.start()
            log.info(
                "kvgate: %d/%d replicas healthy, policy %s",
                sum(s.healthy for s in replicas.states.values()),
                len(replicas.states),
                policy.name,
            )
            try:
                yield
            finally:
                if watcher is not None:
                    await watcher.stop()
                await replicas.stop()
                await directory.close()
                await limiter.close()

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        description="A multi-tenant, cache-aware routing gateway for LLM inference.",
        lifespan=lifespan,
    )
    routes, hot = build_router(director, tenants)
    app.include_router(routes)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4")

    app.state.director = director
    app.state.tenants = tenants
    app.state.tenants_watcher = watcher
    app.state.rate_limiter = limiter
    install_openapi(app)
    return GatewayASGI(app, hot)
