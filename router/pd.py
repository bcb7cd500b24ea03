"""The decode pick of a disaggregated (prefill/decode) fleet: load first, its own cache within it.

The prefill instance is chosen by the ordinary profile (cache-aware within the prefill pool's
load bound: the prefill is where a hit saves compute). The decode instance then pulls the blocks
it lacks from that prefill instance; a decode instance that already holds most of the prompt (a
continuation's previous turn decoded there) pulls less and keeps its cache warm for the next
turn, but decode time is bound by how many sequences a step serves, so load comes first:

    load(d)  = decode_work_tokens(d) + DECODE_INFLIGHT_TOKENS × num_inflight(d)
    bound    = min_d load(d) × (1 + relative_slack) + absolute_slack_tokens
    pick     = argmax over {d : load(d) ≤ bound} of overlap(d), then least load, then random

No I/O, no clocks: the same function runs in the gateway and in a simulation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from router.types import Replica

DEFAULT_DECODE_RELATIVE_SLACK = 0.25
"""A decode instance 25% busier than the least busy one may still be chosen for its cache: a
step's time grows with its batch, so a larger slack trades inter-token latency for pulls."""
DEFAULT_DECODE_ABSOLUTE_SLACK_TOKENS = 256.0
"""An idle pool is not split by a few tokens: 256 output tokens is one short answer."""
DECODE_INFLIGHT_TOKENS = 64.0
"""A request in flight whose output length is unknown counts as 64 tokens (a short answer)."""


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
    (`overlap`: leading prompt blocks each holds), then the rest by load."""
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
