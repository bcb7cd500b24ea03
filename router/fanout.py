"""Fan-out: whether a request should wait for an in-flight sibling's cache write.

Agents fan out parallel calls that share a long prefix. Sent at once, N siblings are N cache
writes of that prefix; if the later ones wait for the first one's prefill to land (its first
token) and then go to its replica, they are 1 write and N−1 reads. Waiting costs at most the
leader's prefill, so it is worth it only when the shared, not-yet-cached part is long, and only
when the leader's replica can take the siblings (it is within the load bound).
Pure: the decision is a function of the snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from router.filters import LoadBoundFilter
from router.types import Replica, RouteRequest

DEFAULT_MIN_HOLD_TOKENS = 1024.0
"""Nobody waits for fewer than 1,024 shared uncached tokens: a duplicate write of that costs
under 0.1 s of prefill on an H100, less than waiting for the leader typically does."""
DEFAULT_HOLD_FACTOR = 2.0
"""A sibling waits at most twice the leader's expected prefill (queue ahead + its own)."""


def with_leader(req: RouteRequest, leader_replica: str, shared_blocks: int) -> RouteRequest:
    """The request as it will look once the leader's write has landed on its replica."""
    overlap = dict(req.overlap)
    overlap[leader_replica] = max(overlap.get(leader_replica, 0), shared_blocks)
    return replace(req, overlap=overlap)


def worth_holding(
    req: RouteRequest,
    replicas: Sequence[Replica],
    leader_replica: str,
    depth: int,
    shared_blocks: int,
    min_hold_tokens: float,
    bound: LoadBoundFilter,
) -> bool:
    """Hold when the leader is writing at least `min_hold_tokens` of this request's uncached
    prefix (blocks depth..shared_blocks) and its replica would be within the load bound."""
    if (shared_blocks - depth) * req.tokens_per_block < min_hold_tokens:
        return False
    target = next((r for r in replicas if r.id == leader_replica), None)
    if target is None or not target.healthy:
        return False
    after = with_leader(req, leader_replica, shared_blocks)
    return any(r.id == leader_replica for r in bound.filter(after, replicas))


def holders_have_room(
    req: RouteRequest, replicas: Sequence[Replica], depth: int, bound: LoadBoundFilter
) -> bool:
    """Whether a replica holding the first `depth` blocks is within the load bound for this
    request (its measured load: queued prefill and outstanding decode). A sibling of a flight
    widens its prefix only when this is False: a burst of siblings is one arrival, and the
    holder that has room serves it with one write (issue 45, item 16)."""
    holders = {r.id for r in replicas if r.healthy and req.overlap.get(r.id, 0) >= depth}
    if not holders:
        return False
    return any(r.id in holders for r in bound.filter(req, replicas))
