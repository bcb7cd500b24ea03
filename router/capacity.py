"""No replica saves a request more than its KV holds (issue 40, live).

A speculative claim (`RouteRequest.claimed`) counts a placed prompt's blocks as held on its
replica from the placement on, and a conversation's home is credited with its previous prompt
(`RouteRequest.home_blocks`); neither knows how much the replica's KV holds. On the live agent
sessions at 10% KV an engine holds 1,120 blocks of 16 tokens (17,920 tokens) against prompts
of 12k-115k tokens: a turn placed at home claimed up to 3,900 blocks there, three times what
the engine can ever give back, so precise mode counted the home's load at the turn's new
tokens only (the lease, the load bound, flow control's room) and its stickiness stake at the
whole context — while the engine prefilled ~all of it. Approximate mode never had the fault:
its directory is sized to each engine's KV (`gateway.directory.sizing`). So, per replica with
a known capacity,

    overlap(r)     <- min(overlap(r), capacity_blocks(r))
    claimed(r)     <- overlap(r) − min(held(r), overlap(r))  (held: the events' part, kept)
    offloaded(r)   <- min(offloaded(r), overlap(r))
    home_blocks    <- min(home_blocks, capacity_blocks(home))

with capacity_blocks(r) = floor(kv_capacity_tokens(r) / tokens_per_block). An engine holds a
chain's leading blocks while it holds any (it evicts a chain tail first), so a capped overlap
is what a fully held replica gives; the cap never binds where prompts fit the KV (the
simulator's issue-shaped traces), nor where the capacity is unknown (0).

Where it applies: the load a placement adds (the gateway's lease, the simulator's pending
estimate) and flow control's view of a request (its cost, the affinity wait's saving) — not
the ranking, which reads the request as the lookup found it. Capped there too, the
simulator's 16-token agent sessions read precise `cache_pressure` 0.58 / 0.78 points under
approximate at 5% / 10% KV (`tests/loadgen/test_sim_property.py`), against at or above it
with the load alone capped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from router.types import RouteRequest


def capacity_blocks(capacity_tokens: float, tokens_per_block: float) -> int | None:
    """A replica's KV in the request's blocks (None: unknown)."""
    if capacity_tokens <= 0 or tokens_per_block <= 0:
        return None
    return math.floor(capacity_tokens / tokens_per_block)


def within_capacity(req: RouteRequest, capacity_tokens: Mapping[str, float]) -> RouteRequest:
    """`req` with every replica's cached blocks at most its KV (the module's rule); the same
    object when nothing exceeds a capacity. `capacity_tokens`: per replica, its KV in tokens
    (absent or 0: unknown, left as it is)."""
    if not capacity_tokens:
        return req
    per_block = req.tokens_per_block
    caps = {
        rid: cap
        for rid, tokens in capacity_tokens.items()
        if (cap := capacity_blocks(tokens, per_block)) is not None
    }
    over = [rid for rid, n in req.overlap.items() if rid in caps and n > caps[rid]]
    home = req.home
    home_cap = caps.get(home) if home is not None else None
    home_over = home_cap is not None and req.home_blocks > home_cap
    if not over and not home_over:
        return req
    overlap = dict(req.overlap)
    claimed = dict(req.claimed)
    offloaded = dict(req.offloaded)
    for rid in over:
        overlap[rid] = caps[rid]
        if rid in claimed:  # what the events hold stays; the claim above it goes first
            held = req.overlap[rid] - claimed[rid]
            left = caps[rid] - min(held, caps[rid])
            if left:
                claimed[rid] = left
            else:
                del claimed[rid]
        if rid in offloaded:
            offloaded[rid] = min(offloaded[rid], caps[rid])
    return replace(
        req,
        overlap=overlap,
        claimed=claimed,
        offloaded=offloaded,
        home_blocks=min(req.home_blocks, home_cap)
        if home_over and home_cap is not None
        else req.home_blocks,
    )
