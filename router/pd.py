"""The decode pick of a disaggregated (prefill/decode) fleet: load first, its own cache a tie-break.

The prefill instance is chosen by the ordinary profile (cache-aware within the prefill pool's
load bound: the prefill is where a hit saves compute). The decode instance then pulls the blocks
it lacks from that prefill instance. A decode step's time grows with its batch, so every client
of a busier decode instance gets slower tokens: the decode pick is load-aware first. Its own
prefix (a continuation's previous turn decoded there: it pulls less and keeps its cache warm)
only breaks ties between instances whose loads differ by less than one request:

    load(d)  = decode_work_tokens(d) + DECODE_INFLIGHT_TOKENS × num_inflight(d)
    bound    = min_d load(d) × (1 + relative_slack) + absolute_slack_tokens
    pick     = argmax over {d : load(d) ≤ bound} of overlap(d), then least load, then random

The defaults keep the bound under one request's load (a request in flight weighs at least
DECODE_INFLIGHT_TOKENS), so a decode instance one request busier than another is never picked
for its cache: `kvgate bench-pd` had measured a decode-pool imbalance of 1.69 (busiest instance's
output tokens over the mean) and a TPOT p99 a third above round robin's with a bound of
25% + 256 tokens (several requests), where the cache decided nearly every pick.

No I/O, no clocks: the same function runs in the gateway and in a simulation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from router.types import Replica

DECODE_INFLIGHT_TOKENS = 64.0
"""A request in flight whose output length is unknown counts as 64 tokens (a short answer)."""
DEFAULT_DECODE_RELATIVE_SLACK = 0.0
"""No slack proportional to load: at a large batch a few requests' difference would be within
any relative slack, and each of them costs every client of that instance step time."""
DEFAULT_DECODE_ABSOLUTE_SLACK_TOKENS = DECODE_INFLIGHT_TOKENS / 2
"""Half the lightest request: instances level in requests (their expected outputs differing by
less than 32 tokens) are tied, and the cache breaks the tie; one more request is not a tie."""


def decode_load(replica: Replica) -> float:
    return replica.decode_work_tokens + DECODE_INFLIGHT_TOKENS * replica.num_inflight


def rank_decode(
    replicas: Sequence[Replica],
    overlap: Mapping[str, int],
    rng: random.Random,
    relative_slack: float = DEFAULT_DECODE_RELATIVE_SLACK,
    absolute_slack_tokens: float = DEFAULT_DECODE_ABSOLUTE_SLACK_TOKENS,
) -> list[str]:
    """Healthy decode replicas, best first: those within the load bound by cached prefix
    (`overlap`: leading prompt blocks each holds), then least load, then the rest by load."""
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        return []
    loads = {r.id: decode_load(r) for r in healthy}
    bound = min(loads.values()) * (1 + relative_slack) + absolute_slack_tokens
    tiebreak = {r.id: rng.random() for r in healthy}

    def key(r: Replica) -> tuple[int, int, float, float]:
        within = loads[r.id] <= bound
        return (
            0 if within else 1,
            -overlap.get(r.id, 0) if within else 0,
            loads[r.id],
            tiebreak[r.id],
        )

    return [r.id for r in sorted(healthy, key=key)]
