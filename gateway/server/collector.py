"""The gateway's `/metrics`: everything but the per-request counters is collected at scrape
time from the state the gateway keeps anyway — the director's decisions, the replica set, the
directory, placement and fan-out holds, discovery — so nothing on the request path touches a
prometheus_client metric object. The collector is given each part it reads (it is built by the
composition root, which knows them all). Every name is listed in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.billing.meter import TenantSpend
from gateway.directory.routing import RoutingDirectory
from gateway.events.metrics import counter_by, precise_families
from gateway.events.precise import PreciseKeys, TokenizerCheck
from gateway.fleet.discovery import Discovery
from gateway.fleet.replicas import ReplicaSet
from gateway.observability import histograms
from gateway.observability.metrics import RequestMetrics
from gateway.pipeline.director import DirectorStats
from gateway.pipeline.flow import AFFINITY_OUTCOMES, REJECT_REASONS, FlowControl
from gateway.pipeline.forwarder import Forwarder
from gateway.pipeline.placement import Placement

HOTTEST_SHOWN = 5
"""Hot prefixes exported by name (a label each): a handful keeps the cardinality bounded."""

DISCOVERY_EVENTS = (
    "lists",
    "relists_after_gone",
    "watches",
    "events",
    "errors",
    "joins",
    "leaves",
    "epochs",
    "sets_sent",
    "sets_applied",
    "takeovers",
)


class GatewayCollector(Collector):
    def __init__(
        self,
        *,
        stats: DirectorStats,
        replicas: ReplicaSet,
        directory: RoutingDirectory,
        placement: Placement,
        metrics: RequestMetrics,
        discovery: Discovery | None = None,
        precise: PreciseKeys | None = None,
        check: TokenizerCheck | None = None,
        flow: FlowControl | None = None,
        forwarder: Forwarder | None = None,
        resets: Callable[[], int] | None = None,
        spend: dict[str, TenantSpend] | None = None,
    ) -> None:
        self.spend = spend
        self.flow = flow
        self.forwarder = forwarder
        self.resets = resets
        self.precise = precise
        self.check = check
        self.stats = stats
        self.replicas = replicas
        self.directory = directory
        self.placement = placement
        self.metrics = metrics
        self.discovery = discovery

    def collect(self) -> Iterable[Any]:
        yield from self._requests()
        yield from self._replicas()
        yield from self._discovery()
        if self.precise is not None:
            yield from precise_families(self.precise, self.check)
        yield from self._routing()
        if self.resets is not None:
            yield CounterMetricFamily(
                "kvgate_prefix_cache_resets",
                "Engine prefix-cache resets this process forwarded that the engine took (200).",
                value=self.resets(),
            )
        if self.flow is not None:
            yield from self._flow(self.flow)

    def _flow(self, flow: FlowControl) -> Iterable[Any]:
        """Fair flow control (docs/flow-control.md): the queue by tenant and band (an end user
        of a `user`-scoped tenant counts under its tenant: labels stay as few as tenants)."""
        depth = GaugeMetricFamily(
            "kvgate_flow_queue_depth",
            "Requests waiting in the gateway for room in the fleet, by tenant and band.",
            labels=["tenant", "band"],
        )
        depths: dict[tuple[str, str], int] = {}
        for (scope, band_id), n in flow.queue.depths().items():
            key = (scope.partition("/")[0], str(band_id))
            depths[key] = depths.get(key, 0) + n
        for key, n in sorted(depths.items()):
            depth.add_metric(list(key), n)
        yield depth
        yield histograms.family(
            "kvgate_flow_queue_seconds",
            "Time requests dispatched from the queue waited in it, by tenant and band.",
            ["tenant", "band"],
            flow.stats.queue_seconds,
        )
        dispatched = CounterMetricFamily(
            "kvgate_flow_dispatched",
            "Requests let through to the router, by band and how: immediate (the fleet had "
            "room), queued, or sibling (a fan-out sibling held by its leader instead).",
            labels=["band", "how"],
        )
        for (band, how), n in sorted(flow.stats.dispatched.items()):
            dispatched.add_metric([band, how], n)
        yield dispatched
        rejects = CounterMetricFamily(
            "kvgate_flow_rejects",
            "Requests that left the queue undispatched, by reason: scope_full and "
            "scope_timeout (429), gateway_full and fleet_timeout (503), client_gone.",
            labels=["reason"],
        )
        for reason in REJECT_REASONS:
            rejects.add_metric([reason], flow.stats.rejects.get(reason, 0))
        yield rejects
        affinity = CounterMetricFamily(
            "kvgate_flow_affinity",
            "Requests whose cached replica had no room when the fleet had some: let through "
            "to it after waiting (waited), let through to the router past the affinity "
            "wait's bound (bound), or at once with no wait configured (no_wait).",
            labels=["outcome"],
        )
        for outcome in AFFINITY_OUTCOMES:
            affinity.add_metric([outcome], flow.stats.affinity.get(outcome, 0))
        yield affinity
        room = GaugeMetricFamily(
            "kvgate_replica_room_tokens",
            "Prompt tokens a replica can take before it has no room (flow control's bound "
            "minus the prefill queued on it).",
            labels=["replica"],
        )
        for replica, tokens in sorted(flow.room().items()):
            room.add_metric([replica], tokens)
        yield room
        yield GaugeMetricFamily(
            "kvgate_flow_transit_tokens",
            "Prompt tokens of requests dispatched from flow control and not yet placed.",
            value=flow.transit_tokens,
        )
        yield GaugeMetricFamily(
            "kvgate_flow_prefill_tokens_per_s",
            "The engines' prefill rate flow control counts progress and room at: measured from "
            "this gateway's first tokens (flow_measure_rate), else engine_prefill_tokens_per_s.",
            value=flow.prefill_tokens_per_s(),
        )
        fleet = flow.replicas.fleet
        yield counter_by(
            "kvgate_flow_prefills_timed",
            "First tokens flow control's prefill rate was measured from (measured), or not "
            "(behind_peers: other gateways' prefills were queued on the replica when it began).",
            "sample",
            {"measured": fleet.num_prefills, "behind_peers": fleet.num_prefills_unmeasured},
        )
        if flow.shared is not None:
            rounds = CounterMetricFamily(
                "kvgate_flow_shared_rounds",
                "Rounds of the fairness counters shared through Redis: ok, failed (Redis away: "
                "the service waits for the next round).",
                labels=["event"],
            )
            rounds.add_metric(["ok"], flow.shared.rounds)
            rounds.add_metric(["failed"], flow.shared.failed)
            yield rounds

    def _requests(self) -> Iterable[Any]:
        m = self.metrics
        requests = CounterMetricFamily(
            "kvgate_http_requests", "HTTP requests by route and status.", labels=["route", "status"]
        )
        for (route, status), n in sorted(m.http.items()):
            requests.add_metric([route, status], n)
        yield requests
        rpcs = CounterMetricFamily(
            "kvgate_grpc_requests",
            "gRPC calls by method and status code.",
            labels=["method", "code"],
        )
        for (method, code), n in sorted(m.grpc.items()):
            rpcs.add_metric([method, code], n)
        yield rpcs
        yield histograms.family(
            "kvgate_grpc_request_duration_seconds",
            "gRPC calls, arrival to the last message, by method.",
            ["method"],
            m.grpc_seconds,
        )
        yield histograms.family(
            "kvgate_http_request_duration_seconds",
            "HTTP requests, arrival to last byte, by route.",
            ["route"],
            m.http_seconds,
        )
        yield histograms.single(
            "kvgate_time_to_first_token_seconds",
            "Arrival at the director to the engine's first byte (all front ends).",
            m.ttft_seconds,
        )
        yield histograms.family(
            "kvgate_exchange_duration_seconds",
            "Arrival at the director to the end of the engine's answer, by outcome.",
            ["outcome"],
            m.exchange_seconds,
        )
        tokens = CounterMetricFamily(
            "kvgate_tenant_tokens",
            "Tokens by tenant: prompt, completion, cache_read (found cached by the engine), "
            "cache_written (prefilled and kept).",
            labels=["tenant", "kind"],
        )
        for (tenant, kind), n in sorted(m.tenant_tokens.items()):
            tokens.add_metric([tenant, kind], n)
        yield tokens
        if self.spend is not None:
            cost = CounterMetricFamily(
                "kvgate_tenant_cost_dollars",
                "Billing on: what the tenant's billed exchanges cost (basis=billed) and what the "
                "same exchanges would have cost with no caching (basis=without_caching).",
                labels=["tenant", "basis"],
            )
            for tenant, spent in sorted(self.spend.items()):
                cost.add_metric([tenant, "billed"], float(spent.cost))
                cost.add_metric([tenant, "without_caching"], float(spent.without_caching))
            yield cost

    def _replicas(self) -> Iterable[Any]:
        healthy = GaugeMetricFamily("kvgate_replica_healthy", "1 if healthy.", labels=["replica"])
        inflight = GaugeMetricFamily(
            "kvgate_replica_inflight", "Requests in flight.", labels=["replica"]
        )
        requests = CounterMetricFamily(
            "kvgate_replica_requests", "Attempts sent to the replica.", labels=["replica"]
        )
        pending = GaugeMetricFamily(
            "kvgate_replica_pending_prefill_tokens",
            "Prefill tokens this gateway sent whose first token has not come back.",
            labels=["replica"],
        )
        waiting = GaugeMetricFamily(
            "kvgate_engine_num_waiting",
            "Requests queued at the engine (every gateway's), as last scraped.",
            labels=["replica"],
        )
        running = GaugeMetricFamily(
            "kvgate_engine_num_running",
            "Requests running at the engine, as last scraped.",
            labels=["replica"],
        )
        kv_usage = GaugeMetricFamily(
            "kvgate_engine_kv_usage",
            "The engine's KV cache usage (1 = full), as last scraped.",
            labels=["replica"],
        )
        foreign = GaugeMetricFamily(
            "kvgate_replica_foreign_prefill_tokens",
            "Prefill work other gateways queued on the replica, as the router counts it "
            "(their shared load, and the engine's queue beyond it).",
            labels=["replica"],
        )
        suspect = GaugeMetricFamily(
            "kvgate_replica_suspect",
            "1 while the replica may have restarted: its directory entries are ignored until its "
            "identity is checked.",
            labels=["replica"],
        )
        capacity = GaugeMetricFamily(
            "kvgate_directory_capacity_entries",
            "Directory entries kept for the replica at most: directory_capacity_blocks, or what "
            "its engine's reported KV holds when that is smaller.",
            labels=["replica"],
        )
        index = self.directory.local.index
        suspicions = CounterMetricFamily(
            "kvgate_replica_suspicions",
            "Times the replica became suspect (a connection it ended or refused, an answer "
            "contradicting its prediction, a mark-down).",
            labels=["replica"],
        )
        for s in self.replicas.states.values():
            labels = [s.url]
            healthy.add_metric(labels, 1.0 if s.healthy else 0.0)
            suspect.add_metric(labels, 1.0 if s.suspect else 0.0)
            suspicions.add_metric(labels, s.suspicions)
            capacity.add_metric(labels, index.capacity_of(s.url))
            inflight.add_metric(labels, s.num_inflight)
            requests.add_metric(labels, s.num_requests)
            pending.add_metric(labels, s.pending_prefill_tokens)
            m = s.metrics
            if m is not None:
                for family, value in ((waiting, m.num_waiting), (running, m.num_running)):
                    if value is not None:
                        family.add_metric(labels, value)
                if m.kv_usage is not None:
                    kv_usage.add_metric(labels, m.kv_usage)
            if m is not None or s.peer is not None:
                peer = s.peer.prefill_tokens if s.peer is not None else 0.0
                foreign.add_metric(labels, s.snapshot().foreign_prefill_tokens + peer)
        yield from (healthy, inflight, requests, pending, waiting, running, kv_usage, foreign)
        yield from (suspect, suspicions, capacity)
        yield from self._pod_view()
        yield from self._shared_load()

    def _shared_load(self) -> Iterable[Any]:
        """With `redis_url`: the rounds publishing this gateway's load and reading its peers'."""
        shared = self.replicas.shared_load
        if shared is None:
            return
        rounds = CounterMetricFamily(
            "kvgate_load_shared_rounds",
            "Shared load rounds: ok, failed (Redis away or slow), malformed (peer entries "
            "skipped).",
            labels=["event"],
        )
        rounds.add_metric(["ok"], shared.rounds)
        rounds.add_metric(["failed"], shared.failed)
        rounds.add_metric(["malformed"], shared.malformed)
        yield rounds
        between = CounterMetricFamily(
            "kvgate_load_shared_calls",
            "Shared load between rounds: published (this gateway's figures written as it "
            "placed a request), read (the peers' read in a lookup's round trip).",
            labels=["call"],
        )
        between.add_metric(["published"], shared.published)
        between.add_metric(["read"], shared.rides)
        yield between
        yield GaugeMetricFamily(
            "kvgate_load_shared_peers",
            "Other gateways whose load the last shared load round counted.",
            shared.num_peers,
        )

    def _pod_view(self) -> Iterable[Any]:
        """`--workers N`: worker 0's datagrams of its probes' findings, the others' receipts
        (summed over the pod: one send per follower and datagram), the views gone silent."""
        sender, receiver = self.replicas.sender, self.replicas.receiver
        if sender is None and receiver is None:
            return
        datagrams = CounterMetricFamily(
            "kvgate_pod_view_datagrams",
            "Pod view datagrams (worker 0's probe and scrape findings): sent, dropped (a "
            "follower's full queue), received, malformed.",
            labels=["event"],
        )
        if sender is not None:
            datagrams.add_metric(["sent"], sender.sent)
            datagrams.add_metric(["dropped"], sender.dropped)
        if receiver is not None:
            datagrams.add_metric(["received"], receiver.received)
            datagrams.add_metric(["malformed"], receiver.malformed)
        yield datagrams
        if receiver is not None:
            yield CounterMetricFamily(
                "kvgate_pod_view_lapses",
                "Times worker 0's view went silent on replicas this worker then probed itself.",
                value=self.replicas.view_lapses,
            )

    def _discovery(self) -> Iterable[Any]:
        if self.discovery is None:
            return
        stats = self.discovery.stats
        yield GaugeMetricFamily(
            "kvgate_discovery_endpoints",
            "Engine endpoints in the watched EndpointSlices.",
            len(self.discovery.known),
        )
        events = CounterMetricFamily(
            "kvgate_discovery_events", "What discovery saw and did.", labels=["kind"]
        )
        for kind in DISCOVERY_EVENTS:
            events.add_metric([kind], getattr(stats, kind))
        yield events

    def _routing(self) -> Iterable[Any]:
        stats = self.stats
        decisions = CounterMetricFamily(
            "kvgate_routing_decisions",
            "Routing decisions by policy and reason.",
            labels=["policy", "reason"],
        )
        for (policy, reason), n in sorted(stats.decisions.items()):
            decisions.add_metric([policy, reason], n)
        yield decisions
        yield CounterMetricFamily(
            "kvgate_upstream_retries", "Attempts retried on another replica.", stats.retries
        )
        yield CounterMetricFamily(
            "kvgate_adapter_loads",
            "LoRA adapters this gateway asked a replica to load (lora_loading: on_demand).",
            stats.adapter_loads,
        )
        yield CounterMetricFamily(
            "kvgate_inflight_refused",
            "Requests refused for their tenant's requests in flight (tenant_max_inflight).",
            stats.inflight_refused,
        )
        yield CounterMetricFamily(
            "kvgate_clients_cut",
            "Streams cut: the client did not read within client_drain_timeout_s.",
            stats.clients_cut,
        )
        pool = self.forwarder.pool if self.forwarder is not None else None
        yield CounterMetricFamily(
            "kvgate_upstream_stray_connections",
            "Engine connections dropped for bytes no request asked for (or readable when idle).",
            pool.num_strays if pool is not None else 0,
        )
        dstats = self.directory.stats
        lookups = CounterMetricFamily(
            "kvgate_directory_lookups",
            "Directory lookups by where the answer came from.",
            labels=["source"],
        )
        lookups.add_metric(["shared"], dstats.shared_lookups)
        lookups.add_metric(["local"], dstats.lookups - dstats.shared_lookups)
        yield lookups
        yield CounterMetricFamily(
            "kvgate_directory_fallbacks",
            "Lookups answered locally because the shared directory did not answer in time.",
            dstats.fallbacks,
        )
        yield GaugeMetricFamily(
            "kvgate_directory_degraded",
            "1 while the shared directory is unavailable and routing is local.",
            1.0 if self.directory.degraded else 0.0,
        )
        yield CounterMetricFamily(
            "kvgate_directory_writes_dropped",
            "Records/drops that did not reach the shared directory.",
            self.directory.writes.num_dropped,
        )
        shared = self.directory.shared
        blocks = CounterMetricFamily(
            "kvgate_directory_record_blocks",
            "Blocks of the records this gateway sent to the shared directory (written), and the "
            "blocks they left as it held them: the replica's fresh held prefix (kept).",
            labels=["part"],
        )
        blocks.add_metric(["written"], shared.blocks_written if shared is not None else 0)
        blocks.add_metric(["kept"], shared.blocks_kept if shared is not None else 0)
        yield blocks
        lane = shared.lane if shared is not None else None
        yield CounterMetricFamily(
            "kvgate_directory_late_reads",
            "Shared lookups past their deadline whose reply was in, not yet read by this "
            "process's loop: answered, not a fallback.",
            lane.stats.late_answers if lane is not None else 0,
        )
        yield CounterMetricFamily(
            "kvgate_directory_lookup_timeouts",
            "Shared lookups that received nothing from Redis within their deadline (fallbacks "
            "the breaker counts).",
            lane.stats.timeouts if lane is not None else 0,
        )
        yield CounterMetricFamily(
            "kvgate_directory_lookup_lagged",
            "Shared lookups whose reply waited unread past the grace while this process's loop "
            "was busy (fallbacks the breaker does not count).",
            lane.stats.lagged if lane is not None else 0,
        )
        yield GaugeMetricFamily(
            "kvgate_directory_lookup_deadline_seconds",
            "A one-block shared lookup's deadline now: twice Redis's recent p99 round trip, "
            "between redis_deadline_s and redis_deadline_cap_s.",
            self.directory.lookup_deadline_s(1),
        )
        yield CounterMetricFamily(
            "kvgate_directory_local_hints",
            "Shared lookups the local index deepened (a miss in Redis, or during a write-back).",
            dstats.local_hints,
        )
        restored = self.directory.write_back.stats
        yield CounterMetricFamily(
            "kvgate_directory_write_backs",
            "Write-backs of the local index after Redis lost entries (reset or outage).",
            restored.runs,
        )
        yield CounterMetricFamily(
            "kvgate_directory_written_back_blocks",
            "Entries written back into Redis from the local index.",
            restored.blocks_written,
        )
        placement = self.placement
        yield CounterMetricFamily(
            "kvgate_overflow_widenings",
            "Hot prefixes spread over more replicas.",
            placement.stats.widenings,
        )
        yield CounterMetricFamily(
            "kvgate_overflow_shrinks",
            "Hot prefixes spread over fewer replicas.",
            placement.stats.shrinks,
        )
        yield CounterMetricFamily(
            "kvgate_overflow_spread_requests",
            "Requests routed with a hot prefix spread to replicas that did not hold it yet.",
            placement.stats.spread_requests,
        )
        yield CounterMetricFamily(
            "kvgate_overflow_sibling_holds",
            "Fan-out siblings kept on their holder (it had room) whatever their prefix's rate.",
            placement.stats.sibling_holds,
        )
        rates = self.directory.rates
        if rates is not None:
            k = GaugeMetricFamily(
                "kvgate_hot_prefix_replicas", "k of the hottest prefixes.", labels=["prefix"]
            )
            rate = GaugeMetricFamily(
                "kvgate_hot_prefix_rate_per_min",
                "Request rate of the hottest prefixes.",
                labels=["prefix"],
            )
            for prefix, observed in rates.hottest(HOTTEST_SHOWN):
                label = prefix.hex()[:16]
                k.add_metric([label], observed.k)
                rate.add_metric([label], observed.rate_per_min)
            yield k
            yield rate
        flights = placement.flights
        if flights is not None:
            yield CounterMetricFamily(
                "kvgate_fanout_holds", "Siblings held for an in-flight leader.", flights.stats.holds
            )
            releases = CounterMetricFamily(
                "kvgate_fanout_releases", "How held siblings were released.", labels=["reason"]
            )
            releases.add_metric(["landed"], flights.stats.released_landed)
            releases.add_metric(["leader_failed"], flights.stats.released_failed)
            releases.add_metric(["timeout"], flights.stats.timeouts)
            yield releases
            yield CounterMetricFamily(
                "kvgate_fanout_landed_on_events",
                "Fan-out leaders landed by their replica's BlockStored, before their first byte.",
                flights.stats.landed_on_events,
            )
        yield histograms.family(
            "kvgate_directory_lookup_seconds",
            "Directory lookups as the request path waited for them, by source (shared: Redis; "
            "local: in process, or the fallback while Redis is away; events: precise mode's "
            "KV events alone, every candidate's events flowing).",
            ["source"],
            stats.lookup_seconds,
        )
