"""When a turn stops waiting behind its previous turn queued at home (issue 40).

Precise mode counts a placement's blocks as held on its replica from the placement on (a
speculative entry, `RouteRequest.claimed`), until the engine's event stores them. A
conversation's next turn often arrives while its previous one is still queued: its context is
then held nowhere yet, and only the claim keeps it home. Kept for as long as the prefill might
take, though, a claim keeps turns waiting behind a long queue where moving would have been
faster (and, at a KV with room to spare, cheap); dropped after a fixed 2 s it sends every turn
whose previous one waits longer elsewhere, to prefill the whole context a second time and evict
other sessions there (docs/precise.md, "The queued turn"). So the home's claim counts by the
queue, not by its age:

    claim(home) counts  ⇔  queue(home) ≤ ½ × reprefill(home)
    queue(home)      = prefill tokens queued on the home ahead of this request (this gateway's
                       pending prefills, the queued turn's own among them, and other gateways')
    reprefill(home)  = the request's prompt tokens past the most blocks any other replica
                       holds (by events, not claimed): what it prefills if it goes elsewhere

A claim on another replica (a fan-out sibling's leader, another conversation sharing the
prefix, or this conversation's own turn placed there before it moved) counts by what is queued
there beyond the claimed tokens (`OFF_HOME_QUEUE_SHARE`),

    claim(r ≠ home) counts  ⇔  queue(r) − claimed(r) tokens ≤ ¾ × reprefill(r)

A leader's claim behind nothing but its own prefill counts (judged by the whole queue, such
claims cost precise `cache_pressure` 1.25 points of the property sweep's synthetic slice at 5%
KV), while one behind more than ¾ of a re-prefill of other sessions' prefills does not: those run
first and, on a KV holding about one long session, evict the claimed blocks before this request
reads them. Counted whole for its ttl (round 5), such claims touched ~100 of the issue-shaped
trace's 8,804 placements at 10% KV, few of them in the tail, yet judging them moved precise
`cache_aware`'s p99 TTFT from 77-83 s to 60-62 s over seeds 0-2 (the schedule those decisions
change; the tail itself is placements booked by prefixes the queue ahead evicts:
docs/precise.md, "The claim off the home", round 6). (Dropping every claim on a replica with
nothing queued, its placement past its first token, opened gaps of 0.58 and 0.78 points on the
16-token sessions at 5% and 10%: its events are still on their way then.)

Waiting for the claimed blocks is then well below prefilling them again on an idle replica
(`QUEUE_SHARE`); where it is not, the replica keeps only the blocks its events hold and the
load bound and the scorers decide on those, as they did once a claim expired.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from router.types import Replica, RouteRequest

QUEUE_SHARE = 0.5
"""A claim counts while its replica's queue is at most half the request's re-prefill elsewhere.
The queue counts the queued turn's own prefill too: at ½, a turn whose previous turn is
re-prefilling its whole context at home (the home had evicted it) does not keep the claim, as
that prefill alone is about its own re-prefill, while a turn whose previous turn hit keeps it
while the queue is short. `kvgate sim` on the issue-shaped trace at 10% KV, seeds 0-2, precise
`cache_pressure`, measured with the rule on every claim (before it was narrowed to the home's):
1 gave 97.5 / 97.7 / 97.3% of the shared LRU at imbalance 1.39 / 1.20 / 1.33, ½ 97.5 / 97.6 /
97.5% at 1.26 / 1.16 / 1.26; on the home only, ¼, ½ and ¾ read alike (97.9%, imbalance 1.33,
seed 0), and no rule at all 98.8% at 10% but 95.2% at 25% (docs/precise.md, "The queued turn:
a claim by the queue")."""


OFF_HOME_QUEUE_SHARE = 0.75
"""A claim off the home counts while the prefill queued on its replica beyond the claimed tokens
is at most ¾ of the request's re-prefill elsewhere: that queue runs before the request, and on
a KV of about one session it evicts the claim. On the issue-shaped trace, precise `cache_aware`
at 10% KV, seed 0 (p99 TTFT, imbalance): ½ 97.2% of the shared LRU, 71.0 s, 1.26; ¾ 97.4%,
60.6 s, 1.20; 1 97.4%, 60.3 s, 1.21; at 25% KV ½ 98.9%, 28.0 s; ¾ 98.9%, 30.0 s; 1 98.6%,
33.6 s (round 4: 31.7 s) (docs/precise.md, "The claim off the home")."""


def claim_counts(req: RouteRequest, replica: Replica, held: dict[str, int]) -> bool:
    """Whether `replica`'s claimed blocks count for `req` (the module's rule); `held` is each
    replica's overlap less its claimed blocks."""
    elsewhere = max((n for r, n in held.items() if r != replica.id), default=0)
    reprefill = max(req.num_prompt_tokens - elsewhere * req.tokens_per_block, 0.0)
    queue = replica.pending_prefill_tokens + replica.foreign_prefill_tokens
    if replica.id != req.home:
        queue -= req.claimed.get(replica.id, 0) * req.tokens_per_block
        return queue <= OFF_HOME_QUEUE_SHARE * reprefill
    return queue <= QUEUE_SHARE * reprefill


def counted_claims(req: RouteRequest, replicas: Sequence[Replica]) -> RouteRequest:
    """`req` with the claims that do not count taken out of its overlap (and of `claimed`):
    the same request when every claim counts."""
    if not req.claimed:
        return req
    held = {r: n - req.claimed.get(r, 0) for r, n in req.overlap.items()}
    dropped = [r.id for r in replicas if req.claimed.get(r.id) and not claim_counts(req, r, held)]
    if not dropped:
        return req
    overlap = dict(req.overlap)
    claimed = dict(req.claimed)
    for rid in dropped:
        del claimed[rid]
        if held.get(rid, 0) > 0:
            overlap[rid] = held[rid]
        else:  # (absent already when the caller dropped the replica's overlap, a suspect's)
            overlap.pop(rid, None)
    unclaimed = {rid: req.claimed[rid] for rid in dropped}
    return replace(req, overlap=overlap, claimed=claimed, unclaimed=unclaimed)
