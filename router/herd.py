"""Several gateways placing one burst on the same view of the load (issue 39): the herd.

One gateway places a burst (the Mooncake trace's requests come ten to an arrival millisecond)
one request after another, each seeing the leases before it, so a burst of new prompts spreads
over the replicas as their queues fill. N gateways on one Redis each place their share of it at
the same instant, before any of them has read the others' placements, on the same view: every
one sends its new prompt to the same least-loaded replica, and a small prompt lands behind a
peer's 100,000-token one there. Reading the peers' placements sooner does not reach inside the
instant (docs/design/directory.md, "TTFT: each gateway's view of the load").

So a gateway with peers (`RouteRequest.peers`) ranks a tie as the gateways' requests of one
instant would be placed one after another in the order of their gateways' ids, its own at
its place (`RouteRequest.peer_rank`, among the live gateways' ids):

    tie group   the eligible replicas whose score is the best's but for the load tie-break
                (what decides between them is only which is less loaded)
    ahead       `peer_rank` copies of this request (its uncached tokens there), each added to
                the tie group's least-loaded replica in turn (water-filling), ties by id
    ranking     the tie group by its loads with the copies, least first, ties by id; the rest
                of the ranking unchanged

Where the tie group's loads are even, N gateways deciding at once take N different replicas,
the ones one gateway would have given the first N requests of a burst like this one; where one
replica is far less loaded than the others (by more than the copies), all still go there, as
one gateway would. Ties between equal loads go by id, not at random, so that gateways agree on
the order without talking. A gateway alone (`peers` 0) skips the rule: it routes exactly as it
always did. The decision's scores stay each replica's own (a route receipt's): within a tie
group they differ by less than the tie-break's weight, so the first may read a hair below the
second.

The rule reaches each gateway's first request of a burst only: its next ones are blind to the
peers' placements of the burst, whatever their sizes. `router.ahead` places the peers' requests
themselves, when the lookups report them.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.types import DecisionMemo, Replica, RouteRequest

TIE_BREAK = 1e-6
"""Weight of the load tie-break scorer in the locality profiles (`router.registry`): below
1/num_blocks for any real prompt, so it only decides between equal matches."""

TIED = 1.5 * TIE_BREAK
"""Replicas whose scores differ by at most this are tied but for their load: the most loaded
of a tie group scores the tie-break's whole weight below the least loaded, give or take the
last bits of the other scores' sum (at exactly `TIE_BREAK` the most loaded fell out of the
group by rounding, and the rule spread a burst over one replica fewer)."""


def spread_ties(
    req: RouteRequest,
    ranking: list[str],
    scores: dict[str, float],
    replicas: Sequence[Replica],
    memo: DecisionMemo,
) -> list[str]:
    """`ranking` (the eligible replicas, best first; `scores` theirs) with its leading tie
    group ranked as this gateway's place among its peers' gives it (module docstring)."""
    if req.peers <= 0 or len(ranking) < 2:
        return ranking
    best = scores[ranking[0]]
    size = 1
    while size < len(ranking) and best - scores[ranking[size]] <= TIED:
        size += 1
    if size < 2:
        return ranking
    tied = ranking[:size]
    by_id = {r.id: r for r in replicas}
    filled = dict(zip(tied, memo.loads([by_id[rid] for rid in tied]), strict=True))
    for _ in range(min(req.peer_rank, req.peers)):
        least = min(tied, key=lambda rid: (filled[rid], rid))
        filled[least] += req.uncached_tokens(least)
    return sorted(tied, key=lambda rid: (filled[rid], rid)) + ranking[size:]
