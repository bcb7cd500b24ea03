"""`kvgate sim` in precise mode (issue 16): the directory fed by the engines' own KV events,
late by the event delay, and cache_pressure's placement on each engine's eviction frontier.
Small seeded runs asserting the direction (each a second or two of virtual-time simulation)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from cachemap.keys import BlockHash
from cachemap.memory import MemoryIndex
from kvgate_cli import main
from loadgen.engine.kvpool import GPU, BlockInfo, BlockPool, Stored
from loadgen.engine.timing import EngineCore, TimingModel
from loadgen.sim import (
    APPROXIMATE,
    PRECISE,
    PolicyResult,
    SimConfig,
    _Clock,
    _Conversations,
    _EventDirectory,
    _ReplicaState,
    run_policies,
)
from loadgen.traces.readers import Trace, TraceRequest
from loadgen.traces.sessions import agent_sessions_trace
from router.registry import RouterConfig

SESSIONS = "agent-sessions:sessions=24,concurrency=4,steps=20,start=6000,tool=1000,interval=8"
"""24 agent sessions growing from 6,000 to 25,000 tokens, 4 at a time, on 4 replicas whose KV
is 10% of the trace's blocks: ~280 64-token blocks each, about one live session's worth."""
CONFIG = SimConfig(num_replicas=4, capacity_frac=0.10)


@pytest.fixture(scope="module")
def runs() -> dict[str, PolicyResult]:
    trace = agent_sessions_trace(SESSIONS)
    _, results = run_policies(
        trace, ["cache_aware", "cache_pressure"], CONFIG, (APPROXIMATE, PRECISE)
    )
    return {r.label: r for r in results}


def test_the_engines_events_beat_the_prediction_at_ten_percent_capacity(
    runs: dict[str, PolicyResult],
) -> None:
    approximate, precise = runs["cache_aware"], runs["cache_aware@precise"]
    # 0.373 against 0.261 with issue 40's round 6 (0.303 at round 5's defaults, 0.48 before:
    # these prompts outgrow a replica's KV, and a turn kept home by its queued previous turn's
    # claim finds it eroded; docs/precise.md, "The queued turn: a claim by the queue", and "The
    # claim off the home"); cache_pressure reads 0.72
    assert precise.hit_ratio >= approximate.hit_ratio * 1.15
    assert precise.ttft_p99_s < approximate.ttft_p99_s
    assert precise.evicted_blocks < approximate.evicted_blocks


def test_placing_by_what_it_evicts_evicts_less_and_hits_more(
    runs: dict[str, PolicyResult],
) -> None:
    aware, pressure = runs["cache_aware@precise"], runs["cache_pressure@precise"]
    assert pressure.evicted_blocks < aware.evicted_blocks
    assert pressure.hit_ratio > aware.hit_ratio
    assert pressure.ttft_p99_s < aware.ttft_p99_s
    assert pressure.imbalance < aware.imbalance


def test_round_two_evicts_less_and_hits_more_than_round_one(
    runs: dict[str, PolicyResult],
) -> None:
    """The hot horizon and weight 4 (the defaults) against the first round's weight 1 and
    plain 30-s half-life, on the same sessions (docs/benchmarks.md, "round 2"); both without
    round 3's crowding rule, which these sessions (about one live per replica) do not need."""
    round_1 = RouterConfig(
        displacement_weight=1.0,
        displacement_half_life_s=30.0,
        displacement_hot_s=0.0,
        crowding_weight=0.0,
    )
    trace = agent_sessions_trace(SESSIONS)
    # the 2-s speculative entries and no room of the rounds measured (issue 40's round 5 moved
    # both defaults: its p99 reads 2.33 s against round 1's 2.29 s here, within a tie)
    then = replace(CONFIG, mode=PRECISE, speculative_ttl_s=2.0, room_weight=0.0)
    first, second = (
        run_policies(trace, ["cache_pressure"], replace(then, router=config))[1][0]
        for config in (round_1, RouterConfig(crowding_weight=0.0))
    )
    # both lose most to sessions eroded where they stayed (here ~1 live session fits a
    # replica), round 2 less
    assert first.lost_staying_tokens > first.lost_moving_tokens
    assert second.lost_staying_tokens < first.lost_staying_tokens
    assert second.hit_ratio > first.hit_ratio
    assert second.evicted_blocks < first.evicted_blocks
    assert second.ttft_p99_s < first.ttft_p99_s


def test_without_a_frontier_cache_pressure_is_cache_aware(runs: dict[str, PolicyResult]) -> None:
    """Approximate mode knows no eviction frontier: the same placements, request by request."""
    aware, pressure = runs["cache_aware"], runs["cache_pressure"]
    assert [o.replica for o in pressure.outcomes] == [o.replica for o in aware.outcomes]
    assert pressure.hit_ratio == aware.hit_ratio


def _two_turns(delay_s: float) -> PolicyResult:
    """Turn 1 at 0 s (its first token at 0.25 s), turn 2 of the same conversation at 5 s."""
    reqs = [
        TraceRequest(0, 0.0, 250, 1, (0, 1, 2)),
        TraceRequest(1, 5.0, 350, 1, (0, 1, 2, 3)),
    ]
    config = SimConfig(
        num_replicas=2,
        capacity_frac=4.0,
        timing=TimingModel(prefill_tokens_per_s=1000.0, decode_s_per_token=0.0),
        mode=PRECISE,
        event_delay_s=delay_s,
        speculative_ttl_s=2.0,  # the late event's window: no placement claims it any more
    )
    _, (result,) = run_policies(Trace("two turns", 100, reqs), ["cache_aware"], config)
    return result


def test_the_directory_knows_a_block_only_once_its_event_has_landed() -> None:
    on_time = {o.index: o for o in _two_turns(0.05).outcomes}
    assert on_time[1].reason == "prefix" and on_time[1].replica == on_time[0].replica
    assert on_time[1].cached_tokens == 300
    assert _two_turns(0.05).lost_staying_tokens == 0 and _two_turns(0.05).num_moves == 0
    result = _two_turns(10.0)
    late = {o.index: o for o in result.outcomes}  # the event lands after turn 2
    assert late[1].reason == "no_match"
    # turn 1 left 300 tokens (3 blocks of 100) for turn 2: what it did not find is a loss,
    # counted as a move when the blind choice took the other replica
    lost = result.lost_staying_tokens + result.lost_moving_tokens
    assert lost == 300 - late[1].cached_tokens
    assert result.num_moves == (late[1].replica != late[0].replica)


def test_the_config_names_its_modes() -> None:
    with pytest.raises(ValueError, match="unknown directory mode 'exact'"):
        replace(CONFIG, mode="exact")
    with pytest.raises(ValueError, match="event_delay_s must be non-negative"):
        replace(CONFIG, event_delay_s=-1.0)


def test_the_command_runs_both_modes_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # a log's width, whoever runs the suite
    out = tmp_path / "sim.json"
    spec = "agent-sessions:sessions=8,concurrency=2,steps=6,start=3000,tool=500"
    argv = ["sim", spec, "--replicas", "2", "--capacity-frac", "0.2", "--mode", "both"]
    assert main([*argv, "--policy", "cache_aware,round_robin", "--json", str(out)]) == 0
    assert "cache_aware@precise" in capsys.readouterr().out
    payload = orjson.loads(out.read_bytes())
    # round robin reads no directory: it runs once
    assert set(payload["results"]) == {"cache_aware", "round_robin", "cache_aware@precise"}
    assert payload["results"]["cache_aware@precise"]["mode"] == PRECISE
    assert payload["config"]["event_delay_s"] == 0.05
    assert main(["sim", "agent-sessions:sessions=0"]) == 2
    assert "sessions must be positive" in capsys.readouterr().out


CROWDED = "agent-sessions:sessions=30,concurrency=6,steps=20"
"""30 sessions of 20 steps growing from 12,000 to 51,900 tokens, 6 at a time, on 2 replicas of
~1,070 blocks: three live sessions per replica outgrow it, so one must move now and then."""


def test_round_three_moves_the_cheapest_session_and_hits_more_than_round_two() -> None:
    """The crowding rule (the default) against round 2 (crowding_weight 0) on sessions that
    crowd their replicas (docs/benchmarks.md, "round 3")."""
    trace = agent_sessions_trace(CROWDED)
    config = replace(CONFIG, num_replicas=2, mode=PRECISE)
    second, third = (
        run_policies(trace, ["cache_pressure"], replace(config, router=router))[1][0]
        for router in (RouterConfig(crowding_weight=0.0), RouterConfig())
    )
    assert third.hit_ratio > second.hit_ratio * 1.02
    assert third.evicted_blocks < second.evicted_blocks
    assert third.lost_staying_tokens + third.lost_moving_tokens < (
        second.lost_staying_tokens + second.lost_moving_tokens
    )


def test_the_live_conversations_are_the_recent_or_running_others_own_blocks() -> None:
    """What the simulated router tells `CrowdingScorer`: per replica, every other conversation
    routed within the hot horizon or still running there, as the blocks beyond those it
    shares with the request being placed."""
    convs = _Conversations(hot_s=15.0)
    system = tuple(range(10))
    convs.routed("a", "r0", 0.0, (*system, 100, 101, 102))
    convs.routed("b", "r0", 1.0, (*system, 200))
    convs.routed("c", "r1", 2.0, (*system, 300, 301))
    convs.finished("a")
    convs.finished("c")
    mine = (*system, 400)
    assert convs.live("d", mine, 10.0) == {"r0": [3, 1], "r1": [2]}
    # 16 s after its step a (finished) is gone; b still runs; c's own conversation is not listed
    assert convs.live("c", (*system, 300, 301, 302), 16.5) == {"r0": [1]}
    convs.routed("a", "r1", 17.0, (*system, 100, 101, 102, 103))  # a returns, elsewhere
    assert convs.live("d", mine, 17.0) == {"r0": [1], "r1": [4]}


def _blind_second_turn(seed: int, affinity_weight: float) -> PolicyResult:
    """Turn 2 arrives before turn 1's events land: the directory shows it held nowhere (as
    after an eviction everywhere), so only the conversation's home says where it went."""
    reqs = [
        TraceRequest(0, 0.0, 250, 1, (0, 1, 2), conversation="c"),
        TraceRequest(1, 5.0, 350, 1, (0, 1, 2, 3), conversation="c"),
    ]
    config = SimConfig(
        num_replicas=2,
        capacity_frac=4.0,
        timing=TimingModel(prefill_tokens_per_s=1000.0, decode_s_per_token=0.0),
        affinity_weight=affinity_weight,
        mode=PRECISE,
        event_delay_s=10.0,
        speculative_ttl_s=2.0,  # turn 1's claim gone too: only the home says where it went
        seed=seed,
    )
    _, (result,) = run_policies(Trace("blind turn", 100, reqs), ["cache_aware"], config)
    return result


def test_a_blind_turn_goes_home_with_affinity_and_hops_at_random_without() -> None:
    """Issue 40's mechanism in two turns: precise mode sees no hit anywhere and places by load
    (here a tie, broken at random: a hop in about half the seeds, each a blind move that
    prefills the whole context again); the conversation's home keeps it where it was."""
    without = [_blind_second_turn(seed, 0.0) for seed in range(8)]
    assert any(r.num_moves for r in without)
    for r in without:
        assert r.num_blind_moves == r.num_moves
        assert r.session_hops_mean == r.num_moves and r.session_hops_max == r.num_moves
        assert r.session_reprefill_tokens_mean == r.lost_staying_tokens + r.lost_moving_tokens
    for seed in range(8):
        with_home = _blind_second_turn(seed, 1.0)
        assert with_home.num_moves == 0 and with_home.session_hops_max == 0
        first, second = sorted(with_home.outcomes, key=lambda o: o.index)
        assert second.replica == first.replica and second.best_blocks == 0


def test_a_frontier_leaves_out_the_requests_own_cached_prefix() -> None:
    """Placed on a replica, a request takes its cached prefix there out of the engine's free
    queue before it allocates, so its placement never evicts it: the frontier built for it
    walks past those blocks to the ones it would evict (the gateway's frontier does the same,
    tests/gateway/test_frontier.py)."""
    pool = BlockPool(8)
    mine = [bytes([1, i]) * 4 for i in range(4)]  # this conversation's prefix, used first
    theirs = [bytes([2, i]) * 4 for i in range(4)]  # another's, used 10 s later
    for chain in (mine, theirs):
        pool.allocate(len(chain))
        held = pool.commit(chain, [BlockInfo(None, (), None)] * len(chain), 16)
        pool.release(held, 0)
    state = _ReplicaState("r0", EngineCore(TimingModel(), pool))
    state.routed_s.update(dict.fromkeys(mine, 0.0))
    state.routed_s.update(dict.fromkeys(theirs, 10.0))
    # 3 new blocks on a full replica: without its own prefix listed they evict the other's
    assert state.frontier(3, 20.0).runs == ((3, 20.0),)  # its own blocks, 20 s idle
    frontier = state.frontier(3, 20.0, own=[BlockHash(h) for h in mine])
    assert frontier.runs == ((3, 10.0),) and frontier.empty_blocks == 0


def test_a_placement_counts_as_held_until_its_event_or_its_speculative_ttl() -> None:
    """As the gateway's speculative entries (`cachemap.events.EventIndex.speculate`): a
    placement's blocks past what its replica's events hold are claimed there until an event
    stores them (confirmed) or `speculative_ttl_s` passes."""
    clock = _Clock()
    index = MemoryIndex(capacity_blocks=64, ttl_s=math.inf, clock=clock)
    directory = _EventDirectory(index, 0.05, speculative_ttl_s=2.0)
    chain = [BlockHash(bytes([i]) * 8) for i in range(6)]
    index.record("a", chain[:2], 0.0)  # the events hold its first 2 blocks on a
    assert directory.lookup(chain, 0.0) == ({"a": 2}, {})
    directory.speculate("a", chain[:4], 0.0)  # placed on a: blocks 2 and 3 claimed there
    assert directory.lookup(chain, 1.9) == ({"a": 4}, {"a": 2})  # 2 of them only claimed
    assert directory.lookup(chain, 2.1) == ({"a": 2}, {})  # expired
    directory.lookup(chain, 3.0)
    directory.speculate("b", chain, 3.0)  # placed on b, which holds none of it
    directory.engine_events(3.5, "b", [Stored(tuple(chain[:3]), None, (), 16, GPU)])
    directory.catch_up(3.6)  # the event confirms 3 blocks; the other 3 stay claimed
    assert directory._claims["b"].keys() == set(chain[3:])
    assert directory.lookup(chain, 4.9) == ({"a": 2, "b": 6}, {"b": 3})
    assert directory.lookup(chain, 5.1) == ({"a": 2, "b": 3}, {})  # only the event's blocks
    # off (a ttl of 0): nothing is claimed
    off = _EventDirectory(MemoryIndex(capacity_blocks=64, ttl_s=math.inf, clock=clock), 0.05, 0.0)
    off.lookup(chain, 0.0)
    off.speculate("a", chain, 0.0)
    assert off.lookup(chain, 0.1) == ({}, {})
