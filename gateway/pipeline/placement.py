"""Placement: the policy's decision with the two agent-traffic refinements around it.

1. Fan-out (`router.fanout`): if an in-flight sibling of the same scope is writing this
   request's uncached prefix, wait for it to land (bounded), then count its replica as
   holding that prefix.
2. Hot prefixes (`router.overflow`): if the prefix this request matched is requested faster
   than its holders can prefill, let k replicas count as holding it. A sibling of a flight
   (it held for a leader that landed, or it matched a prefix a leader is writing) is not a new
   arrival: the siblings of one flight count once for the rate, and a sibling widens the
   prefix only when its holder lacks room (issue 45, item 16).
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
from router.fanout import DEFAULT_HOLD_FACTOR, holders_have_room, with_leader, worth_holding
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
    sibling_holds: int = 0
    """Siblings of a flight kept on its holder, which had room, whatever their prefix's rate."""


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
    uncount: bool = False
    """The lookup counted this request for its prefix's rate, but it is a later sibling of a
    flight that already counted once: the caller takes the count back."""


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
        on_hold: Callable[[float], Awaitable[object]] | None = None,
        pass_over: frozenset[str] = frozenset(),
        unpredicted: frozenset[str] = frozenset(),
    ) -> Placed | None:
        """`snapshot()` is the replicas as they are now: read again after a hold, so a replica
        that left (or came) while the request waited is ranked as it is when the wait ends.
        `on_hold`: awaited with a hold's bound before the request waits (the endpoint picker
        extends Envoy's message timeout with it). `pass_over`: replicas placed on only when
        they hold part of the prompt once fan-out is done (flow control's full replicas for a
        request let through holding nothing: a sibling whose leader landed on one goes there),
        or when no other is healthy. `unpredicted`: replicas whose placement in flight is not
        written (`Keyed.unpredicted`); a leader's on any other goes with its marker when the
        flight is all the lookup read the replica not to hold (`Flight.placed`)."""
        depth = max(route.overlap.values(), default=0)
        replicas = snapshot()
        joined: str | None = None  # the flight this request is a sibling of
        # 1. fan-out
        if self.flights is not None:
            waited, landed, joined = await self._maybe_hold(
                route, replicas, hashes, lookup, depth, on_hold
            )
            if landed is not None:
                replica, shared = landed
                route = with_leader(route, replica, shared)
                depth = max(depth, shared)
            else:
                joined = None
            if waited:
                replicas = snapshot()  # a wait of up to seconds: the fleet may have moved on
            if joined is None and depth > 0:
                joined = self._writing(route, hashes, depth)
        if pass_over:
            kept = [r for r in replicas if r.id not in pass_over or route.overlap.get(r.id, 0)]
            if any(r.healthy for r in kept):
                replicas = kept
        # 2. hot prefixes, 3. the policy (`router.plan`, the simulator's step too)
        hot = lookup.hot
        uncount = False
        if joined is not None and hot is not None and self.flights is not None:
            # one arrival per flight, and a burst of siblings widens nothing while their
            # holder has room (its measured load, decode included)
            uncount = not self.flights.join(joined)
            if holders_have_room(route, replicas, depth, self.bound):
                self.stats.sibling_holds += 1
                hot = None
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
                # the director's placement in flight is of what the lookup read the replica
                # not to hold: the same blocks unless a leader landed there since
                place = decision.replica not in unpredicted and matched == lookup.overlap.get(
                    decision.replica, 0
                )
                flight = await self.flights.lead(
                    decision.replica, hashes[matched:], expected_s, ttl, place
                )
        return Placed(decision, route, flight, new_k, uncount)

    async def _maybe_hold(
        self,
        route: RouteRequest,
        replicas: Sequence[Replica],
        hashes: Sequence[BlockHash],
        lookup: Lookup,
        depth: int,
        on_hold: Callable[[float], Awaitable[object]] | None = None,
    ) -> tuple[bool, tuple[str, int] | None, str | None]:
        """Wait for a leader writing this request's uncached prefix, if that is worth it: a
        leader of this gateway first, else one another gateway announced through Redis.
        Returns whether it waited, (the replica that now holds the prefix, its depth) when
        a leader landed, and the name of the flight it waited for."""
        flights = self.flights
        assert flights is not None
        found = flights.find(hashes, depth)
        if found is not None:
            leader, shared = found
            if not self._worth(route, replicas, leader.replica, depth, shared):
                return False, None, None
            timeout = min(self.max_hold_s, DEFAULT_HOLD_FACTOR * leader.expected_s)
            if on_hold is not None:
                await on_hold(max(timeout, 0.001))
            ok = await flights.wait(leader, max(timeout, 0.001))
            return True, ((leader.replica, shared) if ok else None), flights.key(leader)
        text, shared = lookup.writer, lookup.writer_depth
        marker = Marker.parse(text) if text is not None else None
        if marker is None or shared <= depth:
            return False, None, None
        # a marker that says the leader already landed is not trusted here: the directory holds
        # (or within a flush holds) its record, and a replica may have restarted since
        if marker.state != PENDING or not self._worth(
            route, replicas, marker.replica, depth, shared
        ):
            return False, None, None
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
            return True, None, None
        return True, (landed.replica, shared), marker.key

    def _writing(self, route: RouteRequest, hashes: Sequence[BlockHash], depth: int) -> str | None:
        """The flight of this gateway still writing the prefix this request matched on the
        flight's replica (precise mode's speculative entry matches it before it lands): the
        request is one of its siblings."""
        flights = self.flights
        assert flights is not None
        flight = flights.writing(hashes[depth - 1]) if depth <= len(hashes) else None
        if flight is None or route.overlap.get(flight.replica, 0) < depth:
            return None
        return flights.key(flight)

    def _worth(
        self, route: RouteRequest, replicas: Sequence[Replica], leader: str, depth: int, shared: int
    ) -> bool:
        return worth_holding(
            route, replicas, leader, depth, shared, self.min_hold_tokens, self.bound
        )
