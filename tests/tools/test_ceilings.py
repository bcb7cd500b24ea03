"""`tools.ceilings` on hand-made traces whose answers are known, and small on the real ones."""

from __future__ import annotations

import re

import pytest

from loadgen.traces.readers import Trace, TraceRequest
from tools import ceilings


def _trace(*requests: tuple[float, tuple[int, ...], str | None], block: int = 1) -> Trace:
    return Trace(
        "hand-made",
        block,
        [
            TraceRequest(i, at, len(ids) * block, 1, ids, conversation=c)
            for i, (at, ids, c) in enumerate(requests)
        ],
    )


def test_a_one_off_scan_evicts_the_reused_blocks_unless_the_oracle_drops_it() -> None:
    """Two blocks of KV: the scan (3, 4) pushes (1, 2) out of a plain LRU; the admission
    oracle does not store blocks never used again, so (1, 2) hit on their return."""
    trace = _trace((0, (1, 2), None), (1, (3, 4), None), (2, (1, 2), None))
    uses = ceilings.next_uses(trace)
    assert uses == [[2, 2], [None, None], [None, None]]
    assert ceilings.lru_hit_ratio(trace, 2) == 0.0
    keep = [[k is not None for k in u] for u in uses]
    assert ceilings.lru_hit_ratio(trace, 2, keep) == pytest.approx(2 / 6)


def test_reuse_counts_only_new_blocks_and_measures_distance_in_blocks_stored() -> None:
    """Block 0 is everyone's: a continuation's new blocks start past its seen prefix, and a
    reuse's distance is what the requests in between stored."""
    trace = _trace(
        (0, (0, 1, 2), None),  # first turn: new 1, 2 (0 is new too: nothing seen yet)
        (1, (0, 5, 6, 7), None),  # first turn (only block 0 seen): new 5, 6, 7
        (2, (0, 1, 2, 3), None),  # continuation: new 3
    )
    uses = ceilings.next_uses(trace)
    firsts = ceilings.first_new(trace)
    assert firsts == [0, 1, 3]
    by_class = ceilings.reuse_by_class(trace, uses, firsts)
    assert (by_class["first turn"].new, by_class["first turn"].reused) == (6, 3)
    assert (by_class["continuation"].new, by_class["continuation"].reused) == (1, 0)
    assert (by_class["output < 50"].new, by_class["output < 50"].reused) == (7, 3)
    assert by_class["output >= 50"].new == 0
    assert ceilings.reuse_distances(trace, uses, firsts) == [0, 4, 4]  # 0: block 0 at once


def test_a_partition_by_weight_sends_unmatched_requests_where_the_weights_say() -> None:
    """All the weight on one replica of two is one LRU of half the capacity; one replica is
    the shared LRU; a request whose prefix is cached goes where it is, whatever the weights."""
    scan = _trace((0, (1, 2), None), (1, (3, 4), None), (2, (1, 2), None))
    assert ceilings.weighted_partition_hit_ratio(scan, 4, (1,), 0) == pytest.approx(2 / 6)
    assert ceilings.lru_hit_ratio(scan, 2) == 0.0
    assert ceilings.weighted_partition_hit_ratio(scan, 4, (1, 0), 0) == 0.0
    assert ceilings.weighted_partition_hit_ratio(scan, 4, (0, 1), 0) == 0.0
    # two conversations of 2 blocks taking turns, 2 blocks a replica: together on one
    # replica they evict each other; apart (as even weights soon place them) they both hit
    turns = _trace(*((float(i), (1, 2) if i % 2 else (3, 4), None) for i in range(40)))
    assert ceilings.weighted_partition_hit_ratio(turns, 4, (1, 0), 0) == 0.0
    assert ceilings.weighted_partition_hit_ratio(turns, 4, (1, 1), 0) > 0.5
    # 20 conversations of a first turn and a continuation, space for all: each continuation
    # finds its 2 blocks where they are, whichever replica the weights drew
    follows = _trace(
        *((float(c), (100 + c, 200 + c), None) for c in range(20)),
        *((20.0 + c, (100 + c, 200 + c, 300 + c), None) for c in range(20)),
    )
    hits = ceilings.weighted_partition_hit_ratio(follows, 400, (1, 1, 1, 1), 0)
    assert hits == pytest.approx(40 / 100)


def test_best_fit_on_known_futures_separates_two_big_sessions_when_it_can() -> None:
    """Two sessions overlapping in time, each growing past half a replica's 10 blocks: two
    replicas hold them apart with nothing over-full; one replica cannot. A session's blocks
    count from its first step to its last."""
    trace = _trace(
        (0, (0, 1, 2), "a"),
        (1, (0, 11, 12), "b"),
        (2, (0, 1, 2, 3, 4, 5, 6), "a"),
        (3, (0, 11, 12, 13, 14, 15, 16), "b"),
        (4, (0, 1, 2, 3, 4, 5, 6, 7), "a"),
    )
    shared, sessions = ceilings.sessions_of(trace)
    assert shared == 1
    assert sessions["a"].own == (2, 6, 7) and sessions["b"].own_at(2.5) == 2
    assert sessions["a"].own_at(2.5) == 6 and sessions["b"].own_at(3.5) == 0
    assert ceilings.best_fit_overflow(trace, shared, sessions, 2, 10) == (0, [1, 1])
    over, counts = ceilings.best_fit_overflow(trace, shared, sessions, 1, 10)
    assert counts == [2] and over == 1  # at t=3: 1 + 6 + 6 blocks on a 10-block replica
    fill = ceilings.fill_quantiles(trace, shared, sessions, 20)
    assert fill == sorted([3 / 20, 5 / 20, 9 / 20, 13 / 20, 8 / 20])


def test_it_prints_both_ceilings_on_small_slices(capsys: pytest.CaptureFixture[str]) -> None:
    assert ceilings.main(["mooncake", "4000", "400"]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"(?:one shared LRU: hit ratio|admission oracle\):) ([0-9.]+)", out)
    lru, oracle = (float(x) for x in found)
    assert oracle > lru > 0
    assert "continuation:" in out and "reuse distance" in out and "output < 50:" in out
    assert out.count(" / ") >= 4 and "10:1:1:1:" in out
    assert ceilings.main(["sessions", "agent-sessions:sessions=8,concurrency=4,steps=6", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 sessions, 48 requests, 2 replicas" in out and "on an over-full replica" in out
    assert ceilings.main([]) == 2
