"""The simulator's many gateways (issue 39): N routers on one shared directory, each with its
own view of the load, and the Redis directory's capacity by generations."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.directory import Held
from cachemap.keys import BlockHash
from cachemap.redis.directory import RECORD_REFRESH_S
from gateway.settings import DEFAULT_LOAD_SHARE_INTERVAL_S
from kvgate_cli import main
from loadgen.sim import (
    AS_ONE,
    SimConfig,
    _Clock,
    _DistinctGenerationIndex,
    _Gateways,
    _GenerationIndex,
    run_policies,
)
from loadgen.sim import (
    DEFAULT_LOAD_SHARE_INTERVAL_S as SIM_LOAD_SHARE_INTERVAL_S,
)
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import Trace, read_trace
from router.ahead import Ahead
from router.types import RouteRequest

CONFIG = SimConfig(num_replicas=4, capacity_frac=0.25, max_output_tokens=64, directory_scale=1.0)


@pytest.fixture(scope="module")
def slice_() -> Trace:
    return read_trace(CONVERSATION_TRACE, start=4000, limit=300)


@pytest.mark.parametrize("mode", ["approximate", "precise"])
def test_gateways_with_every_piece_as_one_route_exactly_as_one_gateway(
    slice_: Trace, mode: str
) -> None:
    one = replace(CONFIG, mode=mode)
    _, (alone,) = run_policies(slice_, ["cache_aware"], one)
    many = replace(one, gateways=4, as_one=frozenset(AS_ONE))
    _, (together,) = run_policies(slice_, ["cache_aware"], many)
    assert [(o.replica, o.cached_tokens, o.ttft_s) for o in together.outcomes] == [
        (o.replica, o.cached_tokens, o.ttft_s) for o in alone.outcomes
    ]


def test_four_gateways_run_and_each_piece_of_their_own_state_changes_the_routing(
    slice_: Trace,
) -> None:
    _, (alone,) = run_policies(slice_, ["cache_aware"], CONFIG)
    placements = [o.replica for o in alone.outcomes]
    for as_one in ((), ("load",), ("capacity",), ("placements",)):
        config = replace(CONFIG, gateways=4, as_one=frozenset(as_one))
        _, (many,) = run_policies(slice_, ["cache_aware"], config)
        assert many.requests == alone.requests
        for o in many.outcomes:
            assert o.cached_tokens + o.uncached_tokens == o.input_tokens
        assert [o.replica for o in many.outcomes] != placements, as_one


def test_a_gateway_sees_its_own_requests_at_once_and_its_peers_at_their_rounds() -> None:
    gateways = _Gateways(2, 0.1, ["r0"])
    gateways.rounds_until(0.0)  # gateway 0's first round
    gateways.own[1]["r0"].pending_prefill_tokens += 500.0  # gateway 1 routes at 0.01
    gateways.own[0]["r0"].num_inflight += 1
    assert gateways.seen(0, "r0").pending_prefill_tokens == 0.0
    assert gateways.seen(0, "r0").num_inflight == 1
    gateways.rounds_until(0.06)  # gateway 1 publishes at 0.05; gateway 0 has not read since
    assert gateways.seen(0, "r0").pending_prefill_tokens == 0.0
    assert gateways.seen(1, "r0").num_inflight == 0  # gateway 0 published before its request
    gateways.rounds_until(0.1)
    assert gateways.seen(0, "r0").pending_prefill_tokens == 500.0
    assert gateways.seen(1, "r0").pending_prefill_tokens == 500.0  # its own, exact


def test_a_placement_reaches_the_peers_after_its_delay_and_a_burst_spreads_over_routing() -> None:
    """Placements shared (`placement_delay_s`): a peer's placement counts at a decision
    `placement_delay_s` after it, without waiting for a round; a gateway decides the requests
    of one arrival instant one after another, `routing_s` each."""
    gateways = _Gateways(2, 10.0, ["r0"], placement_delay_s=0.0015, routing_s=0.001, ahead=True)
    gateways.rounds_until(0.0)  # the first rounds: nothing in flight
    assert [gateways.decide_at(1, 1.0) for _ in range(3)] == pytest.approx([1.001, 1.002, 1.003])
    assert gateways.decide_at(0, 1.0) == pytest.approx(1.001)  # its own routing, in parallel
    gateways.own[1]["r0"].pending_prefill_tokens += 500.0
    gateways.placed(1, 1.001)
    gateways.own[1]["r0"].pending_prefill_tokens += 300.0  # a later placement, not seen yet
    gateways.placed(1, 1.003)
    gateways.rounds_until(1.002)
    assert gateways.seen(0, "r0").pending_prefill_tokens == 0.0  # 1.5 ms: not yet
    gateways.rounds_until(1.0025)
    assert gateways.seen(0, "r0").pending_prefill_tokens == 500.0  # no round ran
    gateways.rounds_until(1.0045)
    assert gateways.seen(0, "r0").pending_prefill_tokens == 800.0


def test_shared_placements_bring_four_gateways_ttft_toward_one_gateways(slice_: Trace) -> None:
    """On the bench's slice, four gateways seeing each other's placements at once route as
    one gateway's load view would (`as_one` load) to within a few percent of TTFT; seen a
    round trip and a routing later, part of the way: the bursts' first requests are placed on
    the same view."""

    def ttft(config: SimConfig) -> float:
        _, (result,) = run_policies(slice_, ["cache_aware"], config)
        return result.summary()["ttft_mean_s"]

    # measured on the two generations of 3/4 (the directory then): with 16 distinct ones
    # `instant` reads 2.56 s against `as_one` load's 2.80 s (a single trajectory's TTFT moves
    # 5-10% between slices: docs/design/directory.md, "Four gateways' hit ratio")
    four = replace(CONFIG, gateways=4, distinct_generations=0)
    apart = ttft(four)
    instant = ttft(replace(four, placement_delay_s=0.0))
    late = ttft(replace(four, placement_delay_s=0.0015, routing_s=0.001))
    as_one = ttft(replace(four, as_one=frozenset({"load"})))
    assert instant == pytest.approx(as_one, rel=0.05)
    assert instant < late < apart


@pytest.mark.parametrize("mode", ["approximate", "precise"])
def test_one_gateway_routes_exactly_as_before_whatever_the_herd_rule(
    slice_: Trace, mode: str
) -> None:
    """A gateway alone has no peers: the herd rule (`router.herd`) never runs."""
    on = replace(CONFIG, mode=mode)
    _, (with_rule,) = run_policies(slice_, ["cache_aware"], on)
    _, (without,) = run_policies(slice_, ["cache_aware"], replace(on, herd=False))
    assert [(o.replica, o.cached_tokens, o.ttft_s) for o in with_rule.outcomes] == [
        (o.replica, o.cached_tokens, o.ttft_s) for o in without.outcomes
    ]


def test_the_herd_rule_brings_four_gateways_ttft_toward_one_gateways(slice_: Trace) -> None:
    """Placements seen a round trip and a routing later: four gateways deciding a burst's
    requests at the same instant send them to the same least-loaded replica. Ranking each
    instant's ties by the gateways' places spreads them (TTFT mean 3.58 -> 3.12 s here, one
    gateway 2.80 s); paced as well (each gateway's next decision once the peers' placements
    of its last instant are in its view: a model), they read as one gateway."""

    def ttft(config: SimConfig) -> float:
        _, (result,) = run_policies(slice_, ["cache_aware"], config)
        return result.summary()["ttft_mean_s"]

    four = replace(CONFIG, gateways=4, placement_delay_s=0.0015, routing_s=0.001)
    herd = ttft(replace(four, herd=False))
    ranked = ttft(four)
    paced = ttft(replace(four, pace=True))
    assert paced < ranked < herd
    assert paced < ttft(CONFIG) * 1.05


def test_pacing_spaces_a_gateways_decisions_by_the_placements_delay() -> None:
    gateways = _Gateways(2, 0.1, ["r0"], placement_delay_s=0.0015, routing_s=0.001, pace=True)
    assert [gateways.decide_at(0, 1.0) for _ in range(3)] == pytest.approx([1.001, 1.0025, 1.004])
    assert gateways.decide_at(1, 1.0) == pytest.approx(1.001)  # each gateway its own
    alone = _Gateways(1, 0.1, ["r0"], placement_delay_s=0.0015, routing_s=0.001, pace=True)
    assert [alone.decide_at(0, 1.0) for _ in range(2)] == pytest.approx([1.001, 1.002])


def test_the_redis_capacity_holds_one_to_two_generations_of_the_most_recent_blocks() -> None:
    clock = _Clock()
    index = _GenerationIndex(capacity_blocks=8, ttl_s=3600.0, clock=clock)  # 6 a generation
    blocks = [BlockHash(bytes([i]) * 16) for i in range(18)]
    for block in blocks[:17]:  # one new block a record: generations 1 and 2 begin at 6 and 12
        index.record("r", [block])

    def held() -> list[BlockHash]:
        return [b for b in blocks if index.lookup([b]).get("r")]

    assert held() == blocks[6:17]  # generations 1 and 2: 11 entries of a capacity of 8
    index.record("r", [blocks[16]])  # used again in its generation: not new
    assert held() == blocks[6:17]
    index.record("r", [blocks[17]])  # the sixth new block of generation 2: generation 3 begins
    assert held() == blocks[12:]  # 6 of 8, the fewest it holds
    assert index.lookup([blocks[12], blocks[13], blocks[0]]) == {"r": 2}


def test_two_generations_forget_blocks_an_lru_holds_when_used_again() -> None:
    """The cause of issue 39's lost hit ratio at N gateways: a block used again in the next
    generation counts there once more, so the live entries fall below the capacity."""
    clock = _Clock()
    two = _GenerationIndex(capacity_blocks=8, ttl_s=3600.0, clock=clock)  # 6 a generation
    distinct = _DistinctGenerationIndex(8, 3600.0, clock, generations=4)  # 2 a generation
    spine = [BlockHash(bytes([100 + i]) * 16) for i in range(4)]
    blocks = [BlockHash(bytes([i]) * 16) for i in range(8)]
    for index in (two, distinct):
        for block in blocks:  # a spine recorded again with each new block, as every turn does
            index.record("r", [*spine, block])
    # the 8 most recently used distinct blocks: the spine and the last four
    lru = [*spine, *blocks[4:]]
    held = {b for b in [*spine, *blocks] if two.lookup([b]).get("r")}
    assert held == {*spine, *blocks[6:]}  # 6 of them: the generation before is gone
    assert {b for b in [*spine, *blocks] if distinct.lookup([b]).get("r")} == set(lru)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(4, 40),
    generations=st.integers(1, 16),
    records=st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=3), max_size=200),
)
def test_distinct_generations_hold_the_most_recent_blocks_within_half_a_generation_of_capacity(
    capacity: int, generations: int, records: list[list[int]]
) -> None:
    """As an LRU: what matches is always the most recently recorded distinct blocks, and once
    a generation was dropped, as many as the capacity to within half a generation (and the
    record that overfilled it)."""
    clock = _Clock()
    index = _DistinctGenerationIndex(capacity, 3600.0, clock, generations)
    slack = (index.per_generation + 3) / 2
    recency: list[int] = []
    for record in records:
        index.record("r", [BlockHash(bytes([b]) * 16) for b in record])
        for b in record:
            if b in recency:
                recency.remove(b)
            recency.append(b)
        held = [b for b in recency if index.lookup([BlockHash(bytes([b]) * 16)]).get("r")]
        assert held == recency[len(recency) - len(held) :]  # a suffix of the recency order
        assert len(held) <= max(capacity + slack, index.per_generation + 3)
        if index.oldest_live("r") > 0:
            assert len(held) > capacity - slack


def test_a_record_leaves_a_fresh_held_prefix_of_the_current_generation(
    slice_: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `RedisDirectory.record_many`: a prefix the lookup read at the current generation and
    used within the refresh interval keeps its last use; a stale one, or one of the generation
    before, is written again. Without floors (not modelled) and with R far below the TTL, the
    routing is the whole records' to the request."""
    clock = _Clock()
    index = _GenerationIndex(capacity_blocks=64, ttl_s=3600.0, clock=clock)
    blocks = [BlockHash(bytes([i]) * 16) for i in range(8)]
    index.record("r", blocks[:4])
    clock.now = 1.0
    held = index.lookup_held(blocks)["r"]
    assert held == Held(4, 0, 0)
    index.record("r", blocks, held)
    assert index.lookup_held(blocks)["r"] == Held(8, 0, 0)  # the 4 held kept their use
    clock.now = 1.0 + RECORD_REFRESH_S
    index.record("r", blocks, index.lookup_held(blocks)["r"])  # used R ago: stale
    assert index.lookup_held(blocks)["r"].used_ms == round(clock.now * 1000)

    config = replace(CONFIG, gateways=2)
    _, (delta,) = run_policies(slice_, ["cache_aware"], config)
    monkeypatch.setattr("cachemap.redis.directory.RECORD_REFRESH_S", 0.0)  # every record whole
    _, (whole,) = run_policies(slice_, ["cache_aware"], config)
    assert [(o.replica, o.cached_tokens) for o in delta.outcomes] == [
        (o.replica, o.cached_tokens) for o in whole.outcomes
    ]


def test_the_simulated_load_share_round_is_the_gateways_default() -> None:
    assert SIM_LOAD_SHARE_INTERVAL_S == DEFAULT_LOAD_SHARE_INTERVAL_S


def test_the_command_takes_gateways_and_what_to_model_as_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sim", str(CONVERSATION_TRACE), "--limit", "200", "--replicas", "4"]
    assert main([*argv, "--policy", "cache_aware", "--gateways", "4", "--as-one", "load"]) == 0
    assert "4 gateways on one shared directory" in capsys.readouterr().out
    assert main([*argv, "--gateways", "2", "--as-one", "clocks"]) == 2
    assert "unknown as_one" in capsys.readouterr().out
    with pytest.raises(ValueError, match="gateways must be at least 1"):
        SimConfig(gateways=0)
    placements = ["--placement-delay-ms", "1.5", "--routing-ms", "1"]
    assert main([*argv, "--policy", "cache_aware", "--gateways", "2", *placements]) == 0
    assert "placements seen by the peers 1.5 ms after, routing 1 ms" in capsys.readouterr().out
    with pytest.raises(ValueError, match="placement_delay_s must be non-negative"):
        SimConfig(placement_delay_s=-1.0)


def test_one_gateway_routes_exactly_as_before_with_the_requests_ahead(slice_: Trace) -> None:
    """A gateway alone has no peers and nothing looked up ahead (`router.ahead`)."""
    one = replace(CONFIG, placement_delay_s=0.0015, routing_s=0.001)
    _, (before,) = run_policies(slice_, ["cache_aware"], one)
    _, (ahead,) = run_policies(slice_, ["cache_aware"], replace(one, ahead=True))
    assert [(o.replica, o.cached_tokens, o.ttft_s) for o in ahead.outcomes] == [
        (o.replica, o.cached_tokens, o.ttft_s) for o in before.outcomes
    ]


def test_the_requests_ahead_bring_four_gateways_ttft_to_one_gateways(slice_: Trace) -> None:
    """Placements seen a round trip and a routing later: with the herd rule alone a gateway's
    second request of a burst is blind to its peers' first ones; deciding on the published
    load with the requests looked up before it placed first, four gateways read as one."""

    def ttft(config: SimConfig) -> float:
        _, (result,) = run_policies(slice_, ["cache_aware"], config)
        return result.summary()["ttft_mean_s"]

    four = replace(CONFIG, gateways=4, placement_delay_s=0.0015, routing_s=0.001)
    ranked = ttft(four)
    ahead = ttft(replace(four, ahead=True))
    assert ahead < ranked
    assert ahead < ttft(CONFIG) * 1.05


def test_the_requests_ahead_are_those_not_yet_published() -> None:
    gateways = _Gateways(2, 10.0, ["r0"], placement_delay_s=0.0015, routing_s=0.001, ahead=True)
    first, second = (RouteRequest(num_blocks=n, num_prompt_tokens=64.0 * n) for n in (1, 2))
    gateways.looked_up(1, (1.000, 0), first, 1.001, "r0")
    gateways.placed(1, 1.001)
    gateways.looked_up(0, (1.000, 1), second, 1.001, "r0")
    gateways.placed(0, 1.001)
    assert gateways.ahead(0, (1.001, 2)) == [Ahead(first), Ahead(second, "r0")]
    assert gateways.ahead(1, (1.000, 1)) == [Ahead(first, "r0")]  # looked up before it only
    gateways.rounds_until(1.0025)  # both published
    assert gateways.ahead(0, (1.003, 3)) == []


def test_ahead_needs_the_placements_shared() -> None:
    with pytest.raises(ValueError, match="placement_delay_s"):
        SimConfig(gateways=2, ahead=True)
