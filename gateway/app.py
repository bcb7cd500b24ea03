"""The composition root: `create_app(settings)` builds every resource once; the lifespan
opens the one upstream `aiohttp.ClientSession` (explicit timeouts and connection limits), starts
health probing and (with `grpc_port`) the gRPC server in the same event loop, and stops them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from fastapi import FastAPI
from starlette.responses import Response

from cachemap.memory import MemoryDirectory, MemoryIndex
from gateway.director import Director
from gateway.forwarder import Forwarder
from gateway.grpc_api import start_grpc
from gateway.http_api import GatewayASGI, build_router, install_openapi
from gateway.replicas import ReplicaSet
from gateway.settings import Settings
from gateway.telemetry import build_registry, render
from gateway.tenants import TenantRegistry
from router.registry import RouterConfig, build_policy

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> GatewayASGI:
    tenants = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants)
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
    director = Director(settings, directory, replicas, forwarder, policy)
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
            grpc_server = None
            if settings.grpc_port is not None:
                try:
                    grpc_server = await start_grpc(settings, director, tenants)
                except BaseException:  # e.g. the port is taken: stop probing, fail the startup
                    await replicas.stop()
                    raise
                app.state.grpc_port = grpc_server.port
            log.info(
                "kvgate: %d/%d replicas healthy, policy %s",
                sum(s.healthy for s in replicas.states.values()),
                len(replicas.states),
                policy.name,
            )
            try:
                yield
            finally:
                if grpc_server is not None:
                    await grpc_server.stop()
                await replicas.stop()
                await directory.close()

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
    install_openapi(app)
    return GatewayASGI(app, hot)
