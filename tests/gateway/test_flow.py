"""Flow control's queue (gateway.pipeline.flow) on a real replica set: room, order, limits,
clients that leave. The engines are not needed: leases put the load on the replicas."""

from __future__ import annotations

import asyncio
import random

import pytest
import uvloop

from gateway.errors import ClientGone, InvalidRequest, Overloaded, QueueFull
from gateway.fleet.engine_metrics import EngineMetrics
from gateway.fleet.replicas import (
    MIN_PREFILL_SAMPLES,
    PREFILL_RATE_KEPT,
    PREFILL_RATE_WINDOW,
    FleetLoad,
    Lease,
    ReplicaSet,
    ReplicaState,
)
from gateway.fleet.shared_load import PeerLoad
from gateway.pipeline.flow import FlowControl, FlowLimits, Ticket, request_priority
from gateway.request.parsed import CHAT, ParsedRequest
from gateway.request.tenant import Tenant, TenantPolicy
from router.fairness import BAND_ACTIVE_S, FairQueue

MODEL = "m"
BOUND = 1_000.0


async def _never(_: str) -> None:
    return None


def _replicas(n: int = 1) -> ReplicaSet:
    replicas = ReplicaSet(
        [f"http://r{i}" for i in range(n)],
        interval_s=1.0,
        timeout_s=1.0,
        unhealthy_after=1,
        on_restart=_never,
    )
    for state in replicas.states.values():
        state.healthy = True
        state.models = frozenset({MODEL})
    return replicas


def _flow(
    replicas: ReplicaSet, floor_share: float = 0.0, measure_rate: bool = True, **limits: float
) -> FlowControl:
    values: dict[str, float] = {
        "max_pending_prefill_tokens": BOUND,
        "max_queued_per_scope": 8,
        "max_queued": 16,
        "max_queue_s": 10.0,
        "prefill_tokens_per_s": 1_000.0,
        "lower_band_room_share": 0.5,
    }
    values.update(limits)
    return FlowControl(
        replicas,
        FlowLimits(
            max_pending_prefill_tokens=values["max_pending_prefill_tokens"],
            max_queued_per_scope=int(values["max_queued_per_scope"]),
            max_queued=int(values["max_queued"]),
            max_queue_s=values["max_queue_s"],
            prefill_tokens_per_s=values["prefill_tokens_per_s"],
            lower_band_room_share=values["lower_band_room_share"],
            measure_rate=measure_rate,
        ),
        FairQueue(floor_share=floor_share),
    )


def _tenant(name: str, **policy: object) -> Tenant:
    return Tenant(name, name.encode(), policy=TenantPolicy(**policy))  # type: ignore[arg-type]


def _fill(replicas: ReplicaSet) -> Lease:
    """Put a prefill over the bound on the (first) replica: no room until it ends."""
    return next(iter(replicas.states.values())).lease(BOUND * 2)


async def _enter(flow: FlowControl, tenant: Tenant, tokens: float, band: int = 0) -> Ticket:
    candidates = flow.replicas.serving(MODEL)
    ticket = flow.try_enter(tenant, band, tokens, 0.0, candidates)
    if ticket is not None:
        return ticket
    return await flow.wait(tenant, band, MODEL, tokens, 0.0)


async def _until(predicate: object, what: str) -> None:
    """Let the loop run until `predicate()` holds (bounded)."""
    for _ in range(1_000):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError(f"timed out waiting for {what}")


async def test_with_room_a_request_dispatches_at_once_and_holds_its_tokens() -> None:
    flow = _flow(_replicas())
    a = _tenant("a")
    ticket = flow.try_enter(a, 0, 400.0, 0.0, flow.replicas.serving(MODEL))
    assert ticket is not None and ticket.queued_s == 0.0
    assert flow.transit_tokens == 400.0
    ticket.routed()
    ticket.routed()  # once, however often
    assert flow.transit_tokens == 0.0
    assert flow.stats.dispatched == {("0", "immediate"): 1}


async def test_transit_stops_a_burst_overshooting_before_its_leases() -> None:
    flow = _flow(_replicas())
    a = _tenant("a")
    first = flow.try_enter(a, 0, 700.0, 0.0, flow.replicas.serving(MODEL))
    second = flow.try_enter(a, 0, 700.0, 0.0, flow.replicas.serving(MODEL))
    # the second goes while the first leaves room (under the bound), the third waits
    assert first is not None and second is not None
    assert flow.try_enter(a, 0, 10.0, 0.0, flow.replicas.serving(MODEL)) is None


async def test_the_running_prefills_progress_makes_room_before_it_ends() -> None:
    """2,000 tokens in prefill at 1,000 tokens/s: no room at first; 1.5 s in, 500 are left, under
    the 1,000-token bound, so the next request goes before the engine runs dry (its progress
    never counts past its own share of what is pending)."""
    replicas = _replicas()
    flow = _flow(replicas)
    state = replicas.states["http://r0"]
    _fill(replicas)
    a = _tenant("a")
    assert flow.try_enter(a, 0, 10.0, 0.0, [state]) is None
    state.prefill_started_s -= 1.5
    assert flow.queued_tokens(state, state.prefill_started_s + 1.5) == pytest.approx(500.0)
    assert flow.try_enter(a, 0, 10.0, 0.0, [state]) is not None
    assert flow.queued_tokens(state, state.prefill_started_s + 60.0) == 0.0


def _prefill(state: ReplicaState, tokens: float, seconds: float, commit: bool = True) -> None:
    """One attempt on `state` that took `seconds` from the engine starting its prefill to its
    first byte (committed) or to its failure (not committed), then ended."""
    with state.lease(tokens) as lease:
        state.prefill_started_s -= seconds
        if commit:
            lease.keep()
    lease.release()


async def test_room_is_counted_at_the_prefill_rate_the_first_tokens_measured() -> None:
    """Engines four times faster than configured (4,000 against 1,000 tokens/s; the bench's
    time-compressed engines ran 3.6x the gateway's default): once eight first tokens measured
    2,000-token prefills in 0.5 s, a replica 0.45 s into its next one has 200 tokens left and
    room under the 0.1-s bound (400 tokens at that rate), so the next request goes before the
    engine runs dry. At the configured rate it would count 1,550 left and send the next one
    only at the first token, idling the engine for the gateway's dispatch each prefill."""
    replicas = _replicas()
    flow = _flow(replicas, max_pending_prefill_tokens=100.0)  # 0.1 s at 1,000 tokens/s
    state = replicas.states["http://r0"]
    a = _tenant("a")
    _prefill(state, 2_000.0, 0.5, commit=False)  # failed attempts measure nothing
    for _ in range(7):
        _prefill(state, 2_000.0, 0.5)
    assert flow.prefill_tokens_per_s() == 1_000.0  # not yet trusted: the configured rate
    _prefill(state, 2_000.0, 0.5)
    assert flow.prefill_tokens_per_s() == pytest.approx(4_000.0, rel=1e-3)
    assert flow.pending_bound() == pytest.approx(400.0, rel=1e-3)
    lease = state.lease(2_000.0)
    state.prefill_started_s -= 0.45
    assert flow.queued_tokens(state, state.prefill_started_s + 0.45) == pytest.approx(
        200.0, abs=1.0
    )
    ticket = flow.try_enter(a, 0, 2_000.0, 0.0, [state])
    assert ticket is not None
    ticket.routed()
    lease.release()
    flow.close()


async def test_without_measure_rate_room_is_counted_at_the_configured_rate() -> None:
    """`flow_measure_rate: false`: the same measured prefills leave the bound and the
    progress at `engine_prefill_tokens_per_s`."""
    replicas = _replicas()
    flow = _flow(replicas, max_pending_prefill_tokens=100.0, measure_rate=False)
    state = replicas.states["http://r0"]
    for _ in range(8):
        _prefill(state, 2_000.0, 0.5)
    assert flow.prefill_tokens_per_s() == 1_000.0 and flow.pending_bound() == 100.0
    lease = state.lease(2_000.0)
    state.prefill_started_s -= 0.45
    assert flow.try_enter(_tenant("a"), 0, 2_000.0, 0.0, [state]) is None
    lease.release()
    flow.close()


def test_a_prefill_begun_behind_other_gateways_prefills_is_not_timed() -> None:
    """Issue 39: behind one Service, a replica's queue holds the other gateways' prefills too
    (their shared load, `ReplicaState.peer`). A prefill of ours that began behind theirs took
    their time as well as its own: timed, it read the engines slower than they are (eight
    2,000-token prefills in 1 s each, behind 2,000 of the peers' tokens: 2,000 tokens/s for
    engines of 4,000), and flow control held requests back from engines with room. Such a
    first token is counted as not timed; one begun with nothing of theirs queued is timed."""
    replicas = _replicas()
    state = replicas.states["http://r0"]
    fleet = replicas.fleet
    state.peer = PeerLoad(num_inflight=1, num_prefilling=1, prefill_tokens=2_000.0)
    for _ in range(MIN_PREFILL_SAMPLES):
        _prefill(state, 2_000.0, 1.0)
    assert (fleet.num_prefills, fleet.num_prefills_unmeasured) == (0, MIN_PREFILL_SAMPLES)
    assert fleet.prefill_tokens_per_s(1_000.0) == 1_000.0  # the configured rate still
    state.peer = PeerLoad(num_inflight=1)  # the peers' request decodes: nothing queued ahead
    for _ in range(MIN_PREFILL_SAMPLES):
        _prefill(state, 2_000.0, 0.5)
    assert fleet.num_prefills == MIN_PREFILL_SAMPLES
    assert fleet.prefill_tokens_per_s(1_000.0) == pytest.approx(4_000.0, rel=1e-3)


def test_the_measured_rate_is_the_fast_half_of_the_last_prefills_by_what_each_took() -> None:
    """The rate is read from the fastest `PREFILL_RATE_KEPT` of the last `PREFILL_RATE_WINDOW`
    prefills, each weighed by its seconds: a prefill slowed by work ahead of it that this
    gateway could not see (a peer's, a decode batch) is left out once the window has faster
    ones, a prefill of nothing (a fully cached prompt) or an instant one adds nothing, and
    old prefills leave the window."""
    fleet = FleetLoad()
    for _ in range(PREFILL_RATE_KEPT):
        fleet.observe_prefill(1_000.0, 1.0)
    fleet.observe_prefill(0.0, 0.2)
    fleet.observe_prefill(500.0, 0.0)
    assert fleet.prefill_tokens_per_s(9.0) == pytest.approx(1_000.0)
    for _ in range(PREFILL_RATE_WINDOW - PREFILL_RATE_KEPT):  # slowed by work ahead
        fleet.observe_prefill(1_000.0, 3.0)
    assert fleet.prefill_tokens_per_s(9.0) == pytest.approx(1_000.0)
    fleet.observe_prefill(30_000.0, 10.0)  # 3,000 tokens/s, ten seconds; the oldest leaves
    tokens = 30_000.0 + 1_000.0 * (PREFILL_RATE_KEPT - 1)
    seconds = 10.0 + 1.0 * (PREFILL_RATE_KEPT - 1)
    assert fleet.prefill_tokens_per_s(9.0) == pytest.approx(tokens / seconds)
    for _ in range(PREFILL_RATE_WINDOW):  # the engines slowed down: the window follows
        fleet.observe_prefill(500.0, 1.0)
    assert fleet.prefill_tokens_per_s(9.0) == pytest.approx(500.0)


async def test_a_light_scope_overtakes_a_flooding_ones_backlog() -> None:
    """A's backlog of ten waits for room; B's request, queued after all of them, goes second
    (after the A request at the head, which is older at an equal counter)."""
    replicas = _replicas()
    flow = _flow(replicas, max_queued_per_scope=10)
    lease = _fill(replicas)
    a, b = _tenant("a"), _tenant("b")
    order: list[str] = []

    async def client(tenant: Tenant, n: int) -> None:
        ticket = await _enter(flow, tenant, 600.0)
        order.append(f"{tenant.name}{n}")
        with replicas.states["http://r0"].lease(600.0):  # its prefill, done at once
            ticket.routed()

    tasks = [asyncio.create_task(client(a, n)) for n in range(10)]
    await _until(lambda: len(flow.queue) == 10, "A's backlog")
    tasks.append(asyncio.create_task(client(b, 0)))
    await _until(lambda: len(flow.queue) == 11, "B queued")
    lease.prefilled()  # room: the queue drains in the policy's order
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert order.index("b0") <= 1, order
    assert flow.stats.dispatched[("0", "queued")] == 11
    assert flow.transit_tokens == 0.0


async def test_a_full_scope_gets_429_and_a_full_gateway_503() -> None:
    replicas = _replicas()
    flow = _flow(replicas, max_queued_per_scope=2, max_queued=3)
    lease = _fill(replicas)
    a, b = _tenant("a"), _tenant("b")
    waiting = [asyncio.create_task(_enter(flow, a, 10.0)) for _ in range(2)]
    await _until(lambda: len(flow.queue) == 2, "A queued")
    with pytest.raises(QueueFull) as own:
        await _enter(flow, a, 10.0)
    assert own.value.status == 429 and int(own.value.headers()["retry-after"]) >= 1
    waiting.append(asyncio.create_task(_enter(flow, b, 10.0)))
    await _until(lambda: len(flow.queue) == 3, "B queued")
    with pytest.raises(Overloaded) as full:
        await _enter(flow, _tenant("c"), 10.0)
    assert full.value.status == 503 and "retry-after" in full.value.headers()
    assert flow.stats.rejects == {"scope_full": 1, "gateway_full": 1}
    lease.prefilled()
    for ticket in await asyncio.wait_for(asyncio.gather(*waiting), 5.0):
        ticket.routed()


async def test_a_429s_retry_after_is_within_the_queues_own_wait_bound() -> None:
    """A backlog of long prompts would take minutes at one replica's rate, but no request waits
    longer than `max_queue_s`: the Retry-After says no more (and stays under the 2 minutes the
    openai SDK waits out; past them it gives up at once)."""
    replicas = _replicas()
    flow = _flow(replicas, max_queued_per_scope=2, max_queue_s=10.0, prefill_tokens_per_s=1.0)
    lease = _fill(replicas)
    a = _tenant("a")
    waiting = [asyncio.create_task(_enter(flow, a, 10.0)) for _ in range(2)]
    await _until(lambda: len(flow.queue) == 2, "A queued")
    with pytest.raises(QueueFull) as own:
        await _enter(flow, a, 10.0)  # 2 x 10 s of prefill ahead at 1 token/s
    assert own.value.headers()["retry-after"] == "10"
    lease.prefilled()
    for ticket in await asyncio.wait_for(asyncio.gather(*waiting), 5.0):
        ticket.routed()


async def test_waiting_too_long_is_503_unless_behind_its_own_backlog() -> None:
    """The first request waited for the fleet (503); the second arrived behind the first, its
    own scope's backlog (429)."""
    replicas = _replicas()
    flow = _flow(replicas, max_queue_s=0.1)
    _fill(replicas)
    a = _tenant("a")
    first = asyncio.create_task(_enter(flow, a, 10.0))
    await _until(lambda: len(flow.queue) == 1, "first queued")
    second = asyncio.create_task(_enter(flow, a, 10.0))
    with pytest.raises(Overloaded, match="no room"):
        await first
    with pytest.raises(QueueFull, match="behind 1 earlier"):
        await second
    assert len(flow.queue) == 0
    assert flow.stats.rejects == {"fleet_timeout": 1, "scope_timeout": 1}


async def test_a_client_gone_while_queued_is_removed_and_never_dispatched() -> None:
    replicas = _replicas()
    flow = _flow(replicas)
    lease = _fill(replicas)
    gone = asyncio.create_task(_enter(flow, _tenant("a"), 10.0))
    await _until(lambda: len(flow.queue) == 1, "queued")
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(flow.queue) == 0 and flow.stats.rejects == {"client_gone": 1}
    lease.prefilled()
    assert flow.transit_tokens == 0.0 and ("0", "queued") not in flow.stats.dispatched


async def test_a_client_left_while_queued_is_a_client_gone_and_never_dispatched() -> None:
    replicas = _replicas()
    flow = _flow(replicas)
    lease = _fill(replicas)
    left = asyncio.Event()

    async def client_left() -> None:
        await left.wait()

    waiting = asyncio.create_task(flow.wait(_tenant("a"), 0, MODEL, 10.0, 0.0, client_left))
    await _until(lambda: len(flow.queue) == 1, "queued")
    left.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(waiting, 5.0)
    assert len(flow.queue) == 0 and flow.stats.rejects == {"client_gone": 1}
    lease.prefilled()
    assert flow.transit_tokens == 0.0


async def test_a_request_let_through_from_the_queue_is_placed_where_the_room_is() -> None:
    """Both replicas full, a request waits; r1's prefill ends: it is let through for r1's room,
    and its placement passes over r0 (placed on full r0, it would wait in r0's engine queue
    while r1 idled until a prefill of ours ended: half the noisy neighbour's dispatches did).
    Passed over, not left out: a fan-out sibling whose leader lands on r0 still goes there
    (tests/e2e/test_fanout_shared.py)."""
    replicas = _replicas(2)
    flow = _flow(replicas)
    leases = [s.lease(BOUND * 2) for s in replicas.states.values()]
    waiter = asyncio.create_task(_enter(flow, _tenant("a"), 10.0))
    await _until(lambda: len(flow.queue) == 1, "queued")
    leases[1].prefilled()
    ticket = await asyncio.wait_for(waiter, 1.0)  # woken by the prefill's end, not a tick
    assert ticket.queued_s >= 0.0
    assert ticket.full == frozenset({"http://r0"})
    ticket.routed()
    assert flow.stats.affinity == {}  # not an affinity outcome: nothing was cached
    flow.close()


async def test_the_queue_wakes_when_the_running_prefills_progress_makes_room() -> None:
    """2,000 tokens in prefill at 20,000 tokens/s against a 1,000-token bound: the replica has
    room 50 ms after the prefill began (1,000 left). A waiting request's next pump is timed for
    that moment, not for a periodic tick (one a prefill ending or a placement would not bring),
    and it is let through then, before the prefill ends."""
    replicas = _replicas()
    flow = _flow(replicas, prefill_tokens_per_s=20_000.0)
    state = replicas.states["http://r0"]
    lease = _fill(replicas)
    waiter = asyncio.create_task(_enter(flow, _tenant("a"), 10.0))
    await _until(lambda: len(flow.queue) == 1, "queued")
    assert flow._tick is not None
    assert flow._tick.when() == pytest.approx(state.prefill_started_s + 0.05, abs=0.002)
    ticket = await asyncio.wait_for(waiter, 5.0)
    assert state.num_prefilling == 1  # let through before the prefill ended
    ticket.routed()
    lease.release()
    flow.close()


async def test_a_placement_wakes_the_queue_it_held_back() -> None:
    """Two requests of 1,200 tokens wait on a replica; its prefill ends and the first is let
    through (the idle replica takes any size; 1,200 in transit fill its 1,000-token room).
    Placed (its tokens leave transit), it wakes the queue itself once its lease (100 uncached)
    is counted, after its task's step: the second is let through then, not at a later tick."""
    replicas = _replicas()
    flow = _flow(replicas)
    state = replicas.states["http://r0"]
    lease = _fill(replicas)
    a = _tenant("a")
    first = asyncio.create_task(_enter(flow, a, 1_200.0))
    second = asyncio.create_task(_enter(flow, a, 1_200.0))
    await _until(lambda: len(flow.queue) == 2, "both queued")
    lease.release()
    ticket = await first
    assert len(flow.queue) == 1
    ticket.routed()
    assert len(flow.queue) == 1  # not before its lease is taken (in the same step)
    with state.lease(100.0):  # placed: a lease of its uncached 100 (cached elsewhere)
        assert flow._soon is not None and flow._tick is not None
        tick_at = flow._tick.when()
        await _until(lambda: len(flow.queue) == 0, "the second let through")
        assert asyncio.get_running_loop().time() < tick_at  # by the placement, not the tick
        (await second).routed()
    flow.close()


async def test_a_lower_band_gets_half_the_room_while_a_higher_band_is_active() -> None:
    """700 tokens queued on the replica against a 1,000-token bound (a prefill rate slow enough
    that its progress does not count here). Band 5 alone gets the whole bound; once band 0 has
    been seen, band 5 gets room only under half of it (500), so band 0's next request would
    wait behind at most that much of band 5's work; band 0 keeps the whole bound. Band 5 waits
    until the replica is under 500, and has the whole bound again once band 0 has been quiet
    for `BAND_ACTIVE_S`."""
    replicas = _replicas()
    flow = _flow(replicas, prefill_tokens_per_s=1.0)
    now = [100.0]
    flow.clock = lambda: now[0]
    state = replicas.states["http://r0"]
    low, high = _tenant("low", priority=5), _tenant("high")
    lease = state.lease(700.0)
    ticket = flow.try_enter(low, 5, 10.0, 0.0, [state])
    assert ticket is not None  # no better band active: the whole bound
    ticket.routed()
    ticket = flow.try_enter(high, 0, 10.0, 0.0, [state])
    assert ticket is not None
    ticket.routed()
    assert flow.band_bound(5) == BOUND / 2 and flow.band_bound(0) == BOUND
    assert flow.try_enter(low, 5, 10.0, 0.0, [state]) is None
    waiting = asyncio.create_task(flow.wait(low, 5, MODEL, 10.0, 0.0))
    await _until(lambda: len(flow.queue) == 1, "band 5 queued")
    (await _enter(flow, high, 10.0)).routed()  # band 0 overtakes it, into the whole bound
    assert len(flow.queue) == 1
    lease.release()
    with state.lease(450.0):  # under half the bound: band 5 goes
        (await asyncio.wait_for(waiting, 5.0)).routed()
    now[0] += BAND_ACTIVE_S + 0.1
    assert flow.band_bound(5) == BOUND
    with state.lease(700.0):
        assert flow.try_enter(low, 5, 10.0, 0.0, [state]) is not None
    flow.close()


async def test_a_lower_band_owed_its_floor_gets_the_whole_room() -> None:
    """Both bands wait; 700 tokens queued leaves room under the whole bound, not under band 5's
    half. At floor 0.5 band 5 has earned a whole dispatch after two of band 0's, and takes the
    next one into the whole bound: held to the share, it would never find the queue under 500
    while band 0's backlog refills it, and its floor would starve."""
    replicas = _replicas()
    flow = _flow(replicas, floor_share=0.5, prefill_tokens_per_s=1.0)
    state = replicas.states["http://r0"]
    low, high = _tenant("low", priority=5), _tenant("high")
    lease = _fill(replicas)
    order: list[str] = []

    async def client(tenant: Tenant, band: int, name: str) -> None:
        ticket = await flow.wait(tenant, band, MODEL, 1.0, 0.0)
        order.append(name)
        ticket.routed()

    tasks = [asyncio.create_task(client(high, 0, f"high{i}")) for i in range(3)]
    tasks.append(asyncio.create_task(client(low, 5, "low")))
    await _until(lambda: len(flow.queue) == 4, "all queued")
    with state.lease(700.0):
        lease.release()  # 700 left queued: the queue is pumped
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert order == ["high0", "high1", "low", "high2"]
    assert len(flow.queue) == 0 and flow.transit_tokens == 0.0
    flow.close()


def _parsed(priority: int | None) -> ParsedRequest:
    return ParsedRequest(CHAT, MODEL, {}, b"x", False, False, priority=priority)


def test_priority_within_the_tenants_range_else_400_naming_the_field() -> None:
    tiered = _tenant("t", priority=2, priority_range=(1, 5))
    assert request_priority(_parsed(None), tiered) == 2
    assert request_priority(_parsed(1), tiered) == 1
    with pytest.raises(InvalidRequest) as bad:
        request_priority(_parsed(0), tiered)
    assert bad.value.param == "priority" and "1 to 5" in bad.value.message
    with pytest.raises(InvalidRequest):
        request_priority(_parsed(1), _tenant("plain"))


def test_bad_weights_and_bands_name_the_problem() -> None:
    with pytest.raises(ValueError, match="weight"):
        TenantPolicy(weight=0.0)
    with pytest.raises(ValueError, match="priority_range"):
        TenantPolicy(priority_range=(3, 1))
    with pytest.raises(ValueError, match="outside priority_range"):
        TenantPolicy(priority=9, priority_range=(0, 2))


async def test_waiters_released_for_one_replica_claim_its_room_until_placed() -> None:
    """Two requests cached on r0 (full) wait for it while r1 is idle (worth it: 5,000 cached
    tokens save 5 s at 1,000/s, over the 2 s bound). r0's room back, the first is let through
    for r0 and claims its 1,200 tokens there until it is placed (past the 1,000-token bound), so
    the second keeps waiting rather than overfill r0; once the first is placed (its
    lease on r0), the second is let through past its bound, r0 passed over but not left out: it
    holds the prompt, so the router still weighs its cache (issue 39)."""
    replicas = _replicas(2)
    clock = [0.0]
    flow = _flow(replicas)
    flow.clock = lambda: clock[0]
    flow.limits = FlowLimits(**{**flow.limits.__dict__, "affinity_wait_s": 2.0})
    lease = _fill(replicas)
    r0 = replicas.states["http://r0"]
    cached = {"http://r0": 5_000.0, "http://r1": 0.0}
    a, b = _tenant("a"), _tenant("b")
    candidates = replicas.serving(MODEL)
    assert flow.try_enter(a, 0, 1_200.0, 0.0, candidates, cached) is None  # r0 is full
    first = asyncio.create_task(flow.wait(a, 0, MODEL, 1_200.0, 0.0, cached=cached))
    second = asyncio.create_task(flow.wait(b, 0, MODEL, 1_200.0, 0.0, cached=cached))
    await _until(lambda: len(flow.queue) == 2, "both waiting for r0")
    other = flow.try_enter(_tenant("c"), 0, 100.0, 0.0, candidates)  # nothing cached: no wait
    assert other is None  # behind the queue, as always...
    third = await flow.wait(_tenant("c"), 0, MODEL, 100.0, 0.0)  # ...and let through at once
    third.routed()
    lease.release()  # r0 has room: the first goes, the second stays
    flow.pump()
    ticket = await first
    assert flow.claimed == {"http://r0": 1_200.0}
    assert len(flow.queue) == 1
    with r0.lease(1_200.0):  # placed on r0: its lease takes over from the claim
        ticket.routed()
        assert flow.claimed == {}
        clock[0] = 2.5  # past the second's bound, r0 still full
        flow.pump()
        late = await second
    assert late.full == frozenset({"http://r0"})
    late.routed()
    assert flow.stats.affinity == {"waited": 1, "bound": 1}


async def test_a_pd_fleets_queue_waits_for_its_prefill_pool_and_its_decode_pool() -> None:
    """Issue 42: in a disaggregated fleet the queue is the prefill pool's. r0 (prefill) full,
    r1 (decode) idle: a queued request waits (it had been dispatched at once, the idle decode
    instance's room counted as the fleet's). And the decode pool's room counts too: its
    engine's own queue over the bound holds requests the prefill pool has room for."""
    replicas = _replicas(2)
    prefill, decode = replicas.states["http://r0"], replicas.states["http://r1"]
    flow = _flow(replicas)
    flow.pools = lambda model: ([prefill], [decode])
    a = _tenant("a")
    lease = _fill(replicas)
    assert flow.try_enter(a, 0, 10.0, 0.0, [prefill], decode=[decode]) is None
    waiting = asyncio.ensure_future(flow.wait(a, 0, MODEL, 10.0, 0.0))
    await _until(lambda: len(flow.queue) == 1, "the request to queue")
    flow.pump()
    assert not waiting.done() and len(flow.queue) == 1  # the decode pool's room is not the queue's
    lease.release()
    (await waiting).routed()
    # the decode engine reports requests waiting there, each at this gateway's mean request
    fleet = replicas.fleet
    fleet.mean_request_tokens = BOUND
    decode.metrics = EngineMetrics(num_running=0.0, num_waiting=2.0)
    assert flow.try_enter(a, 0, 10.0, 0.0, [prefill], decode=[decode]) is None
    held = asyncio.ensure_future(flow.wait(a, 0, MODEL, 10.0, 0.0))
    await _until(lambda: len(flow.queue) == 1, "the request to queue")
    flow.pump()
    assert not held.done()
    decode.metrics = EngineMetrics(num_running=0.0, num_waiting=0.0)
    flow.pump()
    (await held).routed()
    assert flow.try_enter(a, 0, 10.0, 0.0, [prefill], decode=[decode]) is not None


@pytest.mark.parametrize("waiting", [None, 0.0, 1.0, 5.0])
def test_a_replicas_queued_prefill_is_its_snapshots_without_building_one(
    waiting: float | None,
) -> None:
    """Flow control's read of a replica's queued prefill (`queued_prefill_tokens`, on every
    turn of the queue) is the snapshot's own prefill plus other gateways' waiting requests."""
    replicas = _replicas(2)
    state = next(iter(replicas.states.values()))
    lease = state.lease(700.0)
    state.metrics = EngineMetrics(num_waiting=waiting)
    state.own_waiting_at_scrape = 1
    snapshot = state.snapshot()
    expected = snapshot.pending_prefill_tokens + snapshot.foreign_prefill_tokens
    assert state.queued_prefill_tokens() == pytest.approx(expected)
    if waiting is not None and waiting > 1:
        assert snapshot.foreign_prefill_tokens > 0
    lease.release()


@pytest.mark.parametrize("seed", range(4))
async def test_whatever_way_requests_end_nothing_stays_in_transit_or_claimed(seed: int) -> None:
    """Random traffic on three replicas, cached on some (the affinity wait's claims): requests
    let through at once or from the queue, placed (a lease) or failing before it, clients
    leaving while queued (the front end's watch, or the task cancelled, some in the very turn
    a prefill's end lets them through), queue timeouts. Once every request has ended and
    every lease is released, no token is left in transit or claimed and the queue is empty:
    a leak there would hold room against the fleet for good (issue 43's stall at 0.05 s)."""
    rng = random.Random(seed)
    replicas = _replicas(3)
    flow = _flow(replicas, max_queue_s=0.02, max_queued_per_scope=64, max_queued=256)
    flow.limits = FlowLimits(**{**flow.limits.__dict__, "affinity_wait_s": 0.01})
    states = list(replicas.states.values())
    leases: list[Lease] = []
    tasks: list[asyncio.Task[None]] = []
    leaving: list[asyncio.Event] = []

    async def request(n: int) -> None:
        tokens = rng.choice([50.0, 400.0, 1_500.0])
        cached = None
        if rng.random() < 0.4:
            cached = {s.id: (tokens / 2 if s is states[n % 3] else 0.0) for s in states}
        tenant = _tenant(rng.choice("abc"))
        left = asyncio.Event()
        leaving.append(left)

        async def client_left() -> None:
            await left.wait()

        ticket = flow.try_enter(tenant, 0, tokens, 0.0, states, cached)
        if ticket is None:
            ticket = await flow.wait(tenant, 0, MODEL, tokens, 0.0, client_left, cached=cached)
        try:
            if rng.random() < 0.8:  # placed: its lease takes over (else it fails first)
                leases.append(rng.choice(states).lease(tokens))
        finally:
            ticket.routed()

    for n in range(300):
        roll = rng.random()
        if roll < 0.45:
            tasks.append(asyncio.create_task(request(n)))
        elif roll < 0.65 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            lease.prefilled()  # may let a waiter through in this very turn...
            if tasks and rng.random() < 0.5:
                rng.choice(tasks).cancel()  # ...whose client goes before it resumes
            lease.release()
        elif roll < 0.75 and tasks:
            rng.choice(tasks).cancel()
        elif roll < 0.85 and leaving:
            rng.choice(leaving).set()
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)
    for lease in leases:
        lease.release()
    leases.clear()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10.0)
    for lease in leases:  # placed after the first release
        lease.release()
    errors = (QueueFull, Overloaded, ClientGone, asyncio.CancelledError)
    assert all(r is None or isinstance(r, errors) for r in results), results
    assert len(flow.queue) == 0
    assert flow.transit_tokens == pytest.approx(0.0, abs=1e-6)
    assert flow.claimed == {}
    flow.close()


def test_a_tick_due_at_once_under_uvloop_is_kept_and_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop answers `call_at` for a time under a millisecond away with a plain `Handle`,
    which has no `when()`: the next pump that compared its tick with a new one raised in the
    loop's callback and left the queue unpumped (CI: a 500 in the team-day demo, the gateway's
    log `AttributeError: 'uvloop.loop.Handle' object has no attribute 'when'`). A tick due now
    (room at once by the running prefill's progress) is kept, and a pump after it neither
    raises nor loses it."""
    import gateway.pipeline.flow as flow_module

    monkeypatch.setattr(flow_module, "MIN_TICK_S", 0.0)
    errors: list[dict[str, object]] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        replicas = _replicas()
        flow = _flow(replicas)
        lease = _fill(replicas)
        waiting = asyncio.create_task(_enter(flow, _tenant("a"), 600.0))
        await _until(lambda: len(flow.queue) == 1, "the request queued")
        monkeypatch.setattr(flow, "next_room_s", lambda now_s, bound=None: now_s)  # room now
        flow.pump()  # a tick due at once: uvloop's plain Handle
        flow.pump()  # compared with the tick it holds
        assert flow._tick is not None
        lease.prefilled()
        (await asyncio.wait_for(waiting, 5.0)).routed()

    uvloop.run(go())
    assert errors == []
