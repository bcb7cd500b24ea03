"""Filters: narrow the candidate set before scoring. A filter never empties a non-empty set
on its own account; the profile keeps filtered-out replicas as fallbacks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.types import DecisionMemo, Replica, RouteRequest

DEFAULT_ABSOLUTE_SLACK_TOKENS = 131_072.0
"""Locality is kept while a replica's estimated work is within this many prefill tokens of the
least-loaded one: ~10 s of prefill at 13k tokens/s (an H100, 8B model). A diversion re-prefills
the whole prefix now AND duplicates it in a second cache, where it evicts other conversations'
prefixes, so a hit is worth a long queue. `kvgate sim` on the Mooncake conversation trace
(8 replicas, capacity 0.25, an engine-sized directory) measured 95.5% of one shared LRU's hit
ratio at 16,384 tokens, 98.5% at 65,536 and 99.9% at 131,072, with p99 TTFT 5.8 / 5.9 / 6.5 s
against least_load's 8.7 s (the tail there is the requests' own prefill). A purely relative
bound trips whenever the best replica has any queue while others are idle and throws locality
away."""

DEFAULT_DECODE_TOKEN_WEIGHT = 4.0
"""Prefill tokens of load one outstanding output token counts for: a full batch (64 sequences)
steps every ~20 ms on an H100 serving an 8B model, so one sequence's token takes ~0.3 ms of the
engine, in which it prefills ~4 tokens at 13,000/s. The 131,072-token slack then tolerates
~32,000 outstanding output tokens more than the least-loaded replica (64 streams of 500 tokens
to go: a full batch) before locality gives way."""

DEFAULT_RELATIVE_SLACK = 0.5
"""...plus half of the least-loaded replica's estimated work, so the bound widens under load
instead of pinning every request to whichever replica happens to be idle."""


class Filter(Protocol):
    name: str

    def filter(
        self, req: RouteRequest, replicas: Sequence[Replica], memo: DecisionMemo | None = None
    ) -> list[Replica]: ...


class HealthyFilter:
    """Replicas that answer their health probes."""

    name = "healthy"

    def filter(
        self, req: RouteRequest, replicas: Sequence[Replica], memo: DecisionMemo | None = None
    ) -> list[Replica]:
        return [r for r in replicas if r.healthy]


class LoadBoundFilter:
    """Replicas whose load is within the slack of the least-loaded replica.

    load(r) = prefill tokens queued on r + this request's uncached tokens on r (a replica that
    holds the prefix counts its saving) + decode_token_weight × output tokens r is still to
    generate (`RouteRequest.load`); eligible when
        load(r) <= min_load + absolute_slack + relative_slack * min_load.

    A KV cache the engine reports full is not over the bound on that account: a request there
    waits for running ones to free blocks (vLLM admits no request it cannot hold), and that
    wait is their prefill and outstanding output, already in the load. Treating usage >= 95%
    as over the bound moved a long agent session off the replica holding it whenever another
    session ran there (docs/design/routing.md, "A KV cache reported full").

    Stickiness (issue 40): the conversation's home (`RouteRequest.home`) stays eligible while
        load(home) − stickiness × tokens cached there <= the limit,
    so a session leaves the KV it built only when its wait exceeds the bound by that KV's
    re-prefill (moving costs it now, and the blocks it displaces where it lands); a session
    with nothing left at home (back from a pause, evicted) gets no extra slack and moves to
    where the load is, for free.
    """

    name = "load_bound"

    def __init__(
        self,
        absolute_slack_tokens: float = DEFAULT_ABSOLUTE_SLACK_TOKENS,
        relative_slack: float = DEFAULT_RELATIVE_SLACK,
        stickiness: float = 0.0,
    ) -> None:
        if absolute_slack_tokens < 0 or relative_slack < 0 or stickiness < 0:
            raise ValueError("load bound slacks must be non-negative")
        self.absolute_slack_tokens = absolute_slack_tokens
        self.relative_slack = relative_slack
        self.stickiness = stickiness

    def bound(self, req: RouteRequest, replicas: Sequence[Replica]) -> float:
        least = min(req.load(r) for r in replicas)
        return least + self.absolute_slack_tokens + self.relative_slack * least

    def filter(
        self, req: RouteRequest, replicas: Sequence[Replica], memo: DecisionMemo | None = None
    ) -> list[Replica]:
        if not replicas:
            return []
        loads = (memo or DecisionMemo(req)).loads(replicas)  # the tie-breaks read them too
        least = min(loads)
        limit = least + self.absolute_slack_tokens + self.relative_slack * least
        home = req.home if self.stickiness else None
        if home is None:
            return [r for r, load in zip(replicas, loads, strict=True) if load <= limit]
        stake = self.stickiness * req.overlap.get(home, 0) * req.tokens_per_block
        return [
            r
            for r, load in zip(replicas, loads, strict=True)
            if load <= limit or (r.id == home and load - stake <= limit)
        ]
