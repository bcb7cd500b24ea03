"""LoRA adapter affinity: a filter and a scorer over where a request's adapter is resident
(issue 42, item 7; the Inference Extension's LoRA affinity, llm-d's and Dynamo's alike).

A request for an adapter carries, per candidate replica, what serving it there costs in
adapter slots (`RouteRequest.adapter_slots`, from the gateway's mirror of each replica's
residency, `gateway.fleet.adapters`):

    RESIDENT   2  the adapter is in one of the replica's GPU slots: no load
    LOADABLE   1  a slot is free, or the least recently used adapter there is idle: one load
    FULL       0  every slot holds an adapter in use: loading this one evicts one that is
                  about to be asked for again (thrash), or waits until a slot frees

`AdapterFilter` (soft) demotes FULL replicas while any other candidate is left, so an adapter
at a replica's limit is never swapped for another in use. `AdapterScorer` scores RESIDENT 1
and the rest 0: weighted above the prefix scorer, a request prefers a replica where its
adapter is resident, then (among those, or among the loadable ones when none is) the longest
prefix cached under the adapter within the load bound — its keys already include the adapter,
as vLLM's block hashes do. A resident replica over the load bound is demoted by the bound like
any other, so a busy adapter spreads to a loadable replica rather than queueing.

An empty `adapter_slots` (the base model, or adapters unknown) leaves every ranking as it was.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.types import DecisionMemo, Replica, RouteRequest

FULL = 0
LOADABLE = 1
RESIDENT = 2

DEFAULT_ADAPTER_WEIGHT = 2.0
"""Residency outweighs a whole prompt's cached prefix (the prefix scorer's 1): a cold load
stalls every request of the batch behind it, and a replica holding the adapter also holds its
prefixes more often than not (its blocks are keyed under the adapter)."""


DEFAULT_ADAPTER_BUSY_S = 2.0
"""An adapter sent to a replica within the last 2 s counts as in use there even when no scrape
has shown it yet (scrapes run every second or so): evicting it would likely stall its next
request (`gateway.fleet.adapters`)."""


class AdapterFilter:
    """Replicas whose slots can take the adapter without evicting one in use (soft)."""

    name = "adapter_slots"

    def filter(
        self, req: RouteRequest, replicas: Sequence[Replica], memo: DecisionMemo | None = None
    ) -> list[Replica]:
        slots = req.adapter_slots
        if not slots:
            return list(replicas)
        kept = [r for r in replicas if slots.get(r.id, LOADABLE) != FULL]
        return kept or list(replicas)  # never empties the set on its own account


class AdapterScorer:
    """1 where the request's adapter is resident, else 0."""

    name = "adapter"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        slots = req.adapter_slots
        if not slots:
            return {}
        return {r.id: 1.0 for r in replicas if slots.get(r.id) == RESIDENT}
