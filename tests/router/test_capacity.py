"""No replica saves a request more than its KV holds (`router.capacity`, issue 40 live): a
narrative of the live agent-session turn that showed it, then the properties of the cap."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.capacity import within_capacity
from router.registry import RouterConfig, build_policy
from router.types import Replica, RouteRequest

BLOCK = 16.0
KV = 1_120 * BLOCK
"""The live bench's engines at 10% KV: 1,120 blocks of 16 tokens."""


def _turn() -> RouteRequest:
    """A 3,900-block turn (62,400 tokens) whose previous turn (3,768 blocks) was placed on its
    home a and is still queued there: a holds 180 blocks by events (the system prompt) and
    claims 3,588 more, three times the KV it has; b holds the system prompt."""
    return RouteRequest(
        3_900,
        3_900 * BLOCK,
        {"a": 3_768, "b": 180},
        tokens_per_block=BLOCK,
        claimed={"a": 3_588},
        home="a",
        home_blocks=3_768,
    )


def test_a_claim_past_the_kv_is_cut_to_it() -> None:
    turn = within_capacity(_turn(), {"a": KV, "b": KV})
    assert turn.overlap == {"a": 1_120, "b": 180}
    assert turn.claimed == {"a": 940}  # the 180 held stay held; the claim fills the rest
    assert turn.home_blocks == 1_120
    # the home's load is the prefill the engine will really run: ≥ the prompt less its KV
    assert turn.uncached_tokens("a") == (3_900 - 1_120) * BLOCK


def test_the_load_a_home_is_counted_at_is_what_its_engine_runs() -> None:
    """Precise `cache_aware` (stickiness 1, affinity 1). Four sessions' turns like `_turn` were
    placed on a, each counted in a's pending prefill (its lease) at its estimate there.
    Uncapped, each counted 132 blocks (2,112 tokens) while the engine prefills at least 2,780:
    the fifth turn reads a as nearly idle, its claim counts and it queues at a behind ~180,000
    tokens. Capped (as the gateway counts leases), a's load is what its engine runs, the
    turn's claim does not count against that queue (`router.claims`: both replicas then hold
    the system prompt alone), and it goes to the idle replica. The ranking reads the turn as
    it is: only the load it adds is capped."""
    policy = build_policy("cache_aware", RouterConfig(stickiness=1.0, affinity_weight=1.0))
    rng = random.Random(0)
    chosen = {}
    for kv in ({}, {"a": KV, "b": KV}):
        queued = 4 * within_capacity(_turn(), kv).uncached_tokens("a")
        replicas = [Replica("a", pending_prefill_tokens=queued), Replica("b")]
        decision = policy.decide(_turn(), replicas, rng)
        assert decision is not None
        chosen[bool(kv)] = (queued, decision.replica, decision.reason)
    assert chosen[False] == (4 * 132 * BLOCK, "a", "prefix")
    assert chosen[True] == (4 * (3_900 - 1_120) * BLOCK, "b", "prefix")


def test_unknown_or_roomy_capacities_change_nothing() -> None:
    turn = _turn()
    assert within_capacity(turn, {}) is turn
    assert within_capacity(turn, {"a": 0.0, "b": 0.0}) is turn
    assert within_capacity(turn, {"a": 4_000 * BLOCK}) is turn


@st.composite
def _requests(draw: st.DrawFn) -> tuple[RouteRequest, dict[str, float]]:
    ids = ["a", "b", "c"]
    num_blocks = draw(st.integers(0, 400))
    overlap: dict[str, int] = {}
    claimed: dict[str, int] = {}
    offloaded: dict[str, int] = {}
    for rid in ids:
        depth = draw(st.integers(0, num_blocks))
        if depth:
            overlap[rid] = depth
            claim = draw(st.integers(0, depth))
            if claim:
                claimed[rid] = claim
            off = draw(st.integers(0, depth - claim))
            if off:
                offloaded[rid] = off
    home = draw(st.sampled_from([None, *ids]))
    per_block = draw(st.sampled_from([16.0, 64.0]))
    req = RouteRequest(
        num_blocks,
        num_blocks * per_block,
        overlap,
        tokens_per_block=per_block,
        claimed=claimed,
        offloaded=offloaded,
        offload_cost=0.07,
        home=home,
        home_blocks=draw(st.integers(0, num_blocks)) if home else 0,
    )
    caps = {rid: float(draw(st.integers(0, 500)) * 16) for rid in ids if draw(st.booleans())}
    return req, caps


@settings(max_examples=300, deadline=None)
@given(_requests())
def test_the_cap_properties(drawn: tuple[RouteRequest, dict[str, float]]) -> None:
    """Every replica with a known KV matches at most that KV; what its events hold is kept up to
    it (the claim goes first); unknown capacities and the blocks within them are untouched;
    the cap never makes a replica cheaper, and applying it twice is applying it once."""
    req, caps = drawn
    out = within_capacity(req, caps)
    for rid, depth in req.overlap.items():
        cap = int(caps[rid] // req.tokens_per_block) if caps.get(rid) else None
        new = out.overlap.get(rid, 0)
        if cap is None or depth <= cap:
            assert new == depth
            assert out.claimed.get(rid, 0) == req.claimed.get(rid, 0)
        else:
            assert new == cap
            held = depth - req.claimed.get(rid, 0)
            assert new - out.claimed.get(rid, 0) == min(held, cap)
        assert 0 <= out.claimed.get(rid, 0) <= new
        assert out.offloaded.get(rid, 0) <= new
        assert out.uncached_tokens(rid) >= req.uncached_tokens(rid) - 1e-9
    home = req.home
    if home is not None and caps.get(home):
        assert out.home_blocks == min(req.home_blocks, int(caps[home] // req.tokens_per_block))
    else:
        assert out.home_blocks == req.home_blocks
    assert within_capacity(out, caps) == out
