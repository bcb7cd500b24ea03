"""Placement: the policy's decision with the two agent-traffic refinements around it.

1. Fan-out (`router.fanout`): if an in-flight sibling of the same scope is writing this
   request's uncached prefix, wait for it to land (bounded), then count its replica as
   holding that prefix.
2. Hot prefixes (`router.overflow`): if the prefix this request matched is requested faster
   than its holders can prefill, let k replicas count as holding it.
3. The policy ranks the replicas.
4. A request that will write a long uncached prefix becomes a leader its siblings can find.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from cachemap.keys import BlockHash
from gateway.directory.routing import Lookup
from gateway.pipeline.flights import OK, PENDING, Flight, Flights, Marker
from router.fanout import DEFAULT_HOLD_FACTOR, with_leader, worth_holding
from router.filters import LoadBoundFilter
from router.overflow import OverflowConfig
from router.plan import HotPrefix, plan
from router.profile import RoutingProfile
from router.types import Decision, Replica, RouteRequest


@dataclass
class OverflowStats:
    widenings: int = 0
    shrinks: int = 0
    spread_requests: int = 0


@dataclass
class Placed:
    decision: Decision
    route: RouteRequest
    """The request as the replicas really hold it (the directory, and a landed leader): what
    reconciliation predicts and the pending prefill counts. The policy decided on a hot
    prefix's spread, in which replicas that do not hold the prefix yet count as holding it."""
    flight: Flight | None
    new_k: int | None = None
    """Set when the prefix's k changed: the caller stores it with the prefix's rate."""


class Placement:
    def __init__(
        self,
        *,
        prefill_tokens_per_s: float,
        overflow: OverflowConfig | None,
        flights: Flights | None,
        min_hold_tokens: float,
        max_hold_s: float,
        bound: LoadBoundFilter,
    ) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.overflow = overflow
        self.flights = flights
        self.min_hold_tokens = min_hold_tokens
        self.max_hold_s = max_hold_s
        self.bound = bound
        self.stats = OverflowStats()

    async def place(
        self,
        policy: RoutingProfile,
        route: RouteRequest,
        snapshot: Callable[[], Sequence[Replica]],
        hashes: Sequence[BlockHash],
        lookup: Lookup,
        rng: random.Random,
        on_hold: Callable[[float], Awaitable[None]] | None = None,
    ) -> Placed | None:
        """`snapshot()` is the replicas as they are now: read again after a hold, so a replica
        that left (or came) while the request waited is ranked as it is when the wait ends.
        `on_hold`: awaited with a hold's bound before the request waits (the endpoint picker
        extends Envoy's message timeout with it)."""
        depth = max(route.overlap.values(), default=0)
        replicas = snapshot()
        # 1. fan-out
        if self.flights is not None:
            waited, landed = await self._maybe_hold(route, replicas, hashes, lookup, depth, on_hold)
            if landed is not None:
                replica, shared = landed
                route = with_leader(route, replica, shared)
                depth = max(depth, shared)
            if waited:
                replicas = snapshot()  # a wait of up to seconds: the fleet may have moved on
        # 2. hot prefixes, 3. the policy (`router.plan`, the simulator's step too)
        hot = lookup.hot
        planned = plan(
            policy,
            route,
            replicas,
            rng,
            HotPrefix(hot.rate_per_min, hot.k) if hot is not None and depth > 0 else None,
            self.overflow,
        )
        decision = planned.decision  # `route` stays the real one (the spread is virtual)
        new_k = None
        if planned.k is not None and hot is not None and planned.k != hot.k:
            new_k = planned.k
            if planned.k > hot.k:
                self.stats.widenings += 1
            else:
                self.stats.shrinks += 1
        if planned.spread:
            self.stats.spread_requests += 1
        if decision is None:
            return None
        # 4. lead
        flight = None
        if self.flights is not None:
            matched = route.overlap.get(decision.replica, 0)
            uncached_tokens = (len(hashes) - matched) * route.tokens_per_block
            if uncached_tokens >= self.min_hold_tokens:
                target = next(r for r in replicas if r.id == decision.replica)
                # its queue (this gateway's and, from the engine's metrics, others') + its own
                expected_s = route.estimated_work(target) / self.prefill_tokens_per_s
                ttl = max(self.max_hold_s, DEFAULT_HOLD_FACTOR * expected_s)
                flight = await self.flights.lead(
                    decision.replica, hashes[matched:], expected_s, ttl
                )
        return Placed(decision, route, flight, new_k)

    async def _maybe_hold(
        self,
        route: RouteRequest,
        replicas: Sequence[Replica],
        hashes: Sequence[BlockHash],
        lookup: Lookup,
        depth: int,
        on_hold: Callable[[float], Awaitable[None]] | None = None,
    ) -> tuple[bool, tuple[str, int] | None]:
        """Wait for a leader writing this request's uncached prefix, if that is worth it: a
        leader of this gateway first, else one another gateway announced through Redis.
        Returns whether it waited, and (the replica that now holds the prefix, its depth) when
        a leader landed."""
        flights = self.flights
        assert flights is not None
        found = flights.find(hashes, depth)
        if found is not None:
            leader, shared = found
            if not self._worth(route, replicas, leader.replica, depth, shared):
                return False, None
            timeout = min(self.max_hold_s, DEFAULT_HOLD_FACTOR * leader.expected_s)
            if on_hold is not None:
                await on_hold(max(timeout, 0.001))
            ok = await flights.wait(leader, max(timeout, 0.001))
            return True, ((leader.replica, shared) if ok else None)
        text, shared = lookup.writer, lookup.writer_depth
        marker = Marker.parse(text) if text is not None else None
        if marker is None or shared <= depth:
            return False, None
        # a marker that says the leader already landed is not trusted here: the directory holds
        # (or within a flush holds) its record, and a replica may have restarted since
        if marker.state != PENDING or not self._worth(
            route, replicas, marker.replica, depth, shared
        ):
            return False, None
        expected_s = marker.expected_s if marker.expected_s is not None else self.max_hold_s
        timeout = min(self.max_hold_s, DEFAULT_HOLD_FACTOR * expected_s)
        shared_markers = flights.shared
        assert shared_markers is not None
        block = hashes[lookup.writer_from]  # the flight's first block holds its marker
        if on_hold is not None:
            await on_hold(max(timeout, 0.001))
        landed = await flights.wait_remote(
            marker.key, max(timeout, 0.001), lambda: shared_markers.read_marker(block)
        )
        if landed is None or landed.state != OK:
            return True, None
        return True, (landed.replica, shared)

    def _worth(
        self, route: RouteRequest, replicas: Sequence[Replica], leader: str, depth: int, shared: int
    ) -> bool:
        return worth_holding(
            route, replicas, leader, depth, shared, self.min_hold_tokens, self.bound
        )
