"""`kvgate bench-fairness`'s noisy-neighbour verdict per arm (the issue's goal), its arms and
windows, and what `kvgate bench` says of flow control left counting after a replay."""

from __future__ import annotations

import argparse

from loadgen.bench.fairness import (
    Run,
    _bound_s,
    _variants,
    _verdict,
    add_bench_fairness_arguments,
    run_bands,
    run_noisy,
    run_weights,
    windows_of,
    worst_deviation,
)
from loadgen.bench.peers import flow_not_at_rest, parse_arms
from loadgen.client import Result
from loadgen.engine.timing import DEFAULT_PREFILL_TOKENS_PER_S


def _b(ttft_s: float) -> Result:
    return Result("b", True, 200, ttft_s=ttft_s, prompt_tokens=2_600)


def _a(n: int, ok: bool = True, status: int = 200) -> list[Result]:
    return [Result("a", ok, status, prompt_tokens=10_400) for _ in range(n)]


def _args(time_scale: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_fairness_arguments(parser)
    return parser.parse_args(["--time-scale", f"{time_scale:g}", "--seconds", "20"])


def test_the_goal_is_b_p99_within_its_bound_a_at_90_percent_and_nothing_failed() -> None:
    solo = Run([_b(0.2) for _ in range(10)], [])
    a_alone = Run([], _a(60))
    prefill_s = 10_400 / DEFAULT_PREFILL_TOKENS_PER_S  # one of A's prefills: 0.8 s
    met = _verdict(
        {"B alone": solo, "A alone": a_alone, "flood": Run([_b(1.0)] * 10, _a(55))}, _args(1)
    )
    assert abs(met.bound_s - (1.5 * 0.2 + prefill_s)) < 1e-9 and met.problems() == []
    # B's ten prefills (2 s) of the two engines' 40 s: A can complete at most 95% of its solo
    assert abs(met.a_ceiling - (1 - 10 * 2_600 / DEFAULT_PREFILL_TOKENS_PER_S / 40)) < 1e-9
    slow = _verdict(
        {"B alone": solo, "A alone": a_alone, "flood": Run([_b(1.2)] * 10, _a(53) + _a(1, False))},
        _args(1),
    )
    assert slow.problems() == [
        "B's p99 1.20 s > 1.10 s",
        "A 53 < 90% of 60 (its ceiling with B served: 95%)",
        "1 failed",
    ]
    errors = _verdict(
        {"B alone": solo, "A alone": a_alone, "flood": Run([_b(0.5)] * 10, _a(1, False, 503))},
        _args(2),
    )
    assert errors.b_flood == [1.0] * 10  # engine time: measured × the time scale
    assert errors.problems()[-2:] == ["1 failed", "1 5xx"]


def test_an_arm_it_cannot_run_is_refused_before_anything_starts(capsys: object) -> None:
    parser = argparse.ArgumentParser()
    add_bench_fairness_arguments(parser)
    assert run_noisy(parser.parse_args(["--arms", "kvgate:cache_aware@2"])) == 2
    assert run_noisy(parser.parse_args(["--arms", "precise:cache_aware"])) == 2
    assert run_noisy(parser.parse_args(["--arms", "nonsense"])) == 2
    assert run_noisy(parser.parse_args(["--room-bounds", "0.1,x"])) == 2
    assert run_noisy(parser.parse_args(["--room-bounds", "0"])) == 2
    assert run_bands(parser.parse_args(["--scenario", "bands", "--room-bounds", "x"])) == 2
    for shares in ("0", "1.5", "0.5,x"):
        args = parser.parse_args(["--scenario", "bands", "--lower-band-room-shares", shares])
        assert run_bands(args) == 2


def test_the_bands_bound_is_the_noisy_neighbours() -> None:
    """1.5 × B's solo p99 plus one of A's prefills, in engine time."""
    alone = Run([_b(0.1) for _ in range(10)], [])
    flood = Run([_b(0.5)], _a(4))
    expected = 1.5 * 0.2 + 10_400 / DEFAULT_PREFILL_TOKENS_PER_S
    assert abs(_bound_s(alone, flood, 2.0) - expected) < 1e-9


def test_each_window_has_its_own_shares_and_the_worst_deviation_is_the_goals_measure() -> None:
    """Cumulative dispatch counts read at 30 s and 60 s become per-window counts; completions
    fall in the window they finished in; a window 1:2:4 to the request is 0% off, one where
    the lightest tenant got twice its share is 100% off."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    assert worst_deviation({"w1": 10, "w2": 20, "w4": 40}, weights) == 0.0
    assert abs(worst_deviation({"w1": 20, "w2": 20, "w4": 30}, weights) - 1.0) < 1e-9
    assert worst_deviation({"w1": 0, "w2": 0, "w4": 0}, weights) == 1.0

    results = {"w1": [_done("w1", 10.0)], "w2": [_done("w2", 40.0), _done("w2", 50.0)], "w4": []}
    marks = [
        (30.0, {"w1": 1.0, "w2": 2.0, "w4": 4.0}, 100.0),
        (60.0, {"w1": 3.0, "w2": 4.0, "w4": 8.0}, 100.0),
    ]
    first, second = windows_of(results, marks, 30.0)
    assert (first.start_s, first.end_s, second.start_s, second.end_s) == (0.0, 30.0, 30.0, 60.0)
    assert first.dispatched == {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    assert second.dispatched == {"w1": 2.0, "w2": 2.0, "w4": 4.0}
    assert first.served_tokens == {"w1": 8.0, "w2": 0.0, "w4": 0.0}
    assert second.served_tokens == {"w1": 0.0, "w2": 16.0, "w4": 0.0}


def _done(name: str, finished_s: float) -> Result:
    return Result(name, True, 200, start_s=100.0 + finished_s - 1.0, latency_s=1.0, prompt_tokens=8)


def test_readings_every_step_give_every_window_sliding_by_that_step() -> None:
    """Read every 10 s over 40 s, the 20 s windows are 0-20, 10-30 and 20-40: the one
    straddling the consecutive ones' boundary is a window of its own (the issue's "any 30 s"),
    with its own dispatches and completions."""
    results = {"w1": [_done("w1", 15.0)], "w2": [_done("w2", 25.0)], "w4": []}
    marks = [
        (10.0, {"w1": 1.0, "w2": 0.0, "w4": 0.0}, 100.0),
        (20.0, {"w1": 2.0, "w2": 2.0, "w4": 4.0}, 100.0),
        (30.0, {"w1": 2.0, "w2": 4.0, "w4": 8.0}, 100.0),
        (40.0, {"w1": 3.0, "w2": 6.0, "w4": 12.0}, 100.0),
    ]
    windows = windows_of(results, marks, 20.0)
    assert [(w.start_s, w.end_s) for w in windows] == [(0.0, 20.0), (10.0, 30.0), (20.0, 40.0)]
    assert windows[1].dispatched == {"w1": 1.0, "w2": 4.0, "w4": 8.0}
    assert windows[1].served_tokens == {"w1": 8.0, "w2": 8.0, "w4": 0.0}
    assert windows[2].served_tokens == {"w1": 0.0, "w2": 8.0, "w4": 0.0}


def test_a_window_that_is_not_a_multiple_of_the_step_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_bench_fairness_arguments(parser)
    args = ["--scenario", "weights", "--window-s", "30", "--window-step-s", "7"]
    assert run_weights(parser.parse_args(args)) == 2


def test_a_gateway_whose_flow_control_is_not_at_rest_after_the_replay_says_what_it_counts() -> None:
    """`kvgate bench` prints, before its idle probe, what flow control still counts once the
    replay ended (a stopped queue's signature: tokens in transit, requests queued, prefill
    counted on a replica); nothing at rest, where a float's rounding may leave ~1e-13."""
    at_rest = (
        "kvgate_flow_transit_tokens 4.5e-13\n"
        'kvgate_replica_pending_prefill_tokens{replica="http://r0"} 5.7e-14\n'
        'kvgate_replica_room_tokens{replica="http://r0"} 650.0\n'
    )
    assert flow_not_at_rest(at_rest) == ""
    stopped = (
        "kvgate_flow_transit_tokens 3000.0\n"
        'kvgate_flow_queue_depth{band="0",tenant="bench"} 2.0\n'
        'kvgate_replica_pending_prefill_tokens{replica="http://r0"} 0.0\n'
        'kvgate_replica_room_tokens{replica="http://r0"} 650.0\n'
    )
    assert flow_not_at_rest(stopped) == (
        "3000 tokens in transit, 2 queued, prefill counted {}, room {'http://r0': 650}"
    )
    engine_queue = (  # another gateway's requests, as the engine last reported its queue
        'kvgate_replica_pending_prefill_tokens{replica="http://r0"} 0.0\n'
        'kvgate_replica_foreign_prefill_tokens{replica="http://r0"} 800.0\n'
        'kvgate_replica_room_tokens{replica="http://r0"} 0.0\n'
    )
    assert flow_not_at_rest(engine_queue) == (
        "0 tokens in transit, 0 queued, prefill counted {'http://r0': 800}, room {'http://r0': 0}"
    )


def test_a_room_bound_given_twice_runs_twice_each_its_own_row() -> None:
    arms = parse_arms("kvgate:cache_aware,noflow:cache_aware")
    names = [name for name, _, _ in _variants(arms, [0.05, 0.1, 0.05, 0.1])]
    assert names == [
        "kvgate:cache_aware room 0.05s #1",
        "kvgate:cache_aware room 0.1s #2",
        "kvgate:cache_aware room 0.05s #3",
        "kvgate:cache_aware room 0.1s #4",
        "noflow:cache_aware",
    ]
    assert _variants(arms, [0.05])[0][0] == "kvgate:cache_aware room 0.05s"
