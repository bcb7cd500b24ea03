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
from cachemap.redis import RedisDirectory, open_redis
from gateway.director import Director
from gateway.forwarder import Forwarder
from gateway.http_api import GatewayASGI, build_router, install_openapi
from gateway.reconcile import Reconciler
from gateway.replicas import ReplicaSet
from gateway.routing_directory import RoutingDirectory
from gateway.settings import Settings
from gateway.telemetry import build_registry, register_collector, render
from gateway.tenants import TenantRegistry
from router.registry import RouterConfig, build_fallback, build_policy

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> GatewayASGI:
    billing = None
    if settings.billing_wal_dir is not None:  # billing (issue #7): on when a WAL dir is set
        from gateway.billing.service import Billing

        billing = Billing(settings)
    tenants = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants)
    router_config = RouterConfig(
        absolute_slack_tokens=settings.absolute_slack_tokens,
        relative_slack=settings.relative_slack,
        consistent_hash_blocks=settings.consistent_hash_blocks,
    )
    policy = build_policy(settings.policy, router_config)
    directory = RoutingDirectory(
        MemoryDirectory(
            MemoryIndex(
                capacity_blocks=settings.directory_capacity_blocks, ttl_s=settings.directory_ttl_s
            )
        ),
        deadline_s=settings.redis_deadline_s,
        write_deadline_s=settings.redis_write_deadline_s,
    )
    replicas = ReplicaSet(
        settings.engines,
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        unhealthy_after=settings.unhealthy_after,
        on_restart=directory.forget,
        on_start_marker=directory.observe_start,
        scrape_metrics=settings.scrape_metrics,
    )
    forwarder = Forwarder()
    registry = build_registry()
    reconciler = Reconciler(directory, settings.block_bytes, registry)
    director = Director(
        settings,
        directory,
        replicas,
        forwarder,
        policy,
        observers=[reconciler, *([billing.meter] if billing else [])],
        fallback_policy=build_fallback(settings.policy, router_config),
        request_hooks=[billing.meter.prepare] if billing else [],
    )
    register_collector(registry, director)

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
            if settings.redis_url:
                directory.shared = RedisDirectory(
                    await open_redis(settings.redis_url, cluster=settings.redis_cluster),
                    capacity_blocks=settings.directory_capacity_blocks,
                    ttl_s=settings.directory_ttl_s,
                )
                directory.register(settings.engines)
            await directory.start()
            if billing is not None:
                await billing.start()
            await replicas.start(session)
            log.info(
                "kvgate: %d/%d replicas healthy, policy %s",
                sum(s.healthy for s in replicas.states.values()),
                len(replicas.states),
                policy.name,
            )
            try:
                yield
            finally:
                await replicas.stop()
                await directory.close()
                if billing is not None:
                    await billing.stop()

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        description="A multi-tenant, cache-aware routing gateway for LLM inference.",
        lifespan=lifespan,
    )
    routes, hot = build_router(director, tenants)
    app.include_router(routes)
    if billing is not None:
        from gateway.billing.routes import build_billing_router

        app.include_router(build_billing_router(billing, director, tenants))

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4")

    app.state.director = director
    app.state.billing = billing
    install_openapi(app)
    return GatewayASGI(app, hot)
