"""The fair queue's policy (router.fairness): narrative cases, then hypothesis properties."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.fairness import (
    BandActivity,
    FairQueue,
    affinity_verdict,
    band_room_bound,
    has_headroom,
    headroom_tokens,
)


def _fill(
    queue: FairQueue[str],
    scope: str,
    n: int,
    *,
    band: int = 0,
    cost: float = 1.0,
    weight: float = 1.0,
) -> None:
    for i in range(n):
        queue.push(f"{scope}{i}", scope=scope, band=band, weight=weight, cost=cost, now_s=0.0)


def _drain(queue: FairQueue[str], n: int) -> list[str]:
    out = []
    for _ in range(n):
        queued = queue.pop()
        assert queued is not None
        out.append(queued.item)
    return out


def test_a_lone_scope_is_served_in_order() -> None:
    queue: FairQueue[str] = FairQueue()
    _fill(queue, "a", 5, cost=100.0)
    assert _drain(queue, 5) == ["a0", "a1", "a2", "a3", "a4"]
    assert queue.pop() is None and len(queue) == 0


def test_a_light_scope_overtakes_a_flooding_one() -> None:
    """A floods with 10,000-token prompts; B's 2,000-token prompt arrives behind 20 of them
    and goes after at most one more of A's (it is lifted to A's counter, then A's head is
    older), not after all 20."""
    queue: FairQueue[str] = FairQueue()
    _fill(queue, "a", 20, cost=10_000.0)
    assert _drain(queue, 3) == ["a0", "a1", "a2"]
    queue.push("b0", scope="b", band=0, weight=1.0, cost=2_000.0, now_s=1.0)
    assert queue.counter("b", 0) == queue.counter("a", 0)
    assert _drain(queue, 2) == ["a3", "b0"]


def test_a_returning_scope_is_lifted_to_the_backlog() -> None:
    queue: FairQueue[str] = FairQueue()
    _fill(queue, "b", 1, cost=5.0)
    _drain(queue, 1)
    _fill(queue, "a", 50, cost=10.0)
    _drain(queue, 40)  # A runs alone: its counter is 400
    _fill(queue, "b", 10, cost=10.0)
    assert queue.counter("b", 0) == pytest.approx(400.0)
    # from here B and A alternate: B has no credit from the time it was away
    assert _drain(queue, 4) == ["a40", "b0", "a41", "b1"]


def test_bands_are_strict_but_the_floor_moves_the_lower_one() -> None:
    queue: FairQueue[str] = FairQueue(floor_share=0.25)
    _fill(queue, "hi", 20, band=0)
    _fill(queue, "lo", 5, band=1)
    served = _drain(queue, 10)
    assert served == ["hi0", "hi1", "hi2", "hi3", "lo0", "hi4", "hi5", "hi6", "hi7", "lo1"]


def test_a_band_served_with_nothing_better_waiting_keeps_no_floor_credit() -> None:
    """A light high band (one request at a time) beside a low band's backlog: the low band is
    served whenever the high band has nothing waiting, so it is not starved, and the credit
    its floor earned from the high band's dispatches is dropped then: the high band's next
    request is never put behind one of the low band's (the bands scenario's B waited an extra
    prefill once in ~20 requests, over its TTFT bound)."""
    queue: FairQueue[str] = FairQueue(floor_share=0.05)
    _fill(queue, "lo", 100, band=5)
    for k in range(60):
        queue.push(f"hi{k}", scope="hi", band=0, weight=1.0, cost=1.0, now_s=float(k))
        assert _drain(queue, 2)[0] == f"hi{k}"  # then one of lo's, the best band left


def test_without_a_floor_a_lower_band_waits_for_the_higher_one() -> None:
    queue: FairQueue[str] = FairQueue(floor_share=0.0)
    _fill(queue, "lo", 2, band=3)
    _fill(queue, "hi", 3, band=0)
    assert _drain(queue, 5) == ["hi0", "hi1", "hi2", "lo0", "lo1"]


def test_removed_requests_are_never_dispatched() -> None:
    queue: FairQueue[str] = FairQueue()
    gone = queue.push("gone", scope="a", band=0, weight=1.0, cost=1.0, now_s=0.0)
    queue.push("kept", scope="a", band=0, weight=1.0, cost=1.0, now_s=0.0)
    assert queue.remove(gone) and not queue.remove(gone)
    assert _drain(queue, 1) == ["kept"]
    assert queue.depths() == {} and len(queue) == 0


def test_pop_skips_what_is_not_eligible() -> None:
    queue: FairQueue[str] = FairQueue()
    _fill(queue, "a", 2)
    _fill(queue, "b", 2)
    queued = queue.pop(lambda item: item.startswith("b"))
    assert queued is not None and queued.item == "b0"
    assert queue.pop(lambda item: False) is None
    assert len(queue) == 3


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="floor_share"):
        FairQueue(floor_share=1.5)
    with pytest.raises(ValueError, match="weight"):
        FairQueue[str]().push("x", scope="a", band=0, weight=0.0, cost=1.0, now_s=0.0)


def test_idle_scopes_are_forgotten() -> None:
    """Memory follows the backlog: thousands of end users served once leave no entries once
    the band's virtual time has passed them."""
    queue: FairQueue[str] = FairQueue()
    for i in range(2_000):
        queue.charge(f"user{i}", 0, 1.0, 10.0)
    queue.charge("last", 0, 1.0, 10.0)
    assert queue.counter("user0", 0) is None
    assert sum(1 for i in range(2_000) if queue.counter(f"user{i}", 0) is not None) <= 200


# -- properties ---------------------------------------------------------------------------------
weights = st.lists(st.sampled_from([1.0, 2.0, 3.0, 4.0]), min_size=2, max_size=4)
costs = st.lists(st.integers(1, 50), min_size=2, max_size=30)
"""At least two requests per scope, so a scope stays backlogged while one is requeued."""


@settings(max_examples=60, deadline=None)
@given(weights=weights, costs=costs, rounds=st.integers(50, 400))
def test_shares_converge_to_the_weights(
    weights: list[float], costs: list[int], rounds: int
) -> None:
    """Scopes that stay backlogged are served weighted tokens within one request's cost of
    each other: |S_i / w_i − S_j / w_j| <= max cost / min weight."""
    queue: FairQueue[int] = FairQueue()
    served = [0.0] * len(weights)
    for i, w in enumerate(weights):
        for c in costs:
            queue.push(c, scope=str(i), band=0, weight=w, cost=float(c), now_s=0.0)
    for _ in range(rounds):
        queued = queue.pop()
        assert queued is not None
        i = int(queued.scope)
        served[i] += queued.cost
        # keep every scope backlogged: requeue the same request at its back
        queue.push(
            queued.item, scope=queued.scope, band=0, weight=weights[i], cost=queued.cost, now_s=0.0
        )
    normalized = [s / w for s, w in zip(served, weights, strict=True)]
    assert max(normalized) - min(normalized) <= max(costs) / min(weights) + 1e-9


@settings(max_examples=60, deadline=None)
@given(alone=st.integers(1, 200), costs=costs, rounds=st.integers(1, 200))
def test_a_returning_scope_gets_no_banked_credit(alone: int, costs: list[int], rounds: int) -> None:
    """However long A ran alone, once B returns B's served tokens never lead A's by more than
    one request's cost: nothing of B's idle time is spent."""
    queue: FairQueue[int] = FairQueue()
    for k in range(alone):
        queue.push(
            costs[k % len(costs)],
            scope="a",
            band=0,
            weight=1.0,
            cost=float(costs[k % len(costs)]),
            now_s=0.0,
        )
        queued = queue.pop()
        assert queued is not None and queued.scope == "a"
    served = {"a": 0.0, "b": 0.0}
    for scope in ("a", "b"):
        for c in costs:
            queue.push(c, scope=scope, band=0, weight=1.0, cost=float(c), now_s=1.0)
    for _ in range(rounds):
        queued = queue.pop()
        assert queued is not None
        served[queued.scope] += queued.cost
        queue.push(queued.item, scope=queued.scope, band=0, weight=1.0, cost=queued.cost, now_s=1.0)
        assert served["b"] - served["a"] <= max(costs)


@settings(max_examples=60, deadline=None)
@given(
    floor=st.sampled_from([0.02, 0.05, 0.1, 0.25, 0.5, 1.0]),
    num_bands=st.integers(2, 5),
    rounds=st.integers(20, 600),
)
def test_no_band_starves_past_its_floor(floor: float, num_bands: int, rounds: int) -> None:
    """With every band backlogged, each lower band gets at least
    floor / (1 + floor × (bands − 1)) of the dispatches (within one), the best band the rest."""
    queue: FairQueue[int] = FairQueue(floor_share=floor)
    for band in range(num_bands):
        for _ in range(2):  # two each: a band stays backlogged while one is requeued
            queue.push(band, scope=f"s{band}", band=band, weight=1.0, cost=1.0, now_s=0.0)
    count = [0] * num_bands
    for _ in range(rounds):
        queued = queue.pop()
        assert queued is not None
        count[queued.band] += 1
        queue.push(
            queued.item, scope=queued.scope, band=queued.band, weight=1.0, cost=1.0, now_s=0.0
        )
    share = floor / (1 + floor * (num_bands - 1))
    for band in range(1, num_bands):
        assert count[band] >= share * rounds - 2
    assert count[0] >= rounds / (1 + floor * (num_bands - 1)) - num_bands


@settings(max_examples=60, deadline=None)
@given(
    pushes=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 2), st.integers(1, 100)),
        min_size=1,
        max_size=60,
    )
)
def test_work_conserving(pushes: list[tuple[str, int, int]]) -> None:
    """Whatever is queued comes out, each request once; a lone scope gets every dispatch."""
    queue: FairQueue[int] = FairQueue()
    for n, (scope, band, cost) in enumerate(pushes):
        queue.push(n, scope=scope, band=band, weight=1.0, cost=float(cost), now_s=0.0)
    out = [queued.item for queued in iter(queue.pop, None)]
    assert sorted(out) == list(range(len(pushes)))
    assert len(queue) == 0


@settings(max_examples=100, deadline=None)
@given(
    queued=st.lists(st.floats(0, 20_000), max_size=8),
    bound=st.floats(1, 10_000),
    claimed=st.floats(0, 30_000),
)
def test_the_early_exit_room_check_agrees_with_the_headroom(
    queued: list[float], bound: float, claimed: float
) -> None:
    assert has_headroom(queued, bound, claimed) == (headroom_tokens(queued, bound) > claimed)


def test_an_idle_replica_has_room_for_a_request_of_any_size() -> None:
    assert headroom_tokens([0.0], 100.0) == 100.0 and has_headroom([0.0], 100.0, 0.0)
    assert not has_headroom([150.0, 100.0], 100.0, 0.0)  # both at or past the bound


def test_settling_a_charge_moves_the_counter_by_the_real_cost() -> None:
    """A request estimated at 13,000 tokens that the engine served as 8,000 (a better token
    estimate, a cache hit) gives its scope back 5,000 / weight: counters count served work."""
    queue: FairQueue[str] = FairQueue()
    _fill(queue, "a", 2, cost=13_000.0, weight=2.0)
    assert _drain(queue, 1) == ["a0"]
    assert queue.counter("a", 0) == pytest.approx(6_500.0)
    queue.settle("a", 0, 8_000.0 - 13_000.0)
    assert queue.counter("a", 0) == pytest.approx(4_000.0)
    queue.settle("gone", 0, 1.0)  # a scope no longer tracked: nothing to correct
    assert queue.counter("gone", 0) is None


@settings(max_examples=60, deadline=None)
@given(
    weights=weights,
    costs=costs,
    rounds=st.integers(10, 200),
    settles=st.lists(st.integers(-50, 50), max_size=20),
)
def test_shared_service_is_what_the_counters_were_charged(
    weights: list[float], costs: list[int], rounds: int, settles: list[int]
) -> None:
    """With `share()`, what `take_served` hands out (what peers add to their counters) is
    exactly the service each scope's counter was charged here (pops, charges, settlements),
    in counter units; and another queue's `add_remote` of it moves a tracked scope's counter
    by just that."""
    queue: FairQueue[int] = FairQueue()
    queue.share()
    served: dict[str, float] = {}
    for i, w in enumerate(weights):
        for c in costs:
            queue.push(c, scope=str(i), band=0, weight=w, cost=float(c), now_s=0.0)
    for k in range(rounds):
        queued = queue.pop()
        assert queued is not None
        i = int(queued.scope)
        served[queued.scope] = served.get(queued.scope, 0.0) + queued.cost / weights[i]
        queue.push(
            queued.item, scope=queued.scope, band=0, weight=weights[i], cost=queued.cost, now_s=0.0
        )
        if k < len(settles):
            queue.settle(queued.scope, 0, float(settles[k]))
            served[queued.scope] += settles[k] / weights[i]
    shared = queue.take_served()
    assert shared.keys() == {(0, s) for s in served}
    for scope, total in served.items():
        assert abs(shared[(0, scope)] - total) <= 1e-6 * max(1.0, abs(total))
    assert queue.take_served() == {}  # taken once
    before = queue.counter("0", 0)
    assert before is not None
    queue.add_remote("0", 0, 12.5)
    assert queue.counter("0", 0) == before + 12.5
    queue.add_remote("nobody", 0, 12.5)  # untracked: not followed
    assert queue.counter("nobody", 0) is None


# -- the bounded affinity wait ------------------------------------------------------------------
def test_a_request_waits_for_its_full_replica_only_while_the_prefix_is_worth_it() -> None:
    cached = {"a": 10_000.0, "b": 0.0}
    full_a = {"a": False, "b": True}
    # 10,000 cached tokens at 10,000/s save 1 s: it waits up to the bound or that, the less
    assert affinity_verdict(cached, full_a, 10_000, 0.5, 0.0) == "wait"
    assert affinity_verdict(cached, full_a, 10_000, 0.5, 0.5) == "elsewhere"  # the bound
    assert affinity_verdict(cached, full_a, 10_000, 2.0, 0.9) == "wait"
    assert affinity_verdict(cached, full_a, 10_000, 2.0, 1.0) == "elsewhere"  # what it saves
    assert affinity_verdict(cached, full_a, 10_000, 0.0, 0.0) == "elsewhere"  # off: at once
    assert affinity_verdict(cached, {"a": True, "b": True}, 10_000, 0.5, 0.0) == "go"
    assert affinity_verdict({"a": 0.0, "b": 0.0}, full_a, 10_000, 0.5, 0.0) == "go"
    assert affinity_verdict(cached, {"a": False, "b": False}, 10_000, 0.5, 0.0) == "go"
    # what it saves is over the best replica with room, not over a cold one
    assert affinity_verdict({**cached, "b": 8_000.0}, full_a, 10_000, 0.5, 0.2) == "elsewhere"
    # another replica holding as much, with room: nothing to wait for
    both = {"a": 10_000.0, "b": 10_000.0, "c": 0.0}
    assert affinity_verdict(both, {"a": False, "b": True, "c": True}, 10_000, 0.5, 0.0) == "go"


_replicas = st.dictionaries(
    st.sampled_from("abcd"),
    st.tuples(st.integers(0, 50_000).map(float), st.booleans()),
    min_size=1,
)


@given(
    _replicas,
    st.floats(0.0, 5.0),
    st.floats(0.0, 10.0),
)
@settings(max_examples=300, deadline=None)
def test_the_affinity_wait_is_bounded_and_only_for_a_full_best_replica_while_worth_it(
    replicas: dict[str, tuple[float, bool]], max_wait_s: float, waited_s: float
) -> None:
    cached = {r: c for r, (c, _) in replicas.items()}
    room = {r: ok for r, (_, ok) in replicas.items()}
    verdict = affinity_verdict(cached, room, 10_000.0, max_wait_s, waited_s)
    best = max(cached.values())
    roomy = [cached[r] for r in room if room[r]]
    if verdict == "wait":
        assert waited_s < max_wait_s  # bounded
        assert all(not room[r] for r in cached if cached[r] == best)  # its replica is full
        assert (best - max(roomy)) / 10_000.0 > waited_s  # never longer than the cache's worth
    if verdict == "elsewhere":
        assert roomy and best > 0  # somewhere with room to go
    if best > 0 and any(room[r] for r in cached if cached[r] == best):
        assert verdict == "go"
    assert affinity_verdict(cached, room, 10_000.0, 0.0, 0.0) != "wait"  # 0: never waits


# -- room held back from lower bands while a higher one is active -------------------------------


def test_a_band_is_active_while_queued_or_seen_within_the_window() -> None:
    activity = BandActivity(active_s=5.0)
    assert activity.best(0.0) is None
    activity.seen(5, 0.0)
    activity.seen(0, 1.0)
    assert activity.best(2.0) == 0
    assert activity.best(6.0) == 0  # band 0 seen 5 s ago: still active
    assert activity.best(6.5) is None  # both past the window (and forgotten)
    assert activity.best(6.5, backlogged=[3, 7]) == 3
    assert band_room_bound(5, 0, 1_000.0, 0.5) == 500.0
    assert band_room_bound(0, 0, 1_000.0, 0.5) == 1_000.0  # its own band is not above it
    assert band_room_bound(5, None, 1_000.0, 0.5) == 1_000.0
    with pytest.raises(ValueError, match="active_s"):
        BandActivity(active_s=-1.0)


def test_a_band_that_earned_a_whole_floor_dispatch_is_owed_it() -> None:
    queue: FairQueue[str] = FairQueue(floor_share=0.5)
    _fill(queue, "hi", 3, band=0)
    _fill(queue, "lo", 3, band=5)
    assert queue.bands() == [0, 5] and not queue.owed(5)
    _drain(queue, 1)
    assert not queue.owed(5)  # half a dispatch earned
    assert queue.pop(lambda item: item.startswith("hi")) is not None  # lo not eligible: hi goes
    assert queue.owed(5) and not queue.owed(0)
    assert not FairQueue(floor_share=0.0).owed(5)


@settings(max_examples=100, deadline=None)
@given(
    seen=st.lists(st.tuples(st.integers(0, 6), st.floats(0, 20)), max_size=12),
    backlogged=st.lists(st.integers(0, 6), max_size=3),
    band=st.integers(0, 6),
    now_s=st.floats(0, 30),
    share=st.floats(0.01, 1.0),
)
def test_with_no_higher_band_active_a_lower_band_gets_the_whole_bound(
    seen: list[tuple[int, float]], backlogged: list[int], band: int, now_s: float, share: float
) -> None:
    """The bound is the whole one unless a better band was seen within the window before
    `now_s` or is queued; then (only then) the share."""
    activity = BandActivity(active_s=5.0)
    for seen_band, at in sorted(seen, key=lambda pair: pair[1]):
        if at <= now_s:
            activity.seen(seen_band, at)
    active = {b for b, at in seen if at <= now_s and now_s - at <= 5.0} | set(backlogged)
    bound = band_room_bound(band, activity.best(now_s, backlogged), 1_000.0, share)
    if any(b < band for b in active):
        assert bound == pytest.approx(1_000.0 * share)
    else:
        assert bound == 1_000.0


@settings(max_examples=100, deadline=None)
@given(
    low_sizes=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    high_at=st.lists(st.integers(0, 300), max_size=12),
    bound=st.integers(1, 40),
    share=st.sampled_from([0.25, 0.5, 0.75, 1.0]),
)
def test_with_a_higher_band_active_the_lower_bands_queued_work_stays_under_the_share(
    low_sizes: list[int], high_at: list[int], bound: int, share: float
) -> None:
    """One replica prefilling first come, first served, one unit of work per step; a lower band
    flooding it (its prompts cycling through `low_sizes`); a higher band's requests (5 units)
    arriving at `high_at`. Each step the higher band's waiting requests go while the replica's
    queue is under the bound, then the lower band's while it is under its band's bound. While
    the higher band is active, a lower request only ever goes into a queue under the share of
    the bound, so a higher-band request arriving once what was queued when the band became
    active has drained finds less than one lower prefill plus that share of lower-band work
    queued ahead of it (the first after a gap finds up to the whole bound's)."""
    activity = BandActivity(active_s=50.0)
    fifo: deque[list[float]] = deque()  # [band, work left]
    waiting = sent = 0
    since = 0
    for step in range(320):
        if fifo:
            fifo[0][1] -= 1.0
            if fifo[0][1] <= 0:
                fifo.popleft()
        for _ in range(high_at.count(step)):
            if activity.best(float(step)) != 0:
                since = step  # active from now: what is queued drains by since + its work
            elif step - since >= bound + max(low_sizes):
                lower = sum(work for band, work in fifo if band == 5)
                assert lower < share * bound + max(low_sizes)
            activity.seen(0, float(step))
            waiting += 1
        while waiting and sum(work for _, work in fifo) < bound:  # the whole bound
            fifo.append([0, 5.0])
            waiting -= 1
        while True:
            queued = sum(work for _, work in fifo)
            best = activity.best(float(step), [0] if waiting else [])
            if not has_headroom([queued], band_room_bound(5, best, float(bound), share), 0.0):
                break
            if best == 0:
                assert queued < share * bound
            fifo.append([5, float(low_sizes[sent % len(low_sizes)])])
            sent += 1
