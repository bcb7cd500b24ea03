"""The director: serve one request, admit → route → forward → record (GIE `Director`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from cachemap.keys import BlockHash
from gateway.directory.routing import RoutingDirectory
from gateway.errors import InvalidRequest, ModelNotFound, NoReplica, TooManyInFlight, UpstreamError
from gateway.fleet.replicas import Lease, ReplicaSet, ReplicaState
from gateway.observability.histograms import LOOKUP_BUCKETS_S, LabelledHistograms
from gateway.pipeline.adapters import AdapterRouting
from gateway.pipeline.admission import Admission
from gateway.pipeline.disagg import Disaggregation, PrefillLeg, PrefillUsage
from gateway.pipeline.exchange import Exchange, ExchangeHooks
from gateway.pipeline.flights import Flight
from gateway.pipeline.flow import NO_TICKET, FlowControl, Ticket, request_priority
from gateway.pipeline.forwarder import (
    Complete,
    Forwarder,
    Passthrough,
    RetryableFailure,
    Streaming,
)
from gateway.pipeline.frontier import Frontiers
from gateway.pipeline.keying import Keyed, Keying
from gateway.pipeline.payload import splice_fields
from gateway.pipeline.placement import Placed, Placement
from gateway.pipeline.relayed import LandFlight, Pick
from gateway.request.cache_control import strip_marks
from gateway.request.parsed import CHAT, COMPLETION, ParsedRequest
from gateway.request.state import AbandonedHook, LandedHook, RequestHook, Routed, RoutedHook
from gateway.request.tenant import Tenant
from gateway.request.tokens import TokenEstimator
from gateway.request.trace import AttemptTrace, NoTracer, RequestTrace, Tracer
from router.ahead import place_ahead, ties_by_id
from router.capacity import within_capacity
from router.profile import RoutingProfile
from router.types import Replica, RouteRequest

log = logging.getLogger(__name__)

DP_RANK_HEADER = "X-data-parallel-rank"
"""vLLM's header choosing the data-parallel rank of an engine whose ranks share one port."""
_PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}


def engine_streams(body: dict[str, Any]) -> bool:
    """Whether an engine can stream this request (vLLM refuses `prompt_logprobs`, and beam
    search or `best_of` > 1 with `stream: true`): such a request is forwarded unstreamed, and
    the first-byte timeout bounds its whole answer."""
    if body.get("use_beam_search") or body.get("prompt_logprobs") is not None:
        return False
    best_of = body.get("best_of")
    return not (isinstance(best_of, int) and best_of > 1)


@dataclass
class DirectorStats:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    retries: int = 0
    adapter_loads: int = 0
    """LoRA adapters registered at the replica a request was routed to (`on_demand`)."""
    inflight_refused: int = 0
    """Requests refused (429) for their tenant's requests in flight (`Admission.enter`)."""
    refreshed_after_wait: int = 0
    """Precise requests whose events were read again after flow control's queue
    (`Keying.after_wait`)."""
    clients_cut: int = 0
    """Streams cut because their client did not read within the drain deadline."""
    lookup_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LOOKUP_BUCKETS_S)
    )
    """Directory lookups as the request path waits for them, by source (shared | local)."""


class Activity:
    """The requests inside the pipeline, from `Director.open` until their exchange finishes:
    what a drain waits for before billing and the directory are flushed and closed."""

    def __init__(self) -> None:
        self.num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> Callable[[], None]:
        """Count one request; the returned function ends it (once, however often called)."""
        self.num_active += 1
        self._idle.clear()
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.num_active -= 1
                if not self.num_active:
                    self._idle.set()

        return end

    async def idle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no request is inside; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class Director:
    def __init__(
        self,
        *,
        keying: Keying,
        admission: Admission,
        directory: RoutingDirectory,
        replicas: ReplicaSet,
        placement: Placement,
        policy: RoutingProfile,
        fallback_policy: RoutingProfile,
        forwarder: Forwarder,
        recorder: ExchangeHooks,
        estimator: TokenEstimator,
        max_attempts: int,
        request_hooks: Sequence[RequestHook] = (),
        routed_hooks: Sequence[RoutedHook] = (),
        landed_hooks: Sequence[LandedHook] = (),
        abandoned_hooks: Sequence[AbandonedHook] = (),
        tracer: Tracer | None = None,
        rng: random.Random | None = None,
        frontiers: Frontiers | None = None,
        flow: FlowControl | None = None,
        drain_timeout_s: float | None = None,
        adapters: AdapterRouting | None = None,
        disaggregation: Disaggregation | None = None,
    ) -> None:
        self.adapters = adapters
        """LoRA adapters' candidates, slots and loads (gateway.pipeline.adapters; None: off)."""
        self.disaggregation = disaggregation
        """A prefill/decode fleet (`gateway.pipeline.disagg`): routing picks the prefill
        instance, each attempt adds the decode leg (None: every replica serves whole)."""
        self.drain_timeout_s = drain_timeout_s
        """How long a stream waits for its client to read before it is cut (`Exchange.drain`)."""
        self.keying = keying
        self.flow = flow
        """Fair flow control's queue between admission and routing (None: off)."""
        self.frontiers = frontiers
        """Precise mode with `cache_pressure`: each replica's eviction frontier (None: off)."""
        self.keys = keying.keys
        self.admission = admission
        self.directory = directory
        self.replicas = replicas
        self.placement = placement
        self.policy = policy
        self.fallback_policy = fallback_policy
        self.forwarder = forwarder
        self.recorder = recorder
        self.estimator = estimator
        self.max_attempts = max_attempts
        self.request_hooks = list(request_hooks)
        self.routed_hooks = list(routed_hooks)
        self.landed_hooks = list(landed_hooks)
        self.abandoned_hooks = list(abandoned_hooks)
        self.tracer: Tracer = tracer or NoTracer()
        self.rng = rng or random.Random()
        self.stats = DirectorStats()
        self.activity = Activity()
        self._sequence = itertools.count()

    async def open(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        trace_headers: dict[str, str] | None = None,
        client_left: Callable[[], Awaitable[object]] | None = None,
    ) -> Exchange | Passthrough:
        """Serve one request up to its commitment: an exchange whose first byte has arrived, or
        an engine's 4xx to pass through. `trace_headers`: the client's W3C trace context.
        `client_left()`: returns when the client disconnects (watched while it waits for room).

        1. Admit: the tenant's scope, model and size; the request hooks (billing's checks) with
           the scoped tenant, and the size again if they expanded the prompt; then the fleet
           (404, 503), the priority, then the rate limit; then, when the fleet has no room,
           wait in flow control's queue for the scope's turn (gateway.pipeline.flow).
        2. Route: hash the canonical rendering in the tenant's scope, look up each replica's
           cached prefix, place it (fan-out holds, hot prefixes, the policy's ranking).
        3. Forward: the routed hooks (billing's start: after any hold), then the ranking in
           order until an attempt commits.
        4. Record: the exchange's hooks (`gateway.pipeline.record`): after the first token the
           prompt's blocks are on the replica that answered; the usage passes the observers.
        """
        opened_s = time.monotonic()
        trace = self.tracer.begin(parsed, tenant, trace_headers)
        ended = self.activity.begin()
        try:
            candidates, tenant, parsed, charged, left = await self._admit(parsed, tenant)
            ended = _both(ended, left)
            routed, flight = await self._route(
                parsed,
                tenant,
                candidates,
                trace,
                opened_s,
                charged,
                flow=self.flow,
                client_left=client_left,
            )
            if flight is None:
                opened = await self._forward(routed, trace)
            else:
                opened = await self._lead(flight, routed, trace)
        except BaseException as exc:
            ended()
            trace.failed(exc)
            raise
        if isinstance(opened, Exchange):
            exchange = opened

            def closed() -> None:
                if exchange.cut:
                    self.stats.clients_cut += 1
                ended()

            opened.on_closed = closed
        else:
            ended()
        return opened

    async def pick(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        trace_headers: dict[str, str] | None = None,
        *,
        only: Collection[str] | None = None,
        relay_usage: bool = True,
        on_hold: Callable[[float], Awaitable[float | None]] | None = None,
    ) -> Pick:
        """Steps 1 and 2 for a request someone else forwards (Envoy, `gateway.api.epp`): the
        ranking to send it along, the body the engine must get, and the `Pick` whose response
        events feed the record step (`gateway.pipeline.relayed`).

        `only`: the replica ids the data plane allows (its subset hint; none eligible is a 503).
        `relay_usage`: the response comes back through us, so ask a stream for its usage.
        `on_hold`: awaited with the bound of a fan-out hold, or of flow control's queue, before
        the request waits; it returns how long the caller can wait (None: no bound of its own)."""
        opened_s = time.monotonic()
        trace = self.tracer.begin(parsed, tenant, trace_headers)
        ended = self.activity.begin()
        try:
            candidates, tenant, parsed, charged, left = await self._admit(parsed, tenant, only)
            ended = _both(ended, left)
            routed, flight = await self._route(
                parsed, tenant, candidates, trace, opened_s, charged, on_hold, flow=self.flow
            )
            if flight is not None and self.landed_hooks:
                # an Envoy-forwarded leader ends through its relayed events, which do not run
                # the abandoned hooks: with billing it lands at its first byte, as before
                flight.confirm = None
                flight.lands_on_events = False
            # the replicas still there after routing (a hold may outlast one: a rollout)
            ranking = [r for r in routed.decision.ranking if r in self.replicas.states]
            ranking = ranking[: self.max_attempts]
            if not ranking:
                if flight is not None:
                    self._lander(flight)(False, routed.decision.replica)
                raise NoReplica(f"no healthy replica serves model '{parsed.model}'")
        except BaseException as exc:
            ended()
            trace.failed(exc)
            raise
        for hook in self.routed_hooks:
            hook(routed)
        state = self.replicas.states[ranking[0]]
        uncached = self._capped(routed.route).uncached_tokens(ranking[0])
        attempt = trace.attempt(ranking[0], 1, uncached)
        payload, _ = self._upstream_payload(routed, relayed=True, ask_usage=relay_usage)
        land = None if flight is None else self._lander(flight)
        lease = state.lease(
            uncached, self.replicas.fleet.expected_output_tokens(_max_tokens(parsed))
        )
        return Pick(
            routed,
            payload,
            trace,
            attempt,
            lease,
            self.replicas,
            self.recorder,
            ranking,
            land,
            headers=_headers(routed, ranking[0], attempt),
            on_closed=ended,
        )

    def _lander(self, flight: Flight) -> LandFlight:
        """How a picked leader's flight ends: at its first token, or failed."""
        flights = self.placement.flights
        assert flights is not None

        def land(ok: bool, replica: str) -> None:
            flight.replica = replica  # Envoy's retry may have moved it
            flights.end(flight, ok=ok)

        return land

    # -- 1. admit --------------------------------------------------------------------------
    async def _admit(
        self, parsed: ParsedRequest, tenant: Tenant, only: Collection[str] | None = None
    ) -> tuple[list[ReplicaState], Tenant, ParsedRequest, int, Callable[[], None]]:
        """The replicas that may serve the request, the tenant as this request sees it (its
        end user's salt in a `user` scope), the request as the hooks left it, the tokens
        charged to its rate limit, and the end of its count in flight. Order: the tenant's
        scope, model and size (gateway.pipeline.admission), the request hooks (and the size of
        what they made), then the fleet (404, 503), then the tenant's requests in flight, then
        the rate limit, so a request that cannot be served spends no budget."""
        prompt_tokens = self.estimator.prompt_tokens(parsed, tenant=tenant.name)
        tenant = self.admission.check(parsed, tenant, prompt_tokens)
        rendered = parsed.rendered
        for hook in self.request_hooks:
            parsed = await hook(parsed, tenant)
        if parsed.rendered is not rendered:  # expanded (an explicit cached content): check again
            prompt_tokens = self.estimator.prompt_tokens(parsed, tenant=tenant.name)
            self.admission.check_size(parsed, tenant, prompt_tokens)
        candidates = self._serving(parsed.model)
        if self.adapters is not None:
            candidates = self.adapters.candidates(parsed.model, candidates)
        if not candidates:
            if not self.replicas.any_healthy():
                raise NoReplica("no healthy engine replica is available")
            allowed = tenant.policy.models  # never name a model the tenant may not use
            served = [m for m in self.replicas.models() if not allowed or m in allowed]
            raise ModelNotFound(parsed.model, served)
        check_output_budget(parsed, candidates)
        request_priority(parsed, tenant)  # a 400 before any budget is spent
        if only is not None:
            candidates = [c for c in candidates if c.id in only and c.healthy]
            if not candidates:
                raise NoReplica("no endpoint of the data plane's subset can serve this request")
        try:
            left = self.admission.enter(tenant)
        except TooManyInFlight:
            self.stats.inflight_refused += 1
            raise
        try:
            charged = await self.admission.acquire(parsed, tenant, prompt_tokens)
        except BaseException:
            left()
            raise
        return candidates, tenant, parsed, charged, left

    # -- 2. route --------------------------------------------------------------------------
    async def _route(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        candidates: list[ReplicaState],
        trace: RequestTrace,
        opened_s: float,
        charged: int,
        on_hold: Callable[[float], Awaitable[float | None]] | None = None,
        flow: FlowControl | None = None,
        client_left: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[Routed, Flight | None]:
        """Key the request, wait for room in the fleet (`flow`: flow control's turn, not for
        a fan-out sibling whose leader is in flight here: its hold is its wait, and it goes to
        the leader's replica), then place it. The caller takes the lease before its next
        await, so the flow ticket's claim hands over to the lease without a gap."""
        looked_up = [c.id for c in candidates]
        if self.disaggregation is not None:  # the decode pick counts each one's own prefix
            looked_up += [s.id for s in self.disaggregation.decode_pool(parsed.model)]
        keyed = await self.keying.key(parsed, tenant, looked_up, trace)
        lookup, hashes = keyed.lookup, keyed.hashes
        suspects = self.replicas.suspects()
        if suspects:  # they may have restarted: their entries count once their identity is known
            lookup.overlap = {r: d for r, d in lookup.overlap.items() if r not in suspects}
            lookup.last_use = {r: t for r, t in lookup.last_use.items() if r not in suspects}
            lookup.held = {r: h for r, h in lookup.held.items() if r not in suspects}
        if self.keying.last_on_events:
            source = "events"
        elif self.directory.shared is not None and not lookup.degraded:
            source = "shared"
        else:
            source = "local"
        self.stats.lookup_seconds.labels(source).observe(self.keying.last_lookup_s)
        peers, peer_rank = self.replicas.herd()  # a load tie as the peers' burst (router.herd)
        route = RouteRequest(
            num_blocks=len(hashes),
            num_prompt_tokens=keyed.num_prompt_tokens,
            overlap=lookup.overlap,
            tokens_per_block=keyed.tokens_per_block,
            affinity_key=keyed.affinity_key,
            sequence=next(self._sequence),
            decode_token_weight=self.keys.decode_token_weight,
            offloaded=keyed.offloaded,
            offload_cost=self.keys.offload_cost,
            claimed=keyed.claimed,
            home=keyed.home.replica if keyed.home is not None else None,
            home_blocks=keyed.home.depth_blocks if keyed.home is not None else 0,
            adapter_slots=(
                self.adapters.slots(parsed.model, candidates) if self.adapters is not None else {}
            ),
            committed=keyed.committed,
            peers=peers,
            peer_rank=peer_rank,
        )
        policy = self.fallback_policy if lookup.degraded else self.policy

        frontiers = self.frontiers if policy is self.policy else None

        def snapshot() -> list[Replica]:
            # the replicas serving the model now (a hold may outlast a replica: a rollout)
            now = [c.snapshot() for c in candidates if c.id in self.replicas.states]
            if frontiers is None:
                return now
            return frontiers.annotate(route, now, hashes, keyed.ranks)

        ticket = NO_TICKET
        if flow is not None:
            ticket = await self._wait_for_room(
                flow, parsed, tenant, candidates, self._capped(route), hashes, client_left, on_hold
            )
        registered: str | None = None
        placed = None
        view: Callable[[], Sequence[Replica]] = snapshot
        try:  # from the ticket on, whatever happens: its tokens leave transit (`routed`)
            route = self._after_wait(ticket, keyed, route, looked_up, parsed, tenant)
            await self.replicas.pace()  # with peers: after theirs of this instant (router.herd)
            # with peers: the requests looked up ahead placed first (router.ahead)
            registered, route, view = await self._ahead(route, policy, view, lookup.degraded)
            placed = await self.placement.place(
                policy,
                route,
                view,
                hashes,
                lookup,
                self.rng,
                on_hold=on_hold,
                pass_over=ticket.full,
                unpredicted=keyed.unpredicted,
            )
        finally:
            ticket.routed()
            self._decided(registered, placed)  # out of the list at this gateway's next write
        if placed is None:
            raise NoReplica(f"no healthy replica serves model '{parsed.model}'")
        if placed.new_k is not None and lookup.hot_key is not None:
            self.directory.set_k(lookup.hot_key, placed.new_k)
        if placed.uncount and lookup.hot_key is not None:
            self.directory.uncount(lookup.hot_key)
        decision = placed.decision
        self.keying.placed(keyed, decision.replica)
        chosen = self.replicas.states.get(decision.replica)
        if self.adapters is not None and chosen is not None:
            self.stats.adapter_loads += await self.adapters.placed(parsed.model, chosen)
        placed_with_marker = placed.flight is not None and placed.flight.placed
        if hashes and decision.replica not in keyed.unpredicted and not placed_with_marker:
            # the other gateways see where it went before its first token
            self.directory.place(decision.replica, hashes, lookup.overlap.get(decision.replica, 0))
        conversation = None
        if frontiers is not None:
            rank = keyed.ranks.get(decision.replica)
            matched = placed.route.overlap.get(decision.replica, 0)
            conversation = frontiers.placed(decision.replica, rank, hashes, matched)
        counter_key = (policy.name, decision.reason)
        self.stats.decisions[counter_key] = self.stats.decisions.get(counter_key, 0) + 1
        trace.decided(policy.name, decision, len(hashes))
        routed = Routed(
            parsed,
            tenant,
            hashes,
            placed.route,
            decision,
            lookup.last_use,
            opened_s=opened_s,
            routed_s=time.monotonic(),
            queued_s=ticket.queued_s,
            flow_charge=ticket.charge,
            admitted_tokens=charged,
            ranks=keyed.ranks,
            conversation=conversation,
            unpredicted=keyed.unpredicted,
            held=lookup.held,
        )
        if placed.flight is not None and self.landed_hooks:
            placed.flight.confirm = lambda: self._landed(routed)
        return routed, placed.flight

    async def _ahead(
        self,
        route: RouteRequest,
        policy: RoutingProfile,
        snapshot: Callable[[], Sequence[Replica]],
        degraded: bool,
    ) -> tuple[str | None, RouteRequest, Callable[[], Sequence[Replica]]]:
        """`route` registered with the shared load (`SharedLoad.register`, `router.ahead`):
        its id, the request as it is decided (ties by id with any request ahead) and the view
        it is decided on (the published load, with the requests ahead placed first in Redis's
        order). Without peers, off, on the local directory's lookup (`degraded`), or when Redis
        did not answer: no id and `route` and `snapshot` as they were."""
        if degraded or not self.replicas.looks_ahead:
            return None, route, snapshot
        # on the request path: the lookup's deadline (Redis's time), not the rounds' second
        deadline_s = self.directory.lookup_deadline_s(0)
        registered = await self.replicas.register_ahead(route, deadline_s)
        if registered is None:
            return None, route, snapshot
        rid, had, items = registered

        def published() -> list[Replica]:
            seen = snapshot()  # its filter and annotations; the load replaced by the published
            states = self.replicas.states
            view = [self.replicas.published(states[r.id], r) if r.id in states else r for r in seen]
            return place_ahead(policy, items, view)[0]

        return rid, ties_by_id(route) if had else route, published

    def _decided(self, registered: str | None, placed: Placed | None) -> None:
        if registered is not None:
            where = placed.decision.replica if placed is not None else None
            self.replicas.decided_ahead(registered, where)

    def _capped(self, route: RouteRequest) -> RouteRequest:
        """`route` as the load it puts on a replica is counted (a lease's pending prefill, flow
        control's room and affinity wait): in precise mode no replica saves more than its KV
        (`router.capacity`), which claims and landed leaders' prefixes do not know. The
        ranking reads `route` as it is: capped there too, the simulator's 16-token sessions
        read precise `cache_pressure` 0.6-0.8 points under approximate at 5-10% KV
        (docs/precise.md, "The live TTFT gap")."""
        if self.keying.precise is None:
            return route
        states = self.replicas.states
        return within_capacity(
            route,
            {rid: states[rid].kv_capacity_tokens() for rid in route.overlap if rid in states},
        )

    def _after_wait(
        self,
        ticket: Ticket,
        keyed: Keyed,
        route: RouteRequest,
        looked_up: list[str],
        parsed: ParsedRequest,
        tenant: Tenant,
    ) -> RouteRequest:
        """`route` as the events are now, for a request that waited in flow control's queue
        (`Keying.after_wait`), and in approximate mode at the token estimate learnt meanwhile
        (`Keying.resize_after_wait`); unchanged when it did not wait."""
        if ticket.queued_s <= 0:
            return route
        if self.keying.resize_after_wait(keyed, parsed, tenant):
            route = replace(
                route,
                num_prompt_tokens=keyed.num_prompt_tokens,
                tokens_per_block=keyed.tokens_per_block,
            )
        if not self.keying.after_wait(keyed, looked_up):
            return route
        self.stats.refreshed_after_wait += 1
        suspects = self.replicas.suspects()
        if suspects:
            overlap = keyed.lookup.overlap
            keyed.lookup.overlap = {r: d for r, d in overlap.items() if r not in suspects}
        home = keyed.home
        return replace(
            route,
            overlap=keyed.lookup.overlap,
            offloaded=keyed.offloaded,
            claimed=keyed.claimed,
            home=home.replica if home is not None else None,
            home_blocks=home.depth_blocks if home is not None else 0,
        )

    async def _wait_for_room(
        self,
        flow: FlowControl,
        parsed: ParsedRequest,
        tenant: Tenant,
        candidates: list[ReplicaState],
        route: RouteRequest,
        hashes: Sequence[BlockHash],
        client_left: Callable[[], Awaitable[object]] | None,
        on_hold: Callable[[float], Awaitable[float | None]] | None = None,
    ) -> Ticket:
        """Flow control's turn, counted in the request's least uncached prefill over the
        candidates: at once (no await) when the fleet has room and no one waits, or when a
        leader of this gateway is writing its prefix (the hold is its wait). `on_hold`: the
        endpoint picker's, awaited with the queue's bound before the request waits: it restarts
        Envoy's message timer (once per message, at most Envoy's `max_message_timeout`) and
        returns how long the stream is held, which bounds the wait (past it, the queue's
        429 / 503 rather than Envoy's 504)."""
        band = request_priority(parsed, tenant)
        uncached = min((route.uncached_tokens(c.id) for c in candidates), default=0.0)
        output_tokens = self.replicas.fleet.expected_output_tokens(_max_tokens(parsed))
        flights = self.placement.flights
        depth = max(route.overlap.values(), default=0)
        if flights is not None and flights.find(hashes, depth) is not None:
            return flow.sibling(tenant, band, uncached, output_tokens)
        cached = None
        if depth > 0:
            per_block, prompt = route.tokens_per_block, route.num_prompt_tokens
            cached = {
                c.id: min(route.overlap.get(c.id, 0) * per_block, prompt)
                for c in candidates
                if c.healthy
            }
        decode = (
            () if self.disaggregation is None else self.disaggregation.decode_pool(parsed.model)
        )
        ticket = flow.try_enter(tenant, band, uncached, output_tokens, candidates, cached, decode)
        if ticket is not None:
            return ticket
        max_wait_s = None
        if on_hold is not None:  # Envoy's timer: one restart per message, at most its maximum
            max_wait_s = await on_hold(flow.limits.max_queue_s)
        return await flow.wait(
            tenant, band, parsed.model, uncached, output_tokens, client_left, max_wait_s, cached
        )

    async def _landed(self, routed: Routed) -> None:
        """A leader's prefix is stored at its replica (its KV events): the landed hooks run
        before its siblings are released (billing: its entries are visible from now)."""
        for hook in self.landed_hooks:
            await hook(routed)

    # -- 3. forward ------------------------------------------------------------------------
    async def _lead(
        self, flight: Flight, routed: Routed, trace: RequestTrace
    ) -> Exchange | Passthrough:
        """Forward a fan-out leader: its siblings are released when its first byte is in (the
        engine has prefilled, the KV is written), whether or not its client streams, or when it
        fails — or earlier, when its replica's KV events report the prefix stored (after the
        landed hooks: `_landed`). Its first-token hook runs before the release, so what it
        wrote is visible (the directory's record, the billing ledger's entry) to every sibling
        it releases. A leader ending without a first token runs the abandoned hooks (billing
        bills a leader it admitted at its BlockStored as aborted)."""
        flights = self.placement.flights
        assert flights is not None
        landed = False
        try:
            opened = await self._forward(routed, trace)
            if isinstance(opened, Exchange):
                try:
                    await opened.first_token()
                except BaseException:
                    opened.abort()
                    await opened.finish()
                    raise
                landed = True
                flight.replica = opened.record.replica  # a retry may have moved it
            return opened
        finally:
            flights.end(flight, ok=landed)
            if not landed:
                for hook in self.abandoned_hooks:
                    hook(routed)

    def _upstream_payload(
        self, routed: Routed, *, relayed: bool = False, ask_usage: bool = True
    ) -> tuple[bytes, bool]:
        """What the engine is sent, and whether it is asked to stream: always, unless the
        request uses what engines cannot stream (`engine_streams`) or someone else relays the
        answer to the client as it comes (`relayed`: Envoy, which cannot assemble a stream into
        the JSON the client asked for). `ask_usage`: a stream is asked for its usage."""
        parsed = routed.parsed
        fields: dict[str, Any] = {"cache_salt": routed.tenant.cache_salt}
        stream = parsed.stream or (not relayed and engine_streams(parsed.body))
        if stream:
            fields["stream"] = True
            if ask_usage:
                fields["stream_options"] = {"include_usage": True}
        if parsed.raw is not None and not (parsed.breakpoints or parsed.prewarm):
            spliced = splice_fields(parsed.raw, parsed.body, fields)
            if spliced is not None:
                return spliced, stream
        body = dict(parsed.body)
        if parsed.breakpoints or parsed.prewarm:  # a front end that keeps cache hints in the body
            body = strip_marks(body)
            body["max_tokens"] = max(body.get("max_tokens") or 1, 1)
        body.update(fields)
        return orjson.dumps(body), stream

    async def _forward(self, routed: Routed, trace: RequestTrace) -> Exchange | Passthrough:
        """Commit an attempt (`_commit`); a client that does not stream may have its exchange
        moved to the next replica later (`Exchange.complete`), within the same attempts. The
        routed hooks run first: routing, and any hold, has ended."""
        for hook in self.routed_hooks:
            hook(routed)
        payload, stream = self._upstream_payload(routed)
        tried: list[str] = []
        failures: list[str] = []
        leg = PrefillLeg() if self.disaggregation is not None else None
        committed = await self._commit(routed, trace, payload, stream, tried, failures, leg)
        if isinstance(committed, Passthrough):
            return committed
        lease, opened, attempt = committed
        reforward = None
        if not routed.parsed.stream:

            async def reforward() -> tuple[Lease, Complete | Streaming]:
                nonlocal attempt
                attempt.failed(UpstreamError("the engine's stream failed; moved"))
                again = await self._commit(routed, trace, payload, stream, tried, failures, leg)
                if isinstance(again, Passthrough):  # an engine refusing what another took
                    raise UpstreamError(f"an engine refused the retried request ({again.status})")
                lease, opened, attempt = again
                return lease, opened

        return Exchange(
            self.recorder if leg is None else PrefillUsage(self.recorder, leg),
            routed,
            lease,
            trace,
            opened,
            reforward=reforward,
            drain_timeout_s=self.drain_timeout_s,
            max_body_bytes=self.forwarder.max_body_bytes,
        )

    async def _commit(
        self,
        routed: Routed,
        trace: RequestTrace,
        payload: bytes,
        stream: bool,
        tried: list[str],
        failures: list[str],
        leg: PrefillLeg | None = None,
    ) -> tuple[Lease, Complete | Streaming, AttemptTrace] | Passthrough:
        """Walk the replicas (`_order`) until an attempt commits; a retryable failure moves on
        (a connection failure also marks the replica down). At most `max_attempts` in all.
        With `leg` (a disaggregated fleet) each attempt is a prefill and a decode leg, and the
        decode instance's lease is the one kept."""
        path = _PATHS[routed.parsed.kind]
        output_tokens = self.replicas.fleet.expected_output_tokens(_max_tokens(routed.parsed))
        for state in self._order(routed, tried):
            if len(tried) >= self.max_attempts:
                break
            replica_id = state.id
            tried.append(replica_id)
            uncached = self._capped(routed.route).uncached_tokens(replica_id)
            upstream = trace.attempt(replica_id, len(tried), uncached)
            # a prefill instance generates one token: the decode instance's lease carries the
            # output, and the prefill's ends with its leg (`Disaggregation.attempt`)
            disaggregated = leg is not None and self.disaggregation is not None
            with state.lease(uncached, 0.0 if disaggregated else output_tokens) as lease:
                headers = _headers(routed, replica_id, upstream)
                try:
                    if leg is None or self.disaggregation is None:
                        outcome = await self.forwarder.attempt(
                            state.url + path, payload, stream, headers
                        )
                    else:
                        outcome, kept = await self.disaggregation.attempt(
                            routed, state, path, payload, stream, headers, output_tokens, leg, lease
                        )
                        if kept is not None:
                            assert not isinstance(outcome, Passthrough)
                            return kept, outcome, upstream  # the prefill's lease ends here
                except RetryableFailure as exc:
                    upstream.failed(exc)
                    failures.append(f"{replica_id}: {exc}")
                    if exc.connection:
                        self.replicas.mark_down(replica_id, str(exc))
                    self.stats.retries += 1
                    log.warning("attempt %d at %s failed: %s", len(tried), replica_id, exc)
                    continue
                except BaseException as exc:
                    upstream.failed(exc)
                    raise
                if isinstance(outcome, Passthrough):
                    trace.passthrough(outcome.status)
                    return outcome
                return lease.keep(), outcome, upstream
        if not tried:
            raise NoReplica(f"no healthy replica serves model '{routed.parsed.model}'")
        # the client learns how many attempts failed, never which replica or what it said
        # (each failure is logged above, with both)
        raise UpstreamError(
            f"every attempt at an engine failed ({len(failures)} attempts); try again"
        )

    def pools(self, model: str) -> tuple[list[ReplicaState], ...]:
        """The pools flow control counts room in for a request of `model`: the replicas routing
        picks from, and, in a disaggregated fleet, its decode pool."""
        if self.disaggregation is None:
            return (self._serving(model),)
        return self._serving(model), self.disaggregation.decode_pool(model)

    def _serving(self, model: str) -> list[ReplicaState]:
        """The replicas routing picks from: those serving the model (in a disaggregated fleet,
        its prefill instances: the decode pick is the attempt's second leg)."""
        serving = self.replicas.serving(model)
        if self.disaggregation is None:
            return serving
        return [s for s in serving if not self.disaggregation.is_decode(s.id)]

    def _order(self, routed: Routed, tried: Sequence[str]) -> Iterator[ReplicaState]:
        """The replicas to try, read as each attempt starts (an attempt awaits, and routing may
        have waited seconds behind a fan-out leader): the ranking, skipping replicas tried or
        removed since (a rollout must cost no request) and trying those marked down last; then,
        when the ranking runs out, the replicas that joined since, ranked by the same policy."""
        ranking = routed.decision.ranking
        down: list[str] = []
        for replica_id in ranking:
            state = self.replicas.states.get(replica_id)
            if state is None or replica_id in tried:
                continue
            if not state.healthy:
                down.append(replica_id)
                continue
            yield state
        joined = [
            s for s in self._serving(routed.parsed.model) if s.healthy and s.id not in ranking
        ]
        if joined:
            decision = self.policy.decide(routed.route, [s.snapshot() for s in joined], self.rng)
            for replica_id in decision.ranking if decision is not None else ():
                state = self.replicas.states.get(replica_id)
                if state is not None and replica_id not in tried:
                    yield state
        for replica_id in down:
            state = self.replicas.states.get(replica_id)
            if state is not None and replica_id not in tried:
                yield state


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """One end for two counts (each of which ends once, however often called)."""

    def end() -> None:
        first()
        second()

    return end


def _headers(routed: Routed, replica: str, upstream: AttemptTrace) -> dict[str, str] | None:
    """The attempt's extra headers: its trace context, and the DP rank that holds the prefix."""
    headers = upstream.headers()
    rank = routed.ranks.get(replica)
    if rank is None:
        return headers
    return {**(headers or {}), DP_RANK_HEADER: str(rank)}


def _max_tokens(parsed: ParsedRequest) -> int | None:
    """The request's output budget, when it sets one."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = parsed.body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def check_output_budget(parsed: ParsedRequest, candidates: list[ReplicaState]) -> None:
    """An output budget no replica's context could hold (whatever the prompt) is a 400 in the
    gateway's words, not the engine's (which names its own limits and arithmetic). The bound is
    the largest `max_model_len` the serving replicas report on /v1/models."""
    limits = [c.max_model_len for c in candidates if c.max_model_len]
    budget = _max_tokens(parsed)
    if not limits or budget is None or budget < max(limits):
        return
    name = next(n for n in ("max_tokens", "max_completion_tokens") if parsed.body.get(n) == budget)
    raise InvalidRequest(
        f"'{name}' is {budget}; {parsed.model} holds at most {max(limits)} tokens of prompt and "
        "output together",
        param=name,
    )
