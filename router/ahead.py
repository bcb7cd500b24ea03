"""The requests looked up ahead of this one: N gateways placing a burst as one gateway would
(issue 39, the tail of `router.herd`).

The herd rule ranks a tie as the gateways' requests of one instant would be placed, with
copies of this request standing for the peers' (`router.herd`). That reaches the first request
each gateway places in a burst. It does not reach the next ones: a peer's placement reaches a
gateway's view a round trip and a routing later, so a gateway's second request of a burst is
blind to its peers' first and second (in `kvgate sim`, bench point 1's slice: the requests
placed second by their gateway in a burst are half of four gateways' TTFT gap to one gateway,
and the p99 is a small prompt queued behind a peer's unseen 100,000-token one). Copies of this
request cannot stand for those: the peers' prompts are of any size (copies of the request's
own size, of the fleet's mean, of an assumed large size, each gateway's own recent placements
counted again per peer: all read worse than the herd rule alone), and the places alone, known
exactly but each at the mean size, still leave +13% of TTFT mean (docs/design/directory.md,
"The requests looked up ahead").

What closes it is the peers' requests themselves. Redis runs the gateways' lookups one at a
time, so it can order them: a lookup that also registers its request (the request's routing
inputs, `RouteRequest`) answers with the requests looked up before it whose placements are not
yet in the published load (`Ahead`). A gateway then decides on

    view        the load every gateway has published (the same figures for all of them: its
                own as its peers read them, not its own exact leases)
    ahead       each request looked up before this one and not yet published, in Redis's
                order, placed on that view one after another: this gateway's own where it sent
                it, a peer's where the policy places it on the view so far
    decision    this request on the view with all of them

so every gateway computes the same placements for the same requests, and N gateways place a
burst as one gateway placing it in Redis's order would (`tests/router/test_ahead.py`). With a
request ahead, ties go by id, not at random (the herd rule's tie group with no copies,
`peer_rank` 0: the requests ahead stand for the peers' of the instant); with none, the herd
rule as it was, copies for the peers deciding at once with it. Each request is registered as
it is decided, and replayed so (`Ahead.req`): a peer's prediction and its own decision agree.
(With copies dropped as well, the agent sessions' p99 read 26.1 s against 19.1 s with them:
there no request is ever ahead, and the copies spread their tail's load.) A gateway alone has
nothing ahead and no peers: it routes as it always did.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.profile import RoutingProfile
from router.types import Replica, RouteRequest


@dataclass(frozen=True, slots=True)
class Ahead:
    """A request looked up before this one whose placement is not yet in the published load."""

    req: RouteRequest
    """As its gateway decided it: ties by id (`ties_by_id`) when a request was ahead of it,
    the herd rule's copies for its place (`router.herd`) when none was."""
    replica: str | None = None
    """Where it went, when this gateway placed it; None: a peer's, placed as the policy places
    it on the view so far."""


def place_ahead(
    profile: RoutingProfile, ahead: Sequence[Ahead], replicas: Sequence[Replica]
) -> tuple[list[Replica], list[str | None]]:
    """`replicas` (the published view) with every request of `ahead` placed on it in order,
    each adding one request in flight and its uncached tokens pending where it goes; and where
    each went (None: the policy placed it nowhere, no replica healthy)."""
    view = list(replicas)
    where: list[str | None] = []
    index = {r.id: i for i, r in enumerate(view)}
    for item in ahead:
        rid = item.replica
        if rid is None:
            decision = profile.decide(item.req, view, random.Random(0))
            rid = decision.replica if decision is not None else None
        where.append(rid)
        i = index.get(rid) if rid is not None else None
        if rid is None or i is None:
            continue
        was = view[i]
        view[i] = replace(
            was,
            num_inflight=was.num_inflight + 1,
            pending_prefill_tokens=was.pending_prefill_tokens + item.req.uncached_tokens(rid),
        )
    return view, where


def ties_by_id(req: RouteRequest) -> RouteRequest:
    """`req` with its load tie ranked by id and no copies (`router.herd` with `peer_rank` 0):
    what a gateway deciding with the requests ahead decides by, so that its peers, replaying
    the request, decide as it did (a random tie-break would not agree)."""
    return replace(req, peers=max(req.peers, 1), peer_rank=0)
