"""The discrete-event simulator: invariants, references, determinism, the command."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from kvgate_cli import main
from loadgen.engine.timing import TimingModel
from loadgen.sim import PolicyResult, SimConfig, references, request_keys, run_policies, simulate
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import Trace, TraceRequest, read_trace
from router.registry import POLICIES

CONFIG = SimConfig(num_replicas=4, capacity_frac=0.25, max_output_tokens=64)


@pytest.fixture(scope="module")
def slice_() -> Trace:
    return read_trace(CONVERSATION_TRACE, start=4000, limit=1000)


@pytest.fixture(scope="module")
def all_policies(slice_: Trace) -> tuple[object, list[PolicyResult]]:
    return run_policies(slice_, list(POLICIES), CONFIG)


def test_every_request_is_served_and_cached_plus_uncached_is_its_input(
    slice_: Trace, all_policies: tuple[object, list[PolicyResult]]
) -> None:
    _, results = all_policies
    for result in results:
        assert result.requests == len(slice_.requests)
        assert sorted(o.index for o in result.outcomes) == list(range(len(slice_.requests)))
        for o in result.outcomes:
            assert o.cached_tokens + o.uncached_tokens == o.input_tokens
            assert 0 <= o.cached_tokens <= o.input_tokens
            assert 0 <= o.ttft_s <= o.e2e_s


def test_the_ideal_bounds_every_policy_and_the_shared_lru(
    all_policies: tuple[object, list[PolicyResult]],
) -> None:
    refs, results = all_policies
    assert refs.ideal_hit_ratio >= refs.lru_reference_hit_ratio > 0  # type: ignore[attr-defined]
    for result in results:
        assert result.hit_ratio <= refs.ideal_hit_ratio  # type: ignore[attr-defined]
        assert result.share_of_ideal <= 1.0


def test_cache_aware_keeps_locality_and_beats_the_cache_blind_baselines(
    all_policies: tuple[object, list[PolicyResult]],
) -> None:
    _, results = all_policies
    by = {r.policy: r for r in results}
    assert by["cache_aware"].share_of_lru_reference >= 0.95
    assert by["cache_aware"].hit_ratio > 1.5 * by["round_robin"].hit_ratio
    assert by["cache_aware"].hit_ratio > 1.5 * by["least_load"].hit_ratio
    assert by["cache_aware"].ttft_mean_s < by["round_robin"].ttft_mean_s
    assert by["cache_aware"].decisions.get("prefix", 0) > 0.9 * by["cache_aware"].requests


def test_the_same_seed_gives_the_same_run_and_another_seed_may_not(slice_: Trace) -> None:
    keys = [request_keys(r, 4) for r in slice_.requests]
    refs = references(slice_, keys, CONFIG.capacity_frac, CONFIG.num_replicas)
    a = simulate(slice_, "random", CONFIG, refs, keys)
    b = simulate(slice_, "random", CONFIG, refs, keys)
    c = simulate(slice_, "random", replace(CONFIG, seed=1), refs, keys)
    assert [o.replica for o in a.outcomes] == [o.replica for o in b.outcomes]
    assert a.summary() | {"sim_wall_s": 0} == b.summary() | {"sim_wall_s": 0}
    assert [o.replica for o in a.outcomes] != [o.replica for o in c.outcomes]


def test_a_narrative_two_replica_run() -> None:
    """Three turns of one conversation and one stranger, on 2 replicas at 1,000 tokens/s."""
    block = 100
    reqs = [
        TraceRequest(0, 0.0, 250, 1, (0, 1, 2)),  # conversation A turn 1
        TraceRequest(1, 0.1, 250, 1, (0, 7, 8)),  # stranger B: shares block 0 only
        TraceRequest(2, 5.0, 350, 1, (0, 1, 2, 3)),  # A turn 2: 3 blocks cached
        TraceRequest(3, 9.0, 450, 1, (0, 1, 2, 3, 4)),  # A turn 3
    ]
    trace = Trace("narrative", block, reqs)
    config = SimConfig(
        num_replicas=2,
        capacity_frac=4.0,  # no eviction: 7 unique blocks, 14 per replica
        timing=TimingModel(prefill_tokens_per_s=1000.0, decode_s_per_token=0.0),
    )
    refs, (result,) = run_policies(trace, ["cache_aware"], config)
    # the trace's accounting: a block id counts whole, capped at the input (block 2 of turn 1
    # is partial, 50 tokens, and still names the same prefix in turn 2)
    assert refs.ideal_hit_ratio == pytest.approx((100 + 300 + 400) / 1300)
    by_index = {o.index: o for o in result.outcomes}
    # B goes to the other (idle) replica: both hold block 0 after A, B is less work there
    assert by_index[0].replica != by_index[1].replica
    assert by_index[0].ttft_s == pytest.approx(0.25)
    assert [by_index[i].replica for i in (2, 3)] == [by_index[0].replica] * 2
    assert [by_index[i].cached_tokens for i in (2, 3)] == [300, 400]
    assert by_index[2].ttft_s == pytest.approx(0.05)  # 50 uncached tokens
    assert result.hit_ratio == pytest.approx(700 / 1300)  # B's block 0 is on the other replica


def test_the_command_prints_a_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = ["sim", str(CONVERSATION_TRACE), "--limit", "300", "--replicas", "4", "--json", str(out)]
    assert main([*argv, "--policy", "all"]) == 0
    text = capsys.readouterr().out
    assert "prefill 13,000 tokens/s" in text and "one shared LRU" in text
    payload = orjson.loads(out.read_bytes())
    assert set(payload["results"]) == set(POLICIES)
    assert payload["config"]["timing"]["prefill_tokens_per_s"] == 13_000.0
    for row in payload["results"].values():
        assert {"hit_ratio", "share_of_ideal", "ttft_p99_s", "imbalance"} <= set(row)
    assert main(["sim", str(CONVERSATION_TRACE), "--policy", "fastest"]) == 2
    assert "choose one of cache_aware" in capsys.readouterr().out


def test_a_directory_larger_than_the_engines_keeps_conversations_sticky(slice_: Trace) -> None:
    """Under heavy eviction an engine-sized directory forgets prefixes the engine still holds."""
    tight = replace(CONFIG, capacity_frac=0.10)
    _, (small,) = run_policies(slice_, ["cache_aware"], replace(tight, directory_scale=1.0))
    _, (large,) = run_policies(slice_, ["cache_aware"], replace(tight, directory_scale=8.0))
    assert large.hit_ratio > small.hit_ratio
    with pytest.raises(ValueError, match="directory_scale must be positive"):
        SimConfig(directory_scale=0)


def test_the_simulator_spreads_a_hot_spine_as_the_gateway_does() -> None:
    from loadgen.sim import SimConfig, run_policies
    from loadgen.traces.readers import hot_spine_trace

    trace = hot_spine_trace("hot-spine:rate=60,seconds=8")
    results = {}
    for overflow in (True, False):
        config = SimConfig(num_replicas=4, capacity_frac=4, overflow=overflow)
        _, (result,) = run_policies(trace, ["cache_aware"], config)
        results[overflow] = result.summary()
    on, off = results[True], results[False]
    # 8 s of load: the first seconds (before the rate passes the threshold) still weigh in
    assert on["imbalance"] < 2.0 and off["imbalance"] > 3.5
    assert on["ttft_p99_s"] < off["ttft_p99_s"] / 3
    assert abs(on["hit_ratio"] - off["hit_ratio"]) < 0.02
    with pytest.raises(ValueError, match="option 'speed' unknown"):
        hot_spine_trace("hot-spine:speed=3")


def test_without_a_trace_the_command_reads_the_shipped_conversation_trace(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sim.json"
    assert main(["sim", "--limit", "100", "--policy", "round_robin", "--json", str(out)]) == 0
    assert orjson.loads(out.read_bytes())["trace"]["path"] == str(CONVERSATION_TRACE)
