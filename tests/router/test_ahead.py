"""N gateways deciding on the published load with the requests looked up ahead of theirs placed
first (issue 39, `router.ahead`): they place a burst as one gateway placing it in the lookups'
order would, where the herd rule alone leaves a gateway's second request blind to its peers'."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from router.ahead import Ahead, place_ahead, ties_by_id
from router.registry import build_policy
from router.types import Replica, RouteRequest

IDS = ("r0", "r1", "r2", "r3")
POLICY = build_policy("cache_aware")


def fleet(*pending: float) -> list[Replica]:
    return [Replica(rid, True, 0, load) for rid, load in zip(IDS, pending, strict=True)]


def request(
    blocks: int, overlap: dict[str, int] | None = None, peers: int = 0, rank: int = 0
) -> RouteRequest:
    return RouteRequest(
        num_blocks=blocks,
        num_prompt_tokens=blocks * 64.0,
        overlap=dict.fromkeys(IDS, 1) if overlap is None else overlap,
        tokens_per_block=64.0,
        peers=peers,
        peer_rank=rank,
    )


def decide(req: RouteRequest, view: list[Replica]) -> str:
    decision = POLICY.decide(req, view, random.Random(0))
    assert decision is not None
    return decision.replica


def one_gateway(burst: list[RouteRequest], view: list[Replica]) -> list[str]:
    """One gateway placing `burst` one request after another, ties by id."""
    placed, out = list(view), []
    for req in burst:
        rid = decide(ties_by_id(req), placed)
        out.append(rid)
        i = IDS.index(rid)
        placed[i] = replace(
            placed[i],
            num_inflight=placed[i].num_inflight + 1,
            pending_prefill_tokens=placed[i].pending_prefill_tokens + req.uncached_tokens(rid),
        )
    return out


def many_gateways(burst: list[RouteRequest], view: list[Replica], gateways: int) -> list[str]:
    """`burst` spread round robin over `gateways`, looked up in its order, every one of them
    placed before any is published: each gateway decides on `view` with the requests looked
    up before its own placed first (its own where it sent them, its peers' unknown), ties by
    id, or by the herd rule's copies when none is ahead; each registered as decided."""
    out: list[str] = []
    decided: list[RouteRequest] = []
    for i, req in enumerate(burst):
        g = i % gateways
        ahead = [
            Ahead(earlier, out[j] if j % gateways == g else None)
            for j, earlier in enumerate(decided)
        ]
        seen, _ = place_ahead(POLICY, ahead, view)
        by = ties_by_id(req) if ahead else replace(req, peers=gateways - 1, peer_rank=g)
        decided.append(by)
        out.append(decide(by, seen))
    return out


@settings(max_examples=150, deadline=None)
@given(
    loads=st.lists(st.sampled_from((0.0, 500.0, 8_000.0, 90_000.0)), min_size=4, max_size=4),
    burst=st.lists(
        st.tuples(
            st.sampled_from((2, 8, 60, 400, 1_500)),
            st.dictionaries(st.sampled_from(IDS), st.sampled_from((1, 4, 30)), max_size=2),
        ),
        min_size=1,
        max_size=12,
    ),
    gateways=st.integers(2, 4),
)
def test_gateways_place_a_burst_as_one_gateway_in_the_lookups_order(
    loads: list[float], burst: list[tuple[int, dict[str, int]]], gateways: int
) -> None:
    view = fleet(*loads)
    reqs = [
        request(blocks, {rid: min(n, blocks) for rid, n in held.items()}) for blocks, held in burst
    ]
    assert many_gateways(reqs, view, gateways) == one_gateway(reqs, view)


def test_a_peers_long_prompt_ahead_keeps_this_gateways_second_request_off_its_replica() -> None:
    """Two gateways, a burst of four new prompts on an idle fleet: gateway 0 a small one, 1 a
    96,000-token one (the herd rule spreads them: r0, r1), then two small ones. Gateway 0's
    second, blind to its peer's first, sends its small prompt behind the long one on r1 by the
    herd rule alone; with the requests looked up ahead it goes where one gateway sends it."""
    view = fleet(0.0, 0.0, 0.0, 0.0)
    small, long = request(20), request(1_500)
    burst = [small, long, small, small]
    assert decide(request(20, peers=1, rank=0), view) == "r0"
    assert decide(request(1_500, peers=1, rank=1), view) == "r1"
    own_only = fleet(1_216.0, 0.0, 0.0, 0.0)  # gateway 0's view: its own first request
    assert decide(request(20, peers=1, rank=0), own_only) == "r1"  # behind the long prompt
    assert many_gateways(burst, view, 2) == one_gateway(burst, view) == ["r0", "r1", "r2", "r3"]


def test_this_gateways_own_requests_ahead_count_where_it_sent_them() -> None:
    view = fleet(0.0, 0.0, 0.0, 0.0)
    req = ties_by_id(request(100))
    seen, where = place_ahead(POLICY, [Ahead(req, "r3"), Ahead(req)], view)
    assert where == ["r3", "r0"]
    assert [r.pending_prefill_tokens for r in seen] == [6_336.0, 0.0, 0.0, 6_336.0]
    assert [r.num_inflight for r in seen] == [1, 0, 0, 1]


def test_nothing_ahead_leaves_the_view_and_the_decision_as_they_were() -> None:
    """A gateway alone, or with every placement published: nothing to place first."""
    view = fleet(300.0, 0.0, 900.0, 50.0)
    seen, where = place_ahead(POLICY, [], view)
    assert seen == view and where == []
    assert decide(request(40), seen) == decide(request(40), view)


def test_a_request_ahead_that_no_replica_can_take_adds_nothing() -> None:
    view = [replace(r, healthy=False) for r in fleet(0.0, 0.0, 0.0, 0.0)]
    seen, where = place_ahead(POLICY, [Ahead(ties_by_id(request(100)))], view)
    assert where == [None] and seen == view


def test_a_request_ahead_is_replayed_as_its_gateway_decided_it() -> None:
    """The first of a burst had nothing ahead: its gateway (rank 1 of 2) ranked the tie with a
    copy for its peer, and took r1. Its peer, replaying it, must place it there too."""
    view = fleet(0.0, 0.0, 0.0, 0.0)
    first = request(20, peers=1, rank=1)
    assert decide(first, view) == "r1"
    _, where = place_ahead(POLICY, [Ahead(first)], view)
    assert where == ["r1"]
