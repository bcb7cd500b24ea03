"""The composition root: `create_app(settings)` builds every part once (`build`), wires the
front ends to the pipeline, and returns the ASGI app whose lifespan starts the parts in order
and stops them in reverse (an `AsyncExitStack`: whatever started is stopped, whichever step of
the start-up failed).

Start order: the upstream `aiohttp.ClientSession` (explicit timeouts and connection limits) →
the shared directory (Redis) → billing → health probing → discovery → the tenants-file watcher →
the gRPC server → the endpoint picker's ext-proc server (`mode: epp`) → the admin port
(/metrics and the API documents, `gateway.server.admin`).

Stop (SIGTERM, `gateway.server.cli`): `Parts.begin_drain` stops the gRPC server taking RPCs as
uvicorn stops accepting connections; requests in flight get `shutdown_grace_s`; then the
lifespan stops the gRPC server, waits for the pipeline to empty (`_settle`), and closes the rest
in reverse: billing flushes its WAL and ships, the directory flushes its queued writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachemap.affinity import ConversationAffinity
from cachemap.events import EventIndex, domain_of, replica_of
from cachemap.layouts import EngineLayouts
from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.rates import PrefixRates
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.directory import RedisDirectory
from cachemap.redis.events import EventReader, EventWriter, Leases
from cachemap.redis.frontiers import SharedFrontiers
from cachemap.tokenizer import ModelTokenizer
from gateway.api.asgi import MeteredASGI, on_http_exception, on_unexpected
from gateway.api.context import FrontEnd
from gateway.api.epp.server import start_epp
from gateway.api.grpc.service import GrpcServer, start_grpc
from gateway.api.openai.routes import build_router
from gateway.api.openapi import install_openapi
from gateway.billing.service import Billing, admin_key_hashes
from gateway.deadline import LookupDeadline
from gateway.directory.routing import RoutingDirectory
from gateway.directory.sizing import DirectorySizer
from gateway.events.intake import EventIntake, FeedLimits
from gateway.events.layouts import LaidOutEvents
from gateway.events.precise import PreciseKeys, PromptTokens, TokenizerCheck
from gateway.fleet.discovery import Discovery, KubeTarget
from gateway.fleet.engine_metrics import EngineMetrics
from gateway.fleet.replicas import ReplicaSet
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import RequestMetrics, build_registry, render
from gateway.observability.recent import RecentRoutes
from gateway.observability.tracing import Tracing, build_tracing
from gateway.pipeline.adapters import AdapterRouting
from gateway.pipeline.admission import Admission
from gateway.pipeline.director import Director
from gateway.pipeline.disagg import Disaggregation
from gateway.pipeline.flights import Flights
from gateway.pipeline.flow import FlowControl, FlowLimits
from gateway.pipeline.flow_shared import SharedCounters
from gateway.pipeline.forwarder import Forwarder
from gateway.pipeline.frontier import FrontierObserver, Frontiers
from gateway.pipeline.keying import Keying, RouteKeys
from gateway.pipeline.placement import Placement
from gateway.pipeline.ratelimit import RateLimiter, TokenSettlement
from gateway.pipeline.reconcile import Reconciler
from gateway.pipeline.record import Recorder
from gateway.pipeline.upstream import UpstreamPool, origin
from gateway.request.state import ExchangeObserver
from gateway.request.tokens import TokenEstimator
from gateway.server.admin import AdminServer
from gateway.server.collector import GatewayCollector
from gateway.server.console import Console
from gateway.server.workers import share_fleet_view, share_placements
from gateway.settings import Settings, redact_url
from gateway.tenancy.registry import TenantRegistry
from gateway.tenancy.tenant_file import TenantFileWatcher
from router.fairness import FairQueue
from router.filters import LoadBoundFilter
from router.overflow import OverflowConfig
from router.profile import RoutingProfile
from router.registry import (
    RouterConfig,
    affinity_weight_for,
    build_fallback,
    build_policy,
    frontier_reader,
    room_weight_for,
    stickiness_for,
)

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """Everything one gateway process is made of, built once from its settings."""

    settings: Settings
    tenants: TenantRegistry
    watcher: TenantFileWatcher | None
    directory: RoutingDirectory
    replicas: ReplicaSet
    discovery: Discovery | None
    forwarder: Forwarder
    limiter: RateLimiter
    billing: Billing | None
    request_metrics: RequestMetrics
    tracing: Tracing
    director: Director
    front: FrontEnd
    registry: CollectorRegistry
    keying: Keying | None = None
    intake: EventIntake | None = None
    """Precise mode's KV event feeds (None: events off)."""
    grpc: GrpcServer | None = None
    """The gRPC server while it runs (started by `run`)."""
    recent: RecentRoutes = field(default_factory=RecentRoutes)
    """The last exchanges' route receipts: the console's request lookup."""
    draining: bool = False

    def begin_drain(self) -> None:
        """SIGTERM (`gateway.server.cli`): stop taking work on every front end at once. HTTP
        stops accepting in uvicorn; the gRPC server here, its RPCs in flight given the same
        grace. `run` then waits for the pipeline to empty before it flushes and closes."""
        if self.draining:
            return
        self.draining = True
        log.info("kvgate: draining (grace %.0f s)", self.settings.shutdown_grace_s)
        if self.grpc is not None:
            self.grpc.drain()


def build_directory(settings: Settings) -> RoutingDirectory:
    """The routing directory a gateway of these settings runs (its in-process stores; the
    shared one is attached at start), also what `kvgate footprint` measures."""
    local = MemoryDirectory(
        MemoryIndex(
            capacity_blocks=settings.directory_capacity_blocks,
            ttl_s=settings.directory_ttl_s,
            whole_chains=True,  # a prompt's keys from its first block: lookups bisect
        )
    )
    return RoutingDirectory(
        local,
        deadline_s=settings.redis_deadline_s,
        deadline_per_block_s=settings.redis_deadline_per_block_s,
        deadline_cap_s=settings.redis_deadline_cap_s,
        write_deadline_s=settings.redis_write_deadline_s,
        rates=PrefixRates() if settings.overflow else None,
        track_writers=settings.fanout_hold and settings.redis_url is not None,
    )


def _replicas(
    settings: Settings,
    directory: RoutingDirectory,
    intake: Callable[[], EventIntake | None],
    estimator: TokenEstimator,
) -> ReplicaSet:
    async def on_restart(replica: str) -> None:
        events = intake()
        if events is not None:
            events.restarted(replica)
        await directory.forget(replica)

    return ReplicaSet(
        [*settings.engines, *settings.decode_engines],
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        unhealthy_after=settings.unhealthy_after,
        on_restart=on_restart,
        on_start_marker=directory.observe_start,
        on_kv_capacity=_sizer(settings, directory, estimator),
        scrape_metrics=settings.scrape_metrics,
        metrics_interval_s=settings.metrics_interval_s,
    )


def _sizer(
    settings: Settings, directory: RoutingDirectory, estimator: TokenEstimator
) -> Callable[[str, EngineMetrics], None] | None:
    """Each replica's directory capped at its engine's reported KV, converted at the bytes a
    token the gateway learned from every response (`gateway.directory.sizing`); None: off."""
    if not settings.directory_size_from_engines:
        return None
    sizer = DirectorySizer(
        directory,
        lambda: estimator.fleet_bytes_per_token,
        settings.directory_capacity_blocks,
        dp_size=settings.engine_dp_size,
        block_bytes=settings.block_bytes,
    )

    def size(replica: str, metrics: EngineMetrics) -> None:
        block_size = metrics.kv_block_size or settings.engine_block_size
        sizer.engine(replica, metrics.num_gpu_blocks, block_size)

    return size


def _peer_closed(replicas: ReplicaSet, key: tuple[str, int, bool]) -> None:
    """An engine ended a keep-alive connection it had let us keep: it may have restarted."""
    for url in list(replicas.states):
        if origin(url)[:3] == key:
            replicas.suspect(url, "it closed a kept-alive connection")


def _discovery(
    settings: Settings, replicas: ReplicaSet, directory: RoutingDirectory, layouts: EngineLayouts
) -> Discovery | None:
    if settings.discovery != "kubernetes":
        return None
    target = KubeTarget(
        label_selector=settings.discovery_label_selector or "",
        namespace=settings.discovery_namespace,
        port_name=settings.discovery_port_name,
        scheme=settings.discovery_scheme,
        kubeconfig=settings.kubeconfig,
        watch_timeout_s=settings.discovery_watch_timeout_s,
        retry_s=settings.discovery_retry_s,
        pod_annotations=settings.discovery_pod_annotations,
        role_key=settings.discovery_role_key,
    )
    return Discovery(target, replicas, directory, layouts)


def _placement(settings: Settings, flights: Flights | None) -> Placement:
    overflow = None
    if settings.overflow:
        overflow = OverflowConfig(
            settings.engine_prefill_tokens_per_s,
            hot_share=settings.overflow_hot_share,
            fixed_threshold_per_min=settings.overflow_threshold_per_min,
        )
    return Placement(
        prefill_tokens_per_s=settings.engine_prefill_tokens_per_s,
        overflow=overflow,
        flights=flights,
        min_hold_tokens=settings.fanout_min_tokens,
        max_hold_s=settings.fanout_max_hold_s,
        bound=LoadBoundFilter(settings.absolute_slack_tokens, settings.relative_slack),
    )


def _flow(settings: Settings, replicas: ReplicaSet) -> FlowControl | None:
    """Fair flow control (issue 43; docs/flow-control.md), unless `flow_control` is off."""
    if not settings.flow_control:
        return None
    limits = FlowLimits(
        max_pending_prefill_tokens=settings.flow_max_pending_prefill_s
        * settings.engine_prefill_tokens_per_s,
        max_queued_per_scope=settings.flow_max_queued_per_scope,
        max_queued=settings.flow_max_queued,
        max_queue_s=settings.flow_max_queue_s,
        affinity_wait_s=settings.flow_affinity_wait_ms / 1000.0,
        prefill_tokens_per_s=settings.engine_prefill_tokens_per_s,
        lower_band_room_share=settings.flow_lower_band_room_share,
        measure_rate=settings.flow_measure_rate,
    )
    return FlowControl(
        replicas, limits, FairQueue(settings.flow_floor_share, settings.flow_decode_weight)
    )


def _precise(
    settings: Settings, replicas: ReplicaSet, layouts: EngineLayouts
) -> tuple[PreciseKeys | None, EventIntake | None]:
    """Precise mode's parts when `tokenizer_dir` is set; the intake when events are configured."""
    if settings.tokenizer_dir is None:
        return None, None
    try:
        tokenizer = ModelTokenizer(settings.tokenizer_dir)
    except ValueError as exc:
        raise ValueError(f"tokenizer_dir: {exc}") from None
    index = EventIndex(
        block_size=settings.engine_block_size, speculative_ttl_s=settings.speculative_ttl_s
    )
    intake = None
    annotated = settings.discovery == "kubernetes" and settings.discovery_pod_annotations
    if settings.kv_events_port is not None or settings.kv_events_endpoints or annotated:
        config = LaidOutEvents(
            port=settings.kv_events_port,
            replay_port=settings.kv_events_replay_port,
            endpoints=dict(settings.kv_events_endpoints),
            replay_endpoints=dict(settings.kv_events_replay_endpoints),
            topic=settings.kv_events_topic,
            dp_size=settings.engine_dp_size,
            layouts=layouts,
        )
        states = replicas.states

        def capacity(replica: str) -> int | None:
            state = states.get(replica)
            metrics = state.metrics if state is not None else None
            return metrics.num_gpu_blocks if metrics is not None else None

        limits = FeedLimits(
            settings.kv_events_max_message_bytes,
            settings.kv_events_drain_budget_s,
            settings.kv_events_max_blocks,
            capacity,
        )
        intake = EventIntake(config, index, lambda: list(replicas.states), limits=limits)
    keys = PreciseKeys(
        PromptTokens(tokenizer),
        index,
        intake,
        settings.engine_dp_size,
        layouts=layouts,
        adapters=dict(settings.lora_adapters),
        mm_tokens_per_image=settings.mm_tokens_per_image,
    )
    return keys, intake


def _frontiers(
    settings: Settings,
    policy: RoutingProfile,
    precise: PreciseKeys | None,
    intake: EventIntake | None,
    replicas: ReplicaSet,
) -> Frontiers | None:
    """Eviction frontiers for a policy that reads them (`cache_pressure`), in precise mode.
    With in-process events the event index keeps each domain's eviction order; in shared
    mode (`kv_events_shared`) the owners keep it and publish it, and the frontiers read it
    once the gateway has joined the index (`_share_events`; until then: no frontier)."""
    scorer = frontier_reader(policy)
    if scorer is None or precise is None or intake is None:
        return None
    if not settings.kv_events_shared:
        precise.index.track_recency = True
    states = replicas.states

    def capacity(replica: str) -> int | None:
        state = states.get(replica)
        metrics = state.metrics if state is not None else None
        return metrics.num_gpu_blocks if metrics is not None else None

    layouts, dp_size = precise.layouts, precise.dp_size
    return Frontiers(
        precise.index,
        scorer,
        capacity,
        (lambda replica: False) if settings.kv_events_shared else intake.live,
        lambda replica: layouts.dp_size(replica, dp_size),
    )


def build(settings: Settings, span_exporter: SpanExporter | None = None) -> Parts:
    """Construct every part; nothing is started and no socket is opened."""
    tenants = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants)
    watcher = None
    if settings.tenants_file is not None:
        watcher = TenantFileWatcher(
            settings.tenants_file, tenants, settings.tenants_reload_interval_s
        )
        watcher.load_now()  # an invalid file fails the start (TenantFileError)
    estimator = TokenEstimator(settings.bytes_per_token)
    billing = Billing(settings, estimator) if settings.billing_wal_dir is not None else None
    router_config = RouterConfig(
        absolute_slack_tokens=settings.absolute_slack_tokens,
        relative_slack=settings.relative_slack,
        consistent_hash_blocks=settings.consistent_hash_blocks,
        displacement_hot_s=settings.displacement_hot_s,
        displacement_half_life_s=settings.displacement_half_life_s,
        affinity_weight=affinity_weight_for(
            settings.affinity_weight, precise=settings.tokenizer_dir is not None
        ),
        stickiness=stickiness_for(settings.stickiness, precise=settings.tokenizer_dir is not None),
        room_weight=room_weight_for(
            settings.room_weight, precise=settings.tokenizer_dir is not None
        ),
    )
    policy = build_policy(settings.policy, router_config)
    directory = build_directory(settings)
    replicas = _replicas(settings, directory, lambda: intake, estimator)
    registry = build_registry()
    flights = None
    if settings.fanout_hold:
        flights = Flights(registry, shared=directory if settings.redis_url else None)
        directory.on_land = flights.notify
    placement = _placement(settings, flights)
    limiter = RateLimiter(settings.redis_url, settings.rate_limit_timeout_s)
    request_metrics = RequestMetrics()
    recent = RecentRoutes()
    reconciler = Reconciler(
        directory,
        settings.block_bytes,
        registry,
        block_tokens=settings.engine_block_size if settings.tokenizer_dir else None,
    )
    reconciler.on_contradicted = replicas.suspect  # a restart the connections did not show
    observers: list[ExchangeObserver] = [
        TokenSettlement(limiter),
        reconciler,
        *([billing.meter] if billing else []),
        request_metrics,
        AccessLog(),
        recent,
    ]
    tracing = build_tracing(settings, span_exporter)
    layouts = EngineLayouts()  # per-engine layouts from pod annotations (discovery writes)
    precise, intake = _precise(settings, replicas, layouts)  # before any probe: `intake` is bound
    if flights is not None and precise is not None and intake is not None:
        # a leader lands on its BlockStored; with billing its ledger entry becomes visible then
        # (the director's landed hook runs first: docs/billing.md#held-requests)
        on_stored = flights.stored
        precise.index.on_stored = lambda domain, keys: on_stored(replica_of(domain), keys)
    frontiers = _frontiers(settings, policy, precise, intake, replicas)
    if frontiers is not None:
        observers.append(FrontierObserver(frontiers))
    flow = _flow(settings, replicas)
    if flow is not None:
        observers.append(flow)  # settles each scope's charge with the engine's usage
    forwarder = Forwarder(
        settings.first_byte_timeout_s,
        settings.stream_idle_timeout_s,
        settings.upstream_max_body_bytes,
    )
    keying = Keying(
        RouteKeys(
            settings.block_bytes,
            settings.consistent_hash_blocks,
            settings.decode_token_weight,
            settings.offload_cost,
        ),
        directory,
        estimator,
        precise,
        TokenizerCheck(settings.tokenizer_check_every) if precise is not None else None,
        lambda: forwarder.session,
        affinity=(
            ConversationAffinity(capacity=settings.affinity_capacity, ttl_s=settings.affinity_ttl_s)
            if policy.locality
            and max(
                router_config.affinity_weight, router_config.room_weight, router_config.stickiness
            )
            > 0
            else None
        ),
        room=router_config.room_weight > 0,
    )
    adapters = AdapterRouting(
        replicas,
        settings.lora_adapters,
        on_demand=settings.lora_loading == "on_demand",
        paths=settings.lora_adapter_paths,
        busy_s=settings.adapter_busy_s,
    )
    director = Director(
        keying=keying,
        admission=Admission(
            tenants,
            limiter,
            settings.max_prompt_bytes,
            settings.effective_tenant_max_inflight(),
            is_adapter=adapters.is_adapter,
        ),
        directory=directory,
        replicas=replicas,
        placement=placement,
        policy=policy,
        fallback_policy=build_fallback(settings.policy, router_config),
        forwarder=forwarder,
        recorder=Recorder(directory, estimator, observers),
        estimator=estimator,
        max_attempts=settings.max_attempts,
        request_hooks=[billing.meter.prepare] if billing else [],
        routed_hooks=[billing.meter.routed] if billing else [],
        landed_hooks=[billing.meter.landed] if billing else [],
        abandoned_hooks=[billing.meter.abandoned] if billing else [],
        tracer=tracing.tracer,
        rng=random.Random(settings.seed),
        frontiers=frontiers,
        flow=flow,
        drain_timeout_s=settings.client_drain_timeout_s,
        adapters=adapters,
        disaggregation=(
            Disaggregation(
                settings.decode_engines,
                replicas,
                forwarder,
                directory,
                random.Random(settings.seed),
                settings.pd_protocol,
                settings.pd_bootstrap_port,
            )
            if settings.decode_engines or settings.discovery_role_key is not None
            else None
        ),
    )
    discovery = _discovery(settings, replicas, directory, layouts)
    if flow is not None and director.disaggregation is not None:
        flow.pools = director.pools  # the prefill pool's queue, the decode pool's room
    if discovery is not None and director.disaggregation is not None:
        discovery.on_decode = director.disaggregation.set_discovered
    registry.register(
        GatewayCollector(
            stats=director.stats,
            replicas=replicas,
            directory=directory,
            placement=placement,
            metrics=request_metrics,
            discovery=discovery,
            precise=precise,
            check=keying.check,
            flow=director.flow,
            forwarder=forwarder,
            resets=lambda: keying.num_resets,
            spend=billing.meter.spend if billing else None,
        )
    )
    front = FrontEnd(
        pipeline=director,
        tenants=tenants,
        replicas=replicas,
        max_prompt_bytes=settings.max_prompt_bytes,
        debug_headers=settings.debug_headers,
        max_body_bytes=settings.max_body_bytes,
        body_read_timeout_s=settings.body_read_timeout_s,
    )
    return Parts(
        settings,
        tenants,
        watcher,
        directory,
        replicas,
        discovery,
        director.forwarder,
        limiter,
        billing,
        request_metrics,
        tracing,
        director,
        front,
        registry,
        keying,
        intake,
        recent=recent,
    )


def _share_events(parts: Parts, client: AnyRedis) -> EventReader | None:
    """`kv_events_shared`: the intake owns domains by lease and writes the event index in
    Redis; precise lookups read it (docs/precise.md, "Who ingests"). Returns the reader."""
    settings = parts.settings
    precise = parts.keying.precise if parts.keying is not None else None
    if not settings.kv_events_shared or precise is None:
        return None
    frontiers = parts.director.frontiers
    writer = None
    if parts.intake is not None:
        writer = EventWriter(
            client, block_size=settings.engine_block_size, track_recency=frontiers is not None
        )
        owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        parts.intake.share(
            writer, Leases(client, owner, settings.kv_events_lease_s), settings.kv_events_lease_s
        )
    reader = EventReader(client)
    reader.on_wipe = precise.index.clear  # its speculative entries go with the wipe
    precise.shared_deadline = LookupDeadline(
        settings.redis_deadline_s,
        settings.redis_deadline_per_block_s,
        settings.redis_deadline_cap_s,
    )
    precise.share(reader)
    if frontiers is not None and parts.intake is not None:  # the owners' order, shared
        shared = SharedFrontiers(client, reader, writer)
        layouts, dp_size = precise.layouts, precise.dp_size
        frontiers.index = shared
        frontiers.live = lambda replica: shared.live(
            domain_of(replica, 0, layouts.dp_size(replica, dp_size))
        )
        parts.intake.frontiers = shared
    return reader


def _share_load(parts: Parts, directory: RedisDirectory, events: EventReader | None) -> None:
    """The gateways' load shared on the directory's Redis, the peers' figures read in the
    lookups' round trip too: a rider on every lane a lookup goes down
    (`gateway.fleet.shared_load`)."""
    settings = parts.settings
    shared_load = parts.replicas.share_load(
        directory.client,
        settings.load_share_interval_s,
        settings.spread_herd,
        settings.herd_pace_ms / 1e3,
        settings.place_ahead,
    )
    directory.lane.rider = shared_load
    if events is not None:
        events.lane.rider = shared_load


SETTLE_S = 5.0
"""After the grace, requests cut by it finish their bookkeeping (an aborted record, a landed
marker) within milliseconds; 5 s bounds a stop that would otherwise wait on a stuck one."""


async def _settle(parts: Parts) -> None:
    if not await parts.director.activity.idle(SETTLE_S):
        log.warning(
            "kvgate: %d requests still inside after the drain; stopping anyway",
            parts.director.activity.num_active,
        )


async def _reset_prefix_caches(parts: Parts, replica: str | None) -> dict[str, int]:
    """The admin port's reset: every replica's (or `replica`'s) prefix cache, forwarded."""
    keying, session = parts.keying, parts.forwarder.session
    urls = [u for u in parts.replicas.states if replica is None or u == replica]
    if keying is None or session is None or not urls:
        return {}
    statuses = await asyncio.gather(*(keying.reset_prefix_cache(session, u) for u in urls))
    return dict(zip(urls, statuses, strict=True))


@contextlib.asynccontextmanager
async def run(parts: Parts, app: FastAPI) -> AsyncIterator[None]:
    """Start the parts in order; stop whatever started, in reverse, on the way out."""
    settings = parts.settings
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(parts.tracing.shutdown)  # flushes the spans still batched
        # reads are bounded by the forwarder (first byte, then each silence of a stream)
        timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s)
        connector = aiohttp.TCPConnector(
            limit=settings.upstream_max_connections, keepalive_timeout=30
        )
        session = await stack.enter_async_context(
            aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
        )
        parts.forwarder.session = session
        # the attempts' own connections (the relay splices them to the clients)
        pool = UpstreamPool(
            settings.upstream_max_connections,
            settings.connect_timeout_s,
            settings.upstream_max_header_bytes,
        )
        stack.callback(pool.close)
        parts.forwarder.pool = pool
        pool.on_peer_closed = functools.partial(_peer_closed, parts.replicas)
        stack.push_async_callback(parts.limiter.close)
        directory = parts.directory
        counters: SharedCounters | None = None
        if settings.redis_url:
            directory.shared = RedisDirectory(
                await open_redis(settings.redis_url, cluster=settings.redis_cluster),
                capacity_blocks=settings.directory_capacity_blocks,
                ttl_s=settings.directory_ttl_s,
            )
            directory.register([*settings.engines, *settings.decode_engines])
            events = _share_events(parts, directory.shared.client)
            if settings.share_load:
                _share_load(parts, directory.shared, events)
            flow = parts.director.flow
            if settings.flow_share_counters and flow is not None:
                counters = SharedCounters(
                    directory.shared.client, flow.queue, settings.flow_share_interval_s
                )
                flow.shared = counters
                counters.start()
        share_placements(settings, directory)  # --workers N: every local index sees the pod's
        stack.push_async_callback(directory.close)
        if counters is not None:  # its last round ends before the client closes (a round on a
            stack.push_async_callback(counters.stop)  # closed client opened one left unclosed)
        shared = parts.keying.precise.shared if parts.keying and parts.keying.precise else None
        if shared is not None:  # its speculative writes end before the client closes
            stack.push_async_callback(shared.close)
        await directory.start()
        if parts.billing is not None:
            stack.push_async_callback(parts.billing.stop)
            await parts.billing.start()
        stack.push_async_callback(parts.replicas.stop)
        share_fleet_view(settings, parts.replicas)  # --workers N: one prober per pod
        await parts.replicas.start(session)
        if parts.keying is not None:
            stack.push_async_callback(parts.keying.close)
        if parts.intake is not None:
            stack.push_async_callback(parts.intake.close)
            await parts.intake.start()
        # on the way out, before billing and the directory flush and close: the requests still
        # inside end (those cut at the grace need a moment to write their aborted records)
        stack.push_async_callback(_settle, parts)
        if parts.discovery is not None:
            stack.push_async_callback(parts.discovery.stop)
            await parts.discovery.start()
        if parts.watcher is not None:
            stack.push_async_callback(parts.watcher.stop)
            parts.watcher.start()
        if settings.grpc_port is not None:
            grpc_server = parts.grpc = await start_grpc(
                settings, parts.front, parts.request_metrics
            )
            stack.push_async_callback(grpc_server.stop)
            app.state.grpc_port = grpc_server.port
        if settings.mode == "epp":
            epp_server = await start_epp(settings, parts.front)
            stack.push_async_callback(epp_server.stop)
            app.state.epp_port = epp_server.port
        if settings.metrics_port is not None:
            admin_hashes = admin_key_hashes(settings.admin_keys)
            admin = AdminServer(
                lambda: render(parts.registry),
                lambda: app.openapi(),
                app.title,
                functools.partial(_reset_prefix_caches, parts),
                admin_hashes,
                console=Console(parts.registry, parts.recent, admin_hashes),
                every_route_needs_a_key=settings.admin_port_auth,
            )
            stack.push_async_callback(admin.stop)
            if settings.worker_admin_fd is not None:
                # a worker's admin socket is its supervisor's to read (gateway.server.workers)
                sock = socket.socket(fileno=settings.worker_admin_fd)
                app.state.metrics_port = await admin.start_on(sock)
            else:
                app.state.metrics_port = await admin.start(settings.host, settings.metrics_port)
        log_start_up(parts)
        yield


def log_start_up(parts: Parts) -> None:
    """The one line that says what this gateway is (a WARNING when a replica is down at start)."""
    settings = parts.settings
    healthy = sum(s.healthy for s in parts.replicas.states.values())
    total = len(parts.replicas.states)
    level = logging.INFO if healthy == total and total else logging.WARNING
    log.log(
        level,
        "kvgate: serving on http://%s:%d, %d/%d replicas healthy, policy %s, mode %s, "
        "keying %s, directory %s, %d tenant keys, billing %s, discovery %s, log format %s",
        settings.host,
        settings.port,
        healthy,
        total,
        parts.director.policy.name,
        settings.mode,
        keying_summary(parts),
        redact_url(settings.redis_url) if settings.redis_url else "in-process",
        len(parts.tenants),
        billing_summary(settings),
        settings.discovery,
        settings.log_format,
    )


def keying_summary(parts: Parts) -> str:
    """approximate (bytes), or precise with how many engine cache domains' KV events it reads"""
    precise = parts.keying.precise if parts.keying is not None else None
    if precise is None:
        return "approximate"
    if parts.intake is None:
        return "precise (KV events off: residency predicted)"
    shared = ", shared in Redis" if parts.settings.kv_events_shared else ""
    return f"precise ({len(parts.intake.feeds())} KV event feeds{shared})"


def billing_summary(settings: Settings) -> str:
    if settings.billing_wal_dir is None:
        return "off"
    store = redact_url(settings.billing_redis_url) if settings.billing_redis_url else "no store"
    return f"on (WAL {settings.billing_wal_dir}, {store})"


def create_app(settings: Settings, *, span_exporter: SpanExporter | None = None) -> MeteredASGI:
    """The gateway. `span_exporter` turns tracing on with that exporter (tests, or an exporter
    of your own); otherwise `settings.otlp_endpoint` decides (gateway.observability.tracing)."""
    parts = build(settings, span_exporter)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with run(parts, app):
            yield

    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        description="A multi-tenant, cache-aware routing gateway for LLM inference.",
        lifespan=lifespan,
        exception_handlers={Exception: on_unexpected, StarletteHTTPException: on_http_exception},
        # the documents are served on the admin port (gateway.server.admin), not to tenants
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    routes, hot = build_router(parts.front)
    app.include_router(routes)
    if parts.billing is not None:
        from gateway.api.billing import build_billing_router

        app.include_router(build_billing_router(parts.billing, parts.front))

    app.state.parts = parts
    app.state.begin_drain = parts.begin_drain
    app.state.director = parts.director
    app.state.replicas = parts.replicas
    app.state.tenants = parts.tenants
    app.state.tenants_watcher = parts.watcher
    app.state.rate_limiter = parts.limiter
    app.state.billing = parts.billing
    app.state.discovery = parts.discovery
    app.state.tracing = parts.tracing
    app.state.request_metrics = parts.request_metrics
    install_openapi(app)
    return MeteredASGI(app, hot, parts.request_metrics)
