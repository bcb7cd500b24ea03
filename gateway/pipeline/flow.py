"""Fair flow control: at saturation a request waits in the gateway, in its scope's queue, until
a replica has room; the fair queue (router.fairness) decides who goes next (docs/flow-control.md).

    admit ──▶ key (hash, look up) ──▶ flow control ──▶ place (the router picks) ──▶ forward
                                        │ room: dispatch at once (no await)
                                        │ a fan-out sibling of a leader in flight: its hold
                                        │   is its wait (placement), charged, not queued
                                        └ no room: wait in the scope's sub-queue
                                            ── a prefill ends / a tick ──▶ dispatch

A request is counted in the least uncached prefill over its candidates (the lookup is done
before it waits: the prefix a conversation has cached is already known), for the room it
takes and for its scope's counter. The replica loads the router compares are read when it
is placed, after the wait, and in precise mode the KV events too (`Keying.after_wait`).

Room (`router.fairness.headroom_tokens`): a replica has room while the prefill queued on it —
this gateway's unanswered prefills (`ReplicaState.pending_prefill_tokens`, less the progress of
the one in prefill since it began) and other gateways' requests waiting at the engine
(`vllm:num_requests_waiting`, counted through `Replica.foreign_prefill_tokens`) — is under
`max_pending_prefill_s` of work (progress and bound at the engines' prefill rate as this
gateway's first tokens measure it, `FlowControl.prefill_tokens_per_s`) — for a request of a
band below an active one, under `lower_band_room_share` of it (`router.fairness.band_room_bound`),
so a higher band's next request finds at most that share queued at the engine. A request
dispatched but not yet leased (it is still being keyed and placed) holds its prompt tokens in
`transit_tokens`, so a burst does not overshoot between its dispatch and its lease.

Wake-ups, while anything waits: a lease's prefill ending (`FleetLoad.on_freed`), a request let
through being placed (`Ticket.routed`: its lease now counts what its transit did), and a timer
at the moment the running prefills' progress brings a replica under the bound (`next_room_s`);
at the latest every `IDLE_TICK_S` (engine scrapes, health and the fleet change without a
lease), every `TICK_S` while a request waits for its full cached replica. A request let through
without a cached replica is placed among the replicas with room (its ticket's `full`).

The bounded affinity wait (`router.fairness.affinity_verdict`): when the fleet has room but
every replica holding the most of a request's prompt has none, the request waits for one of
them — up to `affinity_wait_s`, and never longer than the prefill that cache saves over the
best replica with room — and is let through the moment one has room (a lease's prefill ending
wakes the queue). Past the bound, it is let through and the router places it as any request,
its full cached replica still a candidate (passed over only by a request holding none of its
prompt there: `Ticket.full`), so the router's load bound weighs the cache against the load.
Others are not held up: a request waiting for its replica
is not eligible, so the queue serves the next one (work-conserving); requests of its own scope
wait behind it, as its sub-queue is in order.
Released for its replica, a request claims the room it takes there until it is placed
(`claimed`), so a burst released in one turn does not overfill the replica.

Bounded, nothing lost: a scope with `max_queued_per_scope` waiting gets a 429 with Retry-After
(its own backlog); a gateway with `max_queued` waiting, a 503 (the fleet is full for everyone).
A request that waited `max_queue_s` gets the 429 when it arrived behind requests of its own scope
(its backlog is why it waited) and the 503 otherwise. A client gone while queued is removed:
nothing reaches an engine, the gateway logs it, and it counts as a reject (`client_gone`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.errors import ClientGone, InvalidRequest, Overloaded, QueueFull
from gateway.fleet.replicas import ReplicaSet, ReplicaState
from gateway.observability.histograms import LATENCY_BUCKETS_S, LabelledHistograms
from gateway.request.parsed import ParsedRequest
from gateway.request.state import ExchangeRecord
from gateway.request.tenant import Tenant
from gateway.request.usage import EngineUsage
from router.fairness import (
    DEFAULT_LOWER_BAND_ROOM_SHARE,
    Affinity,
    BandActivity,
    FairQueue,
    Queued,
    affinity_verdict,
    band_room_bound,
    has_headroom,
    headroom_tokens,
)

if TYPE_CHECKING:
    from gateway.pipeline.flow_shared import SharedCounters

log = logging.getLogger(__name__)

TICK_S = 0.025
"""While a request waits for its full cached replica (the affinity wait), room is re-read every
25 ms: its bound (what its cache saves) moves with which replicas have room."""
IDLE_TICK_S = 0.1
"""Otherwise, while requests wait, room is re-read at the latest every 100 ms without an event
(a scrape's engine queue, once a second by default; a replica back up or joined). The events
that make room wake the queue themselves: a lease's prefill ending, a request let through
being placed (its tokens leave `transit_tokens`), and a timer at the moment the running
prefills' progress brings a replica under the bound (`next_room_s`)."""
MIN_TICK_S = 0.001
REJECT_REASONS = ("scope_full", "gateway_full", "scope_timeout", "fleet_timeout", "client_gone")
AFFINITY_OUTCOMES = ("waited", "bound", "no_wait")
"""A request whose cached replica was full: let through to it after waiting (`waited`), let
through past the wait's bound (`bound`: `affinity_wait_s` or what its cache saves), or at once
(`no_wait`: `affinity_wait_s` is 0). Past the bound the router places it as it places any
request, its full cached replica included (the router weighs the cache against the load)."""
NO_REPLICAS: frozenset[str] = frozenset()


def request_priority(parsed: ParsedRequest, tenant: Tenant) -> int:
    """The request's band: its `priority` (vLLM's field) within the tenant's allowed range, else
    the tenant's own; a value outside the range is a 400 naming the field."""
    priority = parsed.priority
    if priority is None:
        return tenant.policy.priority
    low, high = tenant.policy.allowed_priorities
    if not low <= priority <= high:
        allowed = f"{low}" if low == high else f"{low} to {high}"
        raise InvalidRequest(
            f"'priority' {priority} is outside what this API key may ask for ({allowed}; "
            "lower is served first)",
            param="priority",
        )
    return priority


@dataclass(frozen=True)
class FlowLimits:
    max_pending_prefill_tokens: float
    """A replica has room while its queued prefill is under this (tokens)."""
    max_queued_per_scope: int
    max_queued: int
    max_queue_s: float
    prefill_tokens_per_s: float
    """The configured rate (`engine_prefill_tokens_per_s`), at which `max_pending_prefill_tokens`
    is counted: with `measure_rate`, until the gateway has measured the engines' own."""
    affinity_wait_s: float = 0.0
    """How long a request may wait for its cached replica when that one is full (0: never)."""
    lower_band_room_share: float = DEFAULT_LOWER_BAND_ROOM_SHARE
    """The share of `max_pending_prefill_tokens` a band below an active one may fill (1: all)."""
    measure_rate: bool = True
    """Count progress, room, a Retry-After and what a cached prefix saves at the prefill rate
    this gateway measured (`FleetLoad.prefill_tokens_per_s`), the room bound in seconds of it;
    False: at `prefill_tokens_per_s` always."""


@dataclass
class FlowStats:
    dispatched: dict[tuple[str, str], int] = field(default_factory=dict)
    """(band, "immediate" | "queued" | "sibling") -> requests let through."""
    rejects: dict[str, int] = field(default_factory=dict)
    affinity: dict[str, int] = field(default_factory=dict)
    """`AFFINITY_OUTCOMES` -> requests."""
    queue_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LATENCY_BUCKETS_S)
    )
    """Time in the queue of requests dispatched from it, by (tenant, band)."""

    def count_dispatch(self, band: int, how: str) -> None:
        key = (str(band), how)
        self.dispatched[key] = self.dispatched.get(key, 0) + 1

    def count_reject(self, reason: str) -> None:
        self.rejects[reason] = self.rejects.get(reason, 0) + 1

    def count_affinity(self, outcome: str) -> None:
        self.affinity[outcome] = self.affinity.get(outcome, 0) + 1


class Ticket:
    """A dispatched request's claim on the fleet's headroom until its lease takes over (`routed`,
    once, however often called), how long it waited, what its scope was charged, and the
    replicas its placement passes over (`full`)."""

    __slots__ = ("_claimed", "_flow", "_tokens", "charge", "full", "queued_s")

    def __init__(
        self,
        flow: FlowControl | None,
        tokens: float,
        queued_s: float,
        charge: tuple[int, float] | None = None,
        claimed: str | None = None,
        full: frozenset[str] = NO_REPLICAS,
    ) -> None:
        self._flow = flow
        self._tokens = tokens
        self._claimed = claimed
        self.queued_s = queued_s
        self.charge = charge
        """(band, weighted tokens) charged to the scope, settled by the engine's usage."""
        self.full = full
        """The replicas without room when it was let through from the queue for another's
        room: its placement passes over them, but for one holding part of its prompt when it
        is placed (its cached replica, or a fan-out sibling's leader that landed there
        meanwhile: `Placement.place`'s `pass_over`)."""

    def routed(self) -> None:
        """Routing ended (the lease is taken before the next await) or the request failed:
        its tokens leave transit, so the queue is pumped once its lease is counted in their
        place: soon (the lease is taken after routing, before the next await), not now, when
        the replica would show the room this request is about to take."""
        flow, self._flow = self._flow, None
        if flow is not None:
            flow.transit_tokens = max(flow.transit_tokens - self._tokens, 0.0)
            if self._claimed is not None:
                flow.unclaim(self._claimed, self._tokens)
            if flow.queue:
                flow.pump_soon()


NO_TICKET = Ticket(None, 0.0, 0.0)


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future[float]
    model: str
    band: int
    tokens: float
    ahead: int
    """Requests of its own scope queued before it when it arrived."""
    cached: Mapping[str, float] | None = None
    """Prompt tokens each candidate holds (None: none holds any)."""
    blocked_s: float | None = None
    """When it first waited for its cached replica (the affinity wait's start)."""
    past_bound: bool = False
    """Let through past the affinity wait's bound (or at once, the wait off)."""
    claimed: str | None = None
    """Set when it is let through: the replica it claims."""
    full: frozenset[str] = NO_REPLICAS
    """Set when it is let through without a cached replica: the replicas without room then,
    which its placement leaves out too (the room it was let through for is elsewhere)."""
    bound: float = math.inf
    """The room bound it was last found eligible under (its band's, `FlowControl.band_bound`)."""


class FlowControl:
    """The gateway's queue (module docstring). Invariants: `transit_tokens` is the prompt tokens
    of requests dispatched and not yet routed; a waiter's future is resolved only by a dispatch
    (with its queue time) and only while it is queued, so a request is dispatched at most once
    and a removed one never."""

    def __init__(
        self,
        replicas: ReplicaSet,
        limits: FlowLimits,
        queue: FairQueue[_Waiter],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = replicas
        self.limits = limits
        self.queue = queue
        self.clock = clock
        self.stats = FlowStats()
        self.transit_tokens = 0.0
        self.claimed: dict[str, float] = {}
        """Replica -> prompt tokens of requests let through for it (their cached replica) and
        not yet placed: its room counts them."""
        self.shared: SharedCounters | None = None
        """With Redis: the counters shared with the other gateways (set by the app)."""
        self.activity = BandActivity()
        """When each band's requests last arrived: a band below an active one gets less room."""
        self._tick: asyncio.Handle | None = None
        self._tick_at = 0.0
        """When `_tick` runs (the loop's time)."""
        self._soon: asyncio.Handle | None = None
        self.pools: Callable[[str], Sequence[Sequence[ReplicaState]]] | None = None
        """The replica pools a request of a model needs room in, each one (set by the app for a
        disaggregated fleet: its prefill pool, whose queue the room is, and its decode pool,
        whose engines' own queues count too); None: the replicas serving the model, one pool."""
        replicas.fleet.on_freed = self.pump

    # -- room --------------------------------------------------------------------------------
    def prefill_tokens_per_s(self) -> float:
        """The engines' prefill rate flow control counts at: measured from this gateway's
        first tokens (`FleetLoad.prefill_tokens_per_s`) with `measure_rate`, else (and until
        it has measured) the configured one."""
        configured = self.limits.prefill_tokens_per_s
        if not self.limits.measure_rate:
            return configured
        return self.replicas.fleet.prefill_tokens_per_s(configured)

    def pending_bound(self) -> float:
        """The room bound in tokens: `max_pending_prefill_tokens` is that many seconds of work
        at the configured rate, so the same seconds at the rate counted (`prefill_tokens_per_s`).
        An engine faster than configured was otherwise sent its next request only at its first
        token, and idled for the gateway's dispatch (docs/flow-control.md, "The engines' prefill
        rate, measured")."""
        limits = self.limits
        if not limits.measure_rate:
            return limits.max_pending_prefill_tokens
        scale = self.prefill_tokens_per_s() / limits.prefill_tokens_per_s
        return limits.max_pending_prefill_tokens * scale

    def headroom(self, candidates: Sequence[ReplicaState], bound: float | None = None) -> float:
        """Prompt tokens the replicas can still take before none has room (under `bound`,
        default the whole room bound); infinite when none is healthy (nothing to wait for:
        routing answers its 503 at once, as without flow control)."""
        now_s = time.monotonic()
        queued = [self.queued_tokens(c, now_s) for c in candidates if c.healthy]
        if not queued:
            return math.inf
        return headroom_tokens(queued, self.pending_bound() if bound is None else bound)

    def band_bound(self, band: int) -> float:
        """The room bound a request of `band` may be dispatched into: the whole bound, or
        `lower_band_room_share` of it while a better band is active (queued, or seen within
        `BAND_ACTIVE_S`) and this band is not owed a floor dispatch."""
        bound, share = self.pending_bound(), self.limits.lower_band_room_share
        if share >= 1.0 or self.queue.owed(band):
            return bound
        best = self.activity.best(self.clock(), self.queue.bands())
        return band_room_bound(band, best, bound, share)

    def queued_tokens(self, state: ReplicaState, now_s: float) -> float:
        """The prefill still queued on a replica: this gateway's unanswered prefills (less the
        progress of the one in prefill since it began, at most its share) and other gateways'
        requests waiting at the engine. The progress lets the next request go before the
        engine runs dry, so the gateway's own latency never idles it."""
        queued = state.queued_prefill_tokens()
        if state.num_prefilling:
            progress = (now_s - state.prefill_started_s) * self.prefill_tokens_per_s()
            queued -= min(progress, state.pending_prefill_tokens / state.num_prefilling)
        return max(queued, 0.0)

    def room(self) -> dict[str, float]:
        """Each routed replica's room in prompt tokens (the metrics' `replica_room_tokens`)."""
        bound, now_s = self.pending_bound(), time.monotonic()
        return {
            s.id: headroom_tokens([self.queued_tokens(s, now_s)], bound) if s.healthy else 0.0
            for s in self.replicas.states.values()
        }

    def next_room_s(self, now_s: float, bound: float | None = None) -> float | None:
        """When the running prefills' progress (at the configured rate) first brings a replica's
        queued prefill under `bound` (default the whole room bound), if before one of them ends
        (monotonic; None: no replica gets room that way, only by an event). A replica with room
        already is not counted: its room is taken, or an event follows (transit placed, a
        prefill ended)."""
        if bound is None:
            bound = self.pending_bound()
        rate = self.prefill_tokens_per_s()
        soonest: float | None = None
        for state in self.replicas.states.values():
            if not state.healthy or not state.num_prefilling:
                continue
            over = state.queued_prefill_tokens() + self.claimed.get(state.id, 0.0) - bound
            if over < 0 or over >= state.pending_prefill_tokens / state.num_prefilling:
                continue  # room already, or none before its prefill ends (the first token)
            at = state.prefill_started_s + over / rate
            if at > now_s and (soonest is None or at < soonest):
                soonest = at
        return soonest

    def model_headroom(self, model: str, bound: float | None = None) -> float:
        """What a queued request of `model` may take (under `bound`, default the whole room
        bound): the least headroom over its pools."""
        if self.pools is None:
            return self.headroom(self.replicas.serving(model), bound)
        return min((self.headroom(pool, bound) for pool in self.pools(model)), default=math.inf)

    def _has_room(self, candidates: Sequence[ReplicaState], bound: float) -> bool:
        """Whether the fleet has room for one more request under `bound` (infinite room when
        none is healthy, as in `headroom`), reading replicas only until it knows."""
        healthy = [c for c in candidates if c.healthy]
        if not healthy:
            return True
        now_s = time.monotonic()
        return has_headroom(
            (self.queued_tokens(c, now_s) for c in healthy), bound, self.transit_tokens
        )

    def replica_has_room(
        self, state: ReplicaState, now_s: float, bound: float | None = None
    ) -> bool:
        """Whether one replica has room: healthy, and its queued prefill plus what was let
        through for it and is not yet placed under `bound` (default the whole room bound; an
        idle one always has)."""
        if not state.healthy:
            return False
        queued = self.queued_tokens(state, now_s) + self.claimed.get(state.id, 0.0)
        return queued < (self.pending_bound() if bound is None else bound)

    def unclaim(self, replica: str, tokens: float) -> None:
        left = self.claimed.get(replica, 0.0) - tokens
        if left > 1e-9:
            self.claimed[replica] = left
        else:
            self.claimed.pop(replica, None)

    def _affinity(
        self, cached: Mapping[str, float], waited_s: float, now_s: float, bound: float
    ) -> tuple[Affinity, str | None]:
        """The affinity verdict for a request the fleet has room for (under `bound`, its
        band's), and the replica it claims ("go" to a replica with room that holds the most of
        it). Past the bound ("elsewhere") the router places it with its full cached replica a
        candidate."""
        states = self.replicas.states
        best = max(cached.values(), default=0.0)
        if best <= 0:
            return "go", None
        for r, tokens in cached.items():  # the usual case, read first: its replica has room
            if tokens >= best and r in states and self.replica_has_room(states[r], now_s, bound):
                return "go", r
        room = {r: self.replica_has_room(states[r], now_s, bound) for r in cached if r in states}
        kept = {r: cached[r] for r in room}
        verdict = affinity_verdict(
            kept, room, self.prefill_tokens_per_s(), self.limits.affinity_wait_s, waited_s
        )
        if verdict == "elsewhere":
            # past the bound: placed by the router, the full cached replica still a candidate
            # (left out, the request re-prefilled its prefix cold elsewhere: docs/flow-control.md)
            return verdict, None
        best = max(kept.values(), default=0.0)
        claimed = next((r for r, c in kept.items() if c >= best > 0 and room[r]), None)
        return verdict, claimed

    # -- the request's side ----------------------------------------------------------------------
    def try_enter(
        self,
        tenant: Tenant,
        band: int,
        prompt_tokens: float,
        output_tokens: float,
        candidates: Sequence[ReplicaState],
        cached: Mapping[str, float] | None = None,
        decode: Sequence[ReplicaState] = (),
    ) -> Ticket | None:
        """The hot path, synchronous: a ticket at once when the fleet has room and no one is
        queued (the dispatch is charged to the scope's counter), else None: `wait`. `cached`:
        the prompt tokens each candidate holds, when any does (the affinity wait: a request
        whose cached replica is full waits for it when that is worth it, else the router places
        it as it likes). `decode`: a disaggregated fleet's decode pool, which must have room too
        (`candidates` are its prefill instances)."""
        self.activity.seen(band, self.clock())
        if self.queue:
            return None
        bound = self.band_bound(band)
        if not self._has_room(candidates, bound):
            return None
        if decode and not self._has_room(decode, bound):
            return None
        if cached is not None:
            verdict, _ = self._affinity(cached, 0.0, time.monotonic(), bound)
            if verdict == "wait":
                return None
            if verdict == "elsewhere":
                self.stats.count_affinity("no_wait")
        cost = self.queue.cost(prompt_tokens, output_tokens)
        self.queue.charge(tenant.scope, band, tenant.policy.weight, cost)
        self.stats.count_dispatch(band, "immediate")
        self.transit_tokens += prompt_tokens
        return Ticket(self, prompt_tokens, 0.0, (band, cost))

    def sibling(
        self, tenant: Tenant, band: int, prompt_tokens: float, output_tokens: float
    ) -> Ticket:
        """A fan-out sibling whose leader is in flight in this gateway: it is held until the
        leader's prefix lands and then goes to the leader's replica, so it does not queue here
        too (one wait, not two); it is charged to its scope like any dispatch."""
        self.activity.seen(band, self.clock())
        cost = self.queue.cost(prompt_tokens, output_tokens)
        self.queue.charge(tenant.scope, band, tenant.policy.weight, cost)
        self.stats.count_dispatch(band, "sibling")
        return Ticket(None, 0.0, 0.0, (band, cost))

    async def wait(
        self,
        tenant: Tenant,
        band: int,
        model: str,
        prompt_tokens: float,
        output_tokens: float,
        client_left: Callable[[], Awaitable[object]] | None = None,
        max_wait_s: float | None = None,
        cached: Mapping[str, float] | None = None,
    ) -> Ticket:
        """Wait in the scope's queue until the request may go to the router; the ticket must be
        `routed` when routing ends, whatever happens. Raises `QueueFull` or `Overloaded` past
        the limits. `client_left()` returns when the client disconnects (an HTTP front end's
        watch; gRPC cancels the caller's task instead): either way the request leaves the queue
        and `ClientGone` (or the cancellation) is raised, nothing left behind. `max_wait_s`: a
        shorter bound than `max_queue_s` (the endpoint picker's: how long Envoy holds its
        stream). `cached`: as in `try_enter`."""
        weight = tenant.policy.weight
        cost = self.queue.cost(prompt_tokens, output_tokens)
        self._check_limits(tenant, prompt_tokens)
        now_s = self.clock()
        self.activity.seen(band, now_s)
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        depth = self.queue.depth(tenant.scope)
        waiter = _Waiter(future, model, band, prompt_tokens, depth, cached)
        queued = self.queue.push(
            waiter, scope=tenant.scope, band=band, weight=weight, cost=cost, now_s=now_s
        )
        self.pump()
        if not future.done():  # not let through in the same turn: wait (below), else go at once
            await self._await_dispatch(tenant, queued, now_s, client_left, max_wait_s)
        queued_s = future.result()
        self.stats.queue_seconds.labels(tenant.name, str(band)).observe(queued_s)
        return Ticket(self, prompt_tokens, queued_s, (band, cost), waiter.claimed, waiter.full)

    async def _await_dispatch(
        self,
        tenant: Tenant,
        queued: Queued[_Waiter],
        now_s: float,
        client_left: Callable[[], Awaitable[object]] | None,
        max_wait_s: float | None,
    ) -> None:
        """Wait until the waiter's future is resolved by a dispatch; raises past the queue's
        bound or when the client left. One timer and, with a front end's watch, one task per
        waiter, resolved through `outcome` (no `asyncio.wait`: its set, waiter and callbacks
        per call were most of a queued request's cost to the gateway)."""
        loop = asyncio.get_running_loop()
        future = queued.item.future
        outcome: asyncio.Future[str] = loop.create_future()

        def resolve(what: str) -> None:
            if not outcome.done():
                outcome.set_result(what)

        future.add_done_callback(lambda _: resolve("dispatched"))
        timeout = self.limits.max_queue_s
        if max_wait_s is not None:
            timeout = max(min(timeout, max_wait_s), 0.0)
        timer = loop.call_later(timeout, resolve, "timeout")
        watcher = asyncio.ensure_future(client_left()) if client_left is not None else None
        if watcher is not None:
            watcher.add_done_callback(lambda _: resolve("left"))
        try:
            await outcome
        except asyncio.CancelledError:  # the caller's task (a gRPC client cancelling)
            self._left(tenant, queued, now_s)
            raise
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
                if watcher.done() and not watcher.cancelled():
                    watcher.exception()  # a receive that failed is a client gone too: retrieved
        if future.done():
            return
        if watcher is not None and watcher.done() and not watcher.cancelled():
            self._left(tenant, queued, now_s)
            raise ClientGone("the client disconnected while its request waited for room")
        self.queue.remove(queued)
        raise self._timed_out(tenant, queued, self.clock() - now_s)

    def _left(self, tenant: Tenant, queued: Queued[_Waiter], since_s: float) -> None:
        """The client left while its request waited: out of the queue (nothing reaches an
        engine), or, dispatched in the same turn, its claim on the room given back."""
        if self.queue.remove(queued):
            self.stats.count_reject("client_gone")
            log.info(
                "tenant %s: the client left after %.3f s in the queue; nothing was sent to an "
                "engine",
                tenant.name,
                self.clock() - since_s,
            )
        elif queued.item.future.done():
            self.transit_tokens = max(self.transit_tokens - queued.item.tokens, 0.0)
            if queued.item.claimed is not None:
                self.unclaim(queued.item.claimed, queued.item.tokens)

    def _check_limits(self, tenant: Tenant, prompt_tokens: float) -> None:
        backlog = self.queue.depth(tenant.scope)
        if backlog >= self.limits.max_queued_per_scope:
            self.stats.count_reject("scope_full")
            raise QueueFull(
                f"{backlog} of this API key's requests are already waiting for room in the "
                "fleet; retry later",
                retry_after_s=self._retry_after_s(backlog, prompt_tokens),
            )
        if len(self.queue) >= self.limits.max_queued:
            self.stats.count_reject("gateway_full")
            raise Overloaded(
                "the fleet is overloaded: too many requests are waiting for room; retry later",
                retry_after_s=self._retry_after_s(1, prompt_tokens),
            )

    def _timed_out(self, tenant: Tenant, queued: Queued[_Waiter], waited_s: float) -> Exception:
        """429 when the request arrived behind its own scope's backlog (that backlog is the
        reason it waited), else 503 (the fleet had no room for it)."""
        ahead = queued.item.ahead
        if ahead:
            self.stats.count_reject("scope_timeout")
            return QueueFull(
                f"the request waited {waited_s:.3g} s behind {ahead} earlier requests of this API "
                "key's own; retry later",
                retry_after_s=self._retry_after_s(ahead, queued.item.tokens),
            )
        self.stats.count_reject("fleet_timeout")
        return Overloaded(
            f"the fleet had no room for the request within {waited_s:.3g} s; retry later",
            retry_after_s=self._retry_after_s(1, queued.item.tokens),
        )

    def _retry_after_s(self, backlog: int, prompt_tokens: float) -> float:
        """About when the backlog will have drained at one replica's prefill rate, and never
        past `max_queue_s`: no request waits longer, so by then the backlog ahead has turned
        over. (A long one, 256 prompts of 10k tokens at 13k tokens/s is ~200 s, also passed
        the 2 minutes the openai SDK waits out: it gave up at once.)"""
        drained_s = backlog * max(prompt_tokens, 1.0) / self.prefill_tokens_per_s()
        return max(min(drained_s, self.limits.max_queue_s), 1.0)

    # -- dispatch ------------------------------------------------------------------------------
    def pump(self) -> None:
        """Dispatch queued requests while the fleet has room for them (synchronous: called
        when a lease frees room, when a request let through is placed, on a timer, and when a
        request is queued)."""
        if not self.queue:
            return
        headroom: dict[tuple[str, float], float] = {}
        affinity_waits = False

        def eligible(waiter: _Waiter) -> bool:
            bound = waiter.bound = self.band_bound(waiter.band)
            room = headroom.get((waiter.model, bound))
            if room is None:
                room = headroom[waiter.model, bound] = self.model_headroom(waiter.model, bound)
            if room <= self.transit_tokens:
                return False
            if waiter.cached is None:
                return True
            since = waiter.blocked_s
            waited_s = 0.0 if since is None else now_s - since
            verdict, waiter.claimed = self._affinity(
                waiter.cached, waited_s, time.monotonic(), bound
            )
            waiter.past_bound = verdict == "elsewhere"
            if verdict == "wait":
                nonlocal affinity_waits
                affinity_waits = True
                if since is None:
                    waiter.blocked_s = now_s
                return False
            return True

        now_s = self.clock()
        for _ in range(len(self.queue)):
            queued = self.queue.pop(eligible)
            if queued is None:
                break
            if not queued.item.future.done():  # cancelled in the same turn: not dispatched
                self._dispatch(queued, now_s)
        self._maybe_tick(affinity_waits)

    def _dispatch(self, queued: Queued[_Waiter], now_s: float) -> None:
        """Let a waiter through: its tokens in transit (and its claim), its affinity outcome,
        its queue time to its future."""
        waiter = queued.item
        if waiter.claimed is None:
            # let through for the room some replica has: placed where that room is (the router
            # ranks those), not on a full one, where it would wait in the engine's queue while
            # the replica with room idles until a prefill of ours ends; passed over, so a full
            # replica holding part of its prompt stays a candidate (`Ticket.full`)
            waiter.full = self._without_room(waiter.model, waiter.bound)
        self.transit_tokens += waiter.tokens
        if waiter.claimed is not None:
            self.claimed[waiter.claimed] = self.claimed.get(waiter.claimed, 0.0) + waiter.tokens
        if waiter.blocked_s is not None:
            self.stats.count_affinity("bound" if waiter.past_bound else "waited")
        elif waiter.past_bound:
            self.stats.count_affinity("no_wait")
        waiter.future.set_result(now_s - queued.enqueued_s)
        self.stats.count_dispatch(queued.band, "queued")

    def _without_room(self, model: str, bound: float) -> frozenset[str]:
        """The replicas serving `model` that have no room under `bound` now, unless none has (a
        disaggregated fleet's placement is its pools': left to it)."""
        if self.pools is not None:
            return NO_REPLICAS
        now_s = time.monotonic()
        states = self.replicas.serving(model)
        full = [s.id for s in states if not self.replica_has_room(s, now_s, bound)]
        return frozenset(full) if full and len(full) < len(states) else NO_REPLICAS

    def pump_soon(self) -> None:
        """`pump` once the current task step is over (one call however many ask)."""
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._on_soon)

    def _on_soon(self) -> None:
        self._soon = None
        self.pump()

    def _maybe_tick(self, affinity_waits: bool) -> None:
        """While anything waits, the next pump without an event: when the running prefills'
        progress makes room, at the latest `IDLE_TICK_S` (`TICK_S` during an affinity wait);
        an earlier one replaces a later one."""
        if not self.queue:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        at = now + (TICK_S if affinity_waits else IDLE_TICK_S)
        mono = time.monotonic()
        for bound in {self.band_bound(band) for band in self.queue.bands()}:
            room_s = self.next_room_s(mono, bound)
            if room_s is not None:
                at = min(at, now + max(room_s - mono, MIN_TICK_S))
        tick = self._tick
        if tick is not None:
            if self._tick_at <= at:
                return
            tick.cancel()
        # uvloop answers a time under a millisecond away with a plain `Handle` (no `when()`):
        # the time is kept here
        self._tick, self._tick_at = loop.call_at(at, self._on_tick), at

    def _on_tick(self) -> None:
        self._tick = None
        self.pump()

    # -- the exchange's side (an `ExchangeObserver`) --------------------------------------------
    async def on_first_token(self, record: ExchangeRecord) -> None:
        return None

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        """Settle the scope's charge with what the engine did: its uncached prompt and its
        output (VTC counts served tokens; the dispatch only estimated them)."""
        routed = record.routed
        if routed.flow_charge is None or usage.prompt_tokens is None:
            return
        band, charged = routed.flow_charge
        served = self.queue.cost(
            usage.prompt_tokens - usage.cached_tokens, usage.completion_tokens or 0
        )
        self.queue.settle(routed.tenant.scope, band, served - charged)

    async def on_finish(self, record: ExchangeRecord) -> None:
        return None

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        self.replicas.fleet.on_freed = None
