"""The composition root: `create_app(settings)` builds every resource once; the lifespan
opens the one upstream `aiohttp.ClientSession` (explicit timeouts and connection limits), starts
health probing and (with `grpc_port`) the gRPC server in the same event loop, and stops them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.responses import Response

from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.rates import PrefixRates
from cachemap.redis.directory import RedisDirectory, open_redis
from gateway.api.grpc.service import start_grpc
from gateway.api.openai.routes import GatewayASGI, build_router, install_openapi
from gateway.directory.routing import RoutingDirectory
from gateway.fleet.discovery import Discovery, KubeTarget
from gateway.fleet.replicas import ReplicaSet
from gateway.observability.metrics import (
    MeteredASGI,
    RequestMetrics,
    build_registry,
    register_collector,
    render,
)
from gateway.observability.tracing import build_tracing
from gateway.pipeline.admission import Admission
from gateway.pipeline.director import Director
from gateway.pipeline.flights import Flights
from gateway.pipeline.forwarder import Forwarder
from gateway.pipeline.placement import Placement
from gateway.pipeline.ratelimit import RateLimiter
from gateway.pipeline.reconcile import Reconciler
from gateway.settings import Settings
from gateway.tenancy.registry import TenantRegistry
from gateway.tenancy.tenant_file import TenantFileWatcher
from router.filters import LoadBoundFilter
from router.overflow import OverflowConfig
from router.registry import RouterConfig, build_fallback, build_policy

log = logging.getLogger(__name__)


def create_app(settings: Settings, *, span_exporter: SpanExporter | None = None) -> GatewayASGI:
    """The gateway. `span_exporter` turns tracing on with that exporter (tests, or an exporter
    of your own); otherwise `settings.otlp_endpoint` decides (gateway.observability.tracing)."""
    billing = None
    if settings.billing_wal_dir is not None:  # billing (issue #7): on when a WAL dir is set
        from gateway.billing.service import Billing

        billing = Billing(settings)
    tenants = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants)
    watcher = None
    if settings.tenants_file is not None:
        watcher = TenantFileWatcher(
            settings.tenants_file, tenants, settings.tenants_reload_interval_s
        )
        watcher.load_now()  # an invalid file fails the start (TenantFileError)
    router_config = RouterConfig(
        absolute_slack_tokens=settings.absolute_slack_tokens,
        relative_slack=settings.relative_slack,
        consistent_hash_blocks=settings.consistent_hash_blocks,
    )
    policy = build_policy(settings.policy, router_config)
    rates = PrefixRates() if settings.overflow else None
    directory = RoutingDirectory(
        MemoryDirectory(
            MemoryIndex(
                capacity_blocks=settings.directory_capacity_blocks, ttl_s=settings.directory_ttl_s
            )
        ),
        deadline_s=settings.redis_deadline_s,
        write_deadline_s=settings.redis_write_deadline_s,
        rates=rates,
        track_writers=settings.fanout_hold and settings.redis_url is not None,
    )
    replicas = ReplicaSet(
        settings.engines,
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        unhealthy_after=settings.unhealthy_after,
        on_restart=directory.forget,
        on_start_marker=directory.observe_start,
        scrape_metrics=settings.scrape_metrics,
        metrics_interval_s=settings.metrics_interval_s,
    )
    discovery = (
        Discovery(
            KubeTarget(
                label_selector=settings.discovery_label_selector or "",
                namespace=settings.discovery_namespace,
                port_name=settings.discovery_port_name,
                scheme=settings.discovery_scheme,
                kubeconfig=settings.kubeconfig,
                watch_timeout_s=settings.discovery_watch_timeout_s,
                retry_s=settings.discovery_retry_s,
            ),
            replicas,
            directory,
        )
        if settings.discovery == "kubernetes"
        else None
    )
    forwarder = Forwarder()
    registry = build_registry()
    reconciler = Reconciler(directory, settings.block_bytes, registry)
    flights = None
    if settings.fanout_hold:
        flights = Flights(registry, shared=directory if settings.redis_url else None)
        directory.on_land = flights.notify
    placement = Placement(
        prefill_tokens_per_s=settings.engine_prefill_tokens_per_s,
        overflow=OverflowConfig(
            settings.engine_prefill_tokens_per_s, hot_share=settings.overflow_hot_share
        )
        if settings.overflow
        else None,
        fixed_threshold_per_min=settings.overflow_threshold_per_min,
        flights=flights,
        min_hold_tokens=settings.fanout_min_tokens,
        max_hold_s=settings.fanout_max_hold_s,
        bound=LoadBoundFilter(settings.absolute_slack_tokens, settings.relative_slack),
    )
    limiter = RateLimiter(settings.redis_url, settings.rate_limit_timeout_s)
    admission = Admission(tenants, limiter)
    request_metrics = RequestMetrics()
    traces = build_tracing(settings, span_exporter)
    director = Director(
        settings,
        directory,
        replicas,
        forwarder,
        policy,
        observers=[
            admission,
            reconciler,
            *([billing.meter] if billing else []),
            request_metrics,
        ],
        fallback_policy=build_fallback(settings.policy, router_config),
        placement=placement,
        admission=admission,
        request_hooks=[billing.meter.prepare] if billing else [],
        tracing=traces,
    )

    register_collector(registry, director, request_metrics, discovery)

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
            if discovery is not None:
                await discovery.start()
            if watcher is not None:
                watcher.start()
            grpc_server = None
            if settings.grpc_port is not None:
                try:
                    grpc_server = await start_grpc(settings, director, tenants, request_metrics)
                except BaseException:  # e.g. the port is taken: stop probing, fail the startup
                    if discovery is not None:
                        await discovery.stop()
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
                if watcher is not None:
                    await watcher.stop()
                if grpc_server is not None:
                    await grpc_server.stop()
                if discovery is not None:
                    await discovery.stop()
                await replicas.stop()
                await directory.close()
                await limiter.close()
                if billing is not None:
                    await billing.stop()
                traces.shutdown()  # flushes the spans still batched

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        description="A multi-tenant, cache-aware routing gateway for LLM inference.",
        lifespan=lifespan,
    )
    routes, hot = build_router(director, tenants)
    app.include_router(routes)
    if billing is not None:
        from gateway.api.billing import build_billing_router

        app.include_router(build_billing_router(billing, director, tenants))

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4")

    app.state.director = director
    app.state.tenants = tenants
    app.state.tenants_watcher = watcher
    app.state.rate_limiter = limiter
    app.state.billing = billing
    app.state.discovery = discovery
    app.state.tracing = traces
    app.state.request_metrics = request_metrics
    install_openapi(app)
    return MeteredASGI(app, hot, request_metrics)
