"""Fair flow control's policy: which queued request goes next when the fleet has room.

Requests that find no room wait in one sub-queue per isolation scope (a tenant, or an end user
of a `user`-scoped tenant). Two rules order them:

1. **Bands, strict with a floor.** A request's band is its priority (vLLM's convention: lower
   is served first). The best backlogged band dispatches, except that every *lower* backlogged
   band earns `floor_share` of a dispatch each time the best band dispatches; a lower band with a
   whole dispatch earned takes the next one (the lowest such band first: it is the one nothing
   else protects). So while band b is backlogged it gets at least

       floor_share / (1 + floor_share × (num_backlogged_bands − 1))

   of the dispatches, and the best band keeps at least 1 / (1 + floor_share × (n − 1)).
   Credit is earned only while backlogged, is lost when the band's backlog empties or when it
   is served with no better band waiting (it is not starved then: a light high band's next
   request is not put behind it), and never exceeds 1 + floor_share: no band banks it.

2. **A Virtual Token Counter per scope within a band** (Sheng et al., "Fairness in Serving
   Large Language Models", OSDI 2024). Each dispatch adds its cost to its scope's counter,
   divided by the scope's weight:

       counter[s] += (prefill_tokens + decode_weight × decode_tokens) / weight[s]

   and the backlogged scope with the least counter goes next (ties: the oldest head). The cost
   is estimated at dispatch and settled with the real one (the engine's usage) when known. A scope
   whose sub-queue was empty and receives a request is lifted to

       counter[s] = max(counter[s], min(counter[t] for backlogged t in the band))

   (with none backlogged, to the band's virtual time: the counter of its last dispatch), so a
   scope back from idle competes from where the others are and cannot spend credit banked while
   it was away. Over any period where scopes stay backlogged their served cost is proportional
   to their weights, within one request's cost per scope.

3. **Room held back from lower bands while a higher one is active** (`BandActivity`). A
   replica has room while its queued prefill is under a bound; a request of a band below an
   *active* one (a band with requests queued, or seen within `BAND_ACTIVE_S`) gets room only
   under `lower_band_room_share` of that bound, so a higher-band request arriving finds at most
   that share of lower-band work queued at the engine (behind the prefill running there),
   rather than the whole bound. A band owed a floor dispatch (`FairQueue.owed`) gets the whole
   bound: else a higher band's backlog, dispatched whenever the queue is under the bound, would
   never leave it under the share, and the floor would starve.

Work-conserving: `pop` returns a request whenever one is queued and `eligible`; a lone scope
gets every dispatch, and a band with no active band above it gets the whole bound. Pure and
synchronous, like everything in `router/`: no clock (the caller passes `now_s`), no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

DEFAULT_FLOOR_SHARE = 0.05
"""Each lower band earns 1/20 of a dispatch per dispatch of the best band: a batch tier under a
sustained interactive flood still moves (at ~5% of the fleet) without costing the interactive
tier more than one request in twenty."""
DEFAULT_DECODE_WEIGHT = 2.0
"""A generated token counts as two prompt tokens (the VTC paper's w_q = 2 w_p: decode holds a
batch slot for a step per token, prefill processes many tokens per step)."""

DEFAULT_LOWER_BAND_ROOM_SHARE = 0.5
"""While a higher band is active, a lower band's request is let into a replica's room only
under half the room bound: a higher-band request arriving waits behind at most half a bound of
lower-band work at the engine (docs/flow-control.md, "When a replica has room")."""
BAND_ACTIVE_S = 5.0
"""A band is active for this long after its last request arrived (and while it has requests
queued): long enough to span an interactive tenant's gaps between requests, so its next one
finds the lower bands held back; the lower bands' cost is only that the engine runs with less
queued ahead of it, which idles it only when the gateway's dispatch takes longer than the
share of the bound (docs/flow-control.md)."""

SWEEP_SLACK = 64
"""Idle scopes kept beyond twice the backlogged ones before a sweep drops those the band's
virtual time has passed: the sweep's cost is amortized over at least this many dispatches."""


def headroom_tokens(queued_tokens: Iterable[float], max_pending_prefill_tokens: float) -> float:
    """Prompt tokens the replicas can take before none has room, given the prefill tokens
    still queued on each healthy replica: a replica has room while that is under
    `max_pending_prefill_tokens`, and an idle one takes a request of any size
    (work-conserving), so a healthy replica with nothing queued always has headroom > 0."""
    return sum(max(max_pending_prefill_tokens - queued, 0.0) for queued in queued_tokens)


def has_headroom(
    queued_tokens: Iterable[float], max_pending_prefill_tokens: float, claimed_tokens: float
) -> bool:
    """Whether `headroom_tokens` exceeds `claimed_tokens` (what requests let through and not
    yet placed will take), reading no more replicas than it needs: the request path's check."""
    total = 0.0
    for queued in queued_tokens:
        total += max(max_pending_prefill_tokens - queued, 0.0)
        if total > claimed_tokens:
            return True
    return False


def band_room_bound(
    band: int, best_active: int | None, max_pending_prefill_tokens: float, lower_share: float
) -> float:
    """The room bound a request of `band` may be dispatched into: the whole bound unless a
    better band (a lower number) is active (`best_active`, None: none is), then
    `lower_share` of it (an idle replica still takes a request of any size: room is
    `headroom_tokens`'s, so the bound only limits what may already be queued)."""
    if best_active is not None and best_active < band:
        return max_pending_prefill_tokens * lower_share
    return max_pending_prefill_tokens


class BandActivity:
    """Which bands are active: when each last had a request arrive (`seen`), kept for
    `active_s`; the caller adds the bands with requests queued (`best`). Pure: the caller
    passes `now_s`. Memory: one entry per band seen within `active_s` (older ones are dropped
    as they are read)."""

    __slots__ = ("_seen", "active_s")

    def __init__(self, active_s: float = BAND_ACTIVE_S) -> None:
        if not 0.0 <= active_s < math.inf:
            raise ValueError(f"active_s must be a finite number >= 0, got {active_s}")
        self.active_s = active_s
        self._seen: dict[int, float] = {}

    def seen(self, band: int, now_s: float) -> None:
        """A request of `band` arrived."""
        if self._seen.get(band, -math.inf) < now_s:
            self._seen[band] = now_s

    def best(self, now_s: float, backlogged: Iterable[int] = ()) -> int | None:
        """The best (lowest-numbered) active band: seen within `active_s` of `now_s`, or in
        `backlogged`; None when none is."""
        best = min(backlogged, default=None)
        stale = None
        for band, at in self._seen.items():
            if now_s - at > self.active_s:
                stale = [*(stale or ()), band]
            elif best is None or band < best:
                best = band
        for band in stale or ():
            del self._seen[band]
        return best


Affinity = Literal["go", "wait", "elsewhere"]


def affinity_verdict(
    cached_tokens: Mapping[str, float],
    has_room: Mapping[str, bool],
    prefill_tokens_per_s: float,
    max_wait_s: float,
    waited_s: float,
) -> Affinity:
    """Where a request the fleet has room for may go, when its cache is on a replica that has
    none (the bounded affinity wait, docs/flow-control.md).

    `cached_tokens`: the prompt tokens each healthy candidate holds; `has_room`: whether each
    has room (the same keys); `waited_s`: how long the request has already waited for its
    replica. "go": the router places it as it likes (no replica holds a prefix, a replica
    holding the most has room, or none has room: the fleet's own wait decides). "wait": every
    replica holding the most is full and it has waited less than both `max_wait_s` and the
    prefill that cache saves over the best replica with room (at `prefill_tokens_per_s`), so
    it never waits longer than its cache is worth. "elsewhere": the same, past either bound:
    it waits no more, and the router places it by cache and load, its full cached replica still
    a candidate (issue 39: left out, bench point 1's turns re-prefilled cold elsewhere)."""
    best = max(cached_tokens.values(), default=0.0)
    if best <= 0:
        return "go"
    roomy = [cached_tokens[r] for r, room in has_room.items() if room]
    if not roomy or any(has_room.get(r, False) for r, c in cached_tokens.items() if c >= best):
        return "go"
    saved_s = (best - max(roomy)) / prefill_tokens_per_s
    if waited_s < min(max_wait_s, saved_s):
        return "wait"
    return "elsewhere"


@dataclass(slots=True)
class Queued(Generic[T]):
    """One waiting request: what the caller queued, its scope, band, cost and arrival time."""

    item: T
    scope: str
    band: int
    cost: float
    enqueued_s: float
    seq: int


@dataclass(slots=True)
class _Scope(Generic[T]):
    weight: float
    counter: float
    queue: deque[Queued[T]] = field(default_factory=deque)


@dataclass(slots=True)
class _Band(Generic[T]):
    scopes: dict[str, _Scope[T]] = field(default_factory=dict)
    backlogged: dict[str, None] = field(default_factory=dict)
    """The scopes with a queued request, in the order they became backlogged."""
    virtual_s: float = 0.0
    """The counter of the band's last dispatch: where a scope back from idle starts."""
    credit: float = 0.0
    """Dispatches earned by the floor while a better band was served. A band whose credit is
    whole is served before the best band dispatches again, so the credit stays below
    1 + floor_share (the cap only bites when nothing of the band was eligible)."""


class FairQueue(Generic[T]):
    """Per-scope sub-queues in priority bands, dequeued by VTC within a band (module docstring).

    Invariants: a scope is in its band's `backlogged` iff its sub-queue is non-empty; `len`
    counts every queued request; a counter grows by each dispatch's estimated cost and is
    corrected (`settle`) by the real one; an idle scope's entry is dropped once the band's
    virtual time has passed it (it would be lifted that far on return anyway), so memory
    follows the backlog, not every scope ever seen.
    """

    def __init__(
        self,
        floor_share: float = DEFAULT_FLOOR_SHARE,
        decode_weight: float = DEFAULT_DECODE_WEIGHT,
    ) -> None:
        if not 0.0 <= floor_share <= 1.0:
            raise ValueError(f"floor_share must be between 0 and 1, got {floor_share}")
        if decode_weight < 0 or not math.isfinite(decode_weight):
            raise ValueError(f"decode_weight must be a finite number >= 0, got {decode_weight}")
        self.floor_share = floor_share
        self.decode_weight = decode_weight
        self._bands: dict[int, _Band[T]] = {}
        self._seq = itertools.count()
        self._len = 0
        self._served: dict[tuple[int, str], float] | None = None
        """With `share()`: the weighted service given here since the last `take_served`."""

    def __len__(self) -> int:
        return self._len

    def cost(self, prefill_tokens: float, decode_tokens: float) -> float:
        """A request's cost in weighted tokens (before its scope's weight divides it)."""
        return max(prefill_tokens, 0.0) + self.decode_weight * max(decode_tokens, 0.0)

    # -- queueing --------------------------------------------------------------------------
    def push(
        self, item: T, *, scope: str, band: int, weight: float, cost: float, now_s: float
    ) -> Queued[T]:
        """Queue `item` at the back of its scope's sub-queue (lifting a scope back from idle)."""
        if weight <= 0 or not math.isfinite(weight):
            raise ValueError(f"weight must be a positive number, got {weight}")
        entry = self._scope(scope, band, weight)
        queued = Queued(item, scope, band, cost, now_s, next(self._seq))
        entry.queue.append(queued)
        self._bands[band].backlogged[scope] = None
        self._len += 1
        return queued

    def remove(self, queued: Queued[T]) -> bool:
        """Take a request out of its queue (its client left, or it waited too long); False
        when it is not queued (already dispatched or removed)."""
        band = self._bands.get(queued.band)
        entry = band.scopes.get(queued.scope) if band is not None else None
        if band is None or entry is None:
            return False
        try:
            entry.queue.remove(queued)
        except ValueError:
            return False
        self._len -= 1
        if not entry.queue:
            del band.backlogged[queued.scope]
            if not band.backlogged:
                band.credit = 0.0
            self._maybe_forget(band, queued.band, queued.scope)
        return True

    def charge(self, scope: str, band: int, weight: float, cost: float) -> None:
        """Count a request dispatched without queueing (the fleet had room) on its scope's
        counter, as a dispatch from the queue would be (lifted first if it was idle)."""
        if weight <= 0 or not math.isfinite(weight):
            raise ValueError(f"weight must be a positive number, got {weight}")
        entry = self._scope(scope, band, weight)
        entry.counter += cost / entry.weight
        self._serve(band, scope, cost / entry.weight)
        band_state = self._bands[band]
        if not band_state.backlogged:
            # NOTE: with no one waiting, nobody was owed this dispatch: the band's virtual time
            # moves past it, and scopes the fleet served while it had room start level
            band_state.virtual_s = max(band_state.virtual_s, entry.counter)
        if not entry.queue:
            self._maybe_forget(band_state, band, scope)

    def settle(self, scope: str, band: int, delta_cost: float) -> None:
        """Correct a dispatched request's charge once its real cost is known (the engine's
        usage: its cached prompt, its output) by `delta_cost` weighted tokens; nothing when the
        scope is no longer tracked (it would be lifted on return anyway)."""
        band_state = self._bands.get(band)
        entry = band_state.scopes.get(scope) if band_state is not None else None
        if entry is not None and math.isfinite(delta_cost):
            entry.counter += delta_cost / entry.weight
            self._serve(band, scope, delta_cost / entry.weight)

    def _scope(self, scope: str, band: int, weight: float) -> _Scope[T]:
        band_state = self._bands.get(band)
        if band_state is None:
            band_state = self._bands[band] = _Band()
        entry = band_state.scopes.get(scope)
        if entry is None:
            entry = band_state.scopes[scope] = _Scope(weight, band_state.virtual_s)
        entry.weight = weight  # the tenant file may have changed it
        if not entry.queue:  # back from idle: no banked credit
            entry.counter = max(entry.counter, self._floor_counter(band_state, exclude=scope))
        return entry

    def _floor_counter(self, band: _Band[T], exclude: str) -> float:
        counters = [band.scopes[s].counter for s in band.backlogged if s != exclude]
        return min(counters) if counters else band.virtual_s

    def _maybe_forget(self, band: _Band[T], band_id: int, scope: str) -> None:
        """Drop idle scopes the band's virtual time has passed (they would be lifted there on
        return): this one, and every idle one once idle entries outnumber the backlog."""
        entry = band.scopes[scope]
        if not entry.queue and entry.counter <= band.virtual_s:
            del band.scopes[scope]
        if len(band.scopes) > 2 * len(band.backlogged) + SWEEP_SLACK:
            for name in [n for n, e in band.scopes.items() if not e.queue]:
                if band.scopes[name].counter <= band.virtual_s:
                    del band.scopes[name]
        if not band.scopes:
            del self._bands[band_id]

    def bands(self) -> list[int]:
        """The bands with requests queued."""
        return [b for b, state in self._bands.items() if state.backlogged]

    def owed(self, band: int) -> bool:
        """Whether `band` has earned a whole floor dispatch (it takes the next one it is
        eligible for): it is let into the whole room bound, whatever is active above it."""
        state = self._bands.get(band)
        return state is not None and self.floor_share > 0 and state.credit >= 1.0

    # -- dispatch --------------------------------------------------------------------------
    def pop(self, eligible: Callable[[T], bool] | None = None) -> Queued[T] | None:
        """The next request to dispatch, out of the queue; None when nothing queued is
        `eligible` (e.g. no replica serving its model has room). Strict bands with the floor,
        then the least counter within the band."""
        if not self._len:
            return None
        order = sorted(b for b, state in self._bands.items() if state.backlogged)
        for band_id in self._band_order(order):
            queued = self._pop_band(band_id, eligible)
            if queued is not None:
                self._account_floor(order, band_id)
                return queued
        return None

    def _band_order(self, order: list[int]) -> Iterator[int]:
        """The bands to try: a lower band whose floor credit is whole first (the lowest of
        them), then every band best first (work-conserving)."""
        if self.floor_share > 0 and len(order) > 1:
            for band_id in reversed(order[1:]):
                if self._bands[band_id].credit >= 1.0:
                    yield band_id
                    break
        yield from order

    def _account_floor(self, order: list[int], served: int) -> None:
        if served != order[0]:
            band = self._bands.get(served)
            if band is not None:
                band.credit = max(band.credit - 1.0, 0.0)
            return
        best = self._bands.get(served)
        if best is not None:  # served with nothing better waiting: it is not starved
            best.credit = 0.0
        for band_id in order[1:]:
            band = self._bands.get(band_id)
            if band is not None:
                band.credit = min(band.credit + self.floor_share, 1.0 + self.floor_share)

    def _pop_band(self, band_id: int, eligible: Callable[[T], bool] | None) -> Queued[T] | None:
        band = self._bands[band_id]
        best: tuple[float, int, str] | None = None
        for scope in band.backlogged:
            entry = band.scopes[scope]
            head = entry.queue[0]
            if eligible is not None and not eligible(head.item):
                continue
            key = (entry.counter, head.seq, scope)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        scope = best[2]
        entry = band.scopes[scope]
        queued = entry.queue.popleft()
        self._len -= 1
        band.virtual_s = max(band.virtual_s, entry.counter)
        entry.counter += queued.cost / entry.weight
        self._serve(band_id, scope, queued.cost / entry.weight)
        if not entry.queue:
            del band.backlogged[scope]
            if not band.backlogged:
                band.credit = 0.0
            self._maybe_forget(band, band_id, scope)
        return queued

    # -- counters shared by several queues (gateways) ------------------------------------------
    def share(self) -> None:
        """Record the service this queue gives (`take_served`), for peers that share counters:
        each queue publishes its service and adds theirs (`add_remote`), so every scope's
        counter counts what the whole fleet of queues served it, and each queue's picks even
        out the shares the others' skew."""
        if self._served is None:
            self._served = {}

    def _serve(self, band: int, scope: str, weighted: float) -> None:
        if self._served is not None:
            key = (band, scope)
            self._served[key] = self._served.get(key, 0.0) + weighted

    def take_served(self) -> dict[tuple[int, str], float]:
        """(band, scope) -> weighted tokens served here since the last call (counter units:
        cost / weight); empty unless `share()` was called."""
        if self._served is None:
            return {}
        served, self._served = self._served, {}
        return served

    def return_served(self, served: dict[tuple[int, str], float]) -> None:
        """Put back what `take_served` gave (it could not be published): the next one has it."""
        for (band, scope), weighted in served.items():
            self._serve(band, scope, weighted)

    def tracked(self) -> list[tuple[int, str]]:
        """Every (band, scope) with a counter here (backlogged, or idle and not yet passed)."""
        return [(b, scope) for b, band in self._bands.items() for scope in band.scopes]

    def add_remote(self, scope: str, band: int, weighted: float) -> None:
        """Service other queues gave a tracked scope (counter units): its counter moves as if
        served here. An untracked scope is not followed (it is lifted on arrival anyway)."""
        band_state = self._bands.get(band)
        entry = band_state.scopes.get(scope) if band_state is not None else None
        if entry is not None and math.isfinite(weighted):
            entry.counter += weighted

    # -- what operators see ------------------------------------------------------------------
    def depth(self, scope: str) -> int:
        """Requests `scope` has queued, in every band."""
        return sum(len(b.scopes[scope].queue) for b in self._bands.values() if scope in b.scopes)

    def depths(self) -> dict[tuple[str, int], int]:
        """(scope, band) -> requests queued, for every backlogged sub-queue."""
        return {
            (scope, band_id): len(band.scopes[scope].queue)
            for band_id, band in self._bands.items()
            for scope in band.backlogged
        }

    def oldest_s(self) -> float | None:
        """When the longest-waiting queued request arrived (None: nothing queued)."""
        heads = [
            band.scopes[s].queue[0].enqueued_s
            for band in self._bands.values()
            for s in band.backlogged
        ]
        return min(heads) if heads else None

    def counter(self, scope: str, band: int) -> float | None:
        """A scope's virtual token counter in a band (None: not tracked)."""
        band_state = self._bands.get(band)
        entry = band_state.scopes.get(scope) if band_state is not None else None
        return entry.counter if entry is not None else None
