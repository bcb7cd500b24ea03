"""Hot prefixes: how many replicas a prefix should be spread over, and the spreading itself.

Agent traffic has one hot spine (every request of a tenant shares its tools and system prompt);
sent to the one replica holding it, the spine melts that replica. The rate of requests matching
a prefix (at the depth where they matched) is compared with what one replica can prefill:

    threshold (requests/min/replica) = hot_share × 60 × prefill_tokens_per_s / uncached tokens

i.e. a prefix is hot when its requests alone would take more than `hot_share` of a replica's
prefill time. The prefix then spreads over k = ceil(rate / threshold) replicas — the holders,
then the next best by estimated work, which cache it too — and k shrinks by one only when the
rate falls below (k − 1) × threshold × `shrink_ratio` (hysteresis: no flapping at the edge).
Pure functions of their arguments, as everything in `router/`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.types import Replica, RouteRequest

DEFAULT_HOT_SHARE = 0.3
"""A prefix may take 30% of a replica's prefill time before it spreads: queueing delay grows
steeply past ~70% utilization, and the replica also serves the conversations (deeper prefixes)
it holds. Spreading early costs one more write of the spine per replica, nothing more."""
DEFAULT_SHRINK_RATIO = 0.7
"""Shrink from k to k−1 only at 70% of the (k−1) threshold: a 30% band against flapping."""
DEFAULT_MIN_THRESHOLD_PER_MIN = 15.0
"""Never call a prefix hot below 15 requests per minute per replica (OpenAI's documented
overflow point), however long its requests' uncached suffixes are."""


@dataclass(frozen=True)
class OverflowConfig:
    prefill_tokens_per_s: float
    hot_share: float = DEFAULT_HOT_SHARE
    shrink_ratio: float = DEFAULT_SHRINK_RATIO
    min_threshold_per_min: float = DEFAULT_MIN_THRESHOLD_PER_MIN
    fixed_threshold_per_min: float | None = None
    """A fixed rate above which a prefix is hot, instead of the one its size implies."""

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if not 0 < self.hot_share <= 1:
            raise ValueError("hot_share must be in (0, 1]")
        if not 0 < self.shrink_ratio <= 1:
            raise ValueError("shrink_ratio must be in (0, 1]")


def threshold_per_min(config: OverflowConfig, uncached_tokens: float) -> float:
    """Requests per minute one replica can give a prefix whose requests each prefill
    `uncached_tokens` beyond it."""
    per_request_s = max(uncached_tokens, 1.0) / config.prefill_tokens_per_s
    return max(config.hot_share * 60.0 / per_request_s, config.min_threshold_per_min)


def next_k(
    current: int, rate_per_min: float, threshold: float, shrink_ratio: float, limit: int
) -> int:
    """Grow at once to ceil(rate / threshold); shrink one step at a time, below the band."""
    if limit < 1:
        return 1
    wanted = max(1, math.ceil(rate_per_min / threshold))
    k = max(current, 1)
    if wanted > k:
        k = wanted
    elif k > 1 and rate_per_min < (k - 1) * threshold * shrink_ratio:
        k -= 1
    return min(k, limit)


def spread(
    req: RouteRequest, replicas: Sequence[Replica], depth: int, k: int
) -> tuple[RouteRequest, list[str]]:
    """Let k replicas count as holding the first `depth` blocks: the holders first, then the
    healthy non-holders with the least load. Deeper matches keep their real depth.
    Returns the request with its virtual overlap and the replicas newly added."""
    holders = [r for r in replicas if req.overlap.get(r.id, 0) >= depth]
    missing = k - len(holders)
    if depth <= 0 or missing <= 0:
        return req, []
    others = sorted(
        (r for r in replicas if r.healthy and req.overlap.get(r.id, 0) < depth),
        key=lambda r: (req.load(r), r.id),
    )
    added = [r.id for r in others[:missing]]
    overlap = dict(req.overlap)
    for rid in added:
        overlap[rid] = depth
    return replace(req, overlap=overlap), added


def widen(
    req: RouteRequest,
    replicas: Sequence[Replica],
    rate_per_min: float,
    current_k: int,
    config: OverflowConfig,
) -> tuple[RouteRequest, int, list[str]]:
    """The whole hot-prefix step, as the gateway and the simulator run it: the prefix this
    request matched (its deepest block any replica holds) is requested at `rate_per_min`;
    returns the request with k replicas counting as holding it, the new k, and the replicas
    added. A request that matched nothing is returned unchanged."""
    depth = max(req.overlap.values(), default=0)
    if depth <= 0:
        return req, current_k, []
    uncached = req.num_prompt_tokens - depth * req.tokens_per_block
    threshold = config.fixed_threshold_per_min or threshold_per_min(config, uncached)
    healthy = sum(1 for r in replicas if r.healthy)
    k = next_k(current_k, rate_per_min, threshold, config.shrink_ratio, healthy)
    widened, added = spread(req, replicas, depth, k)
    return widened, k, added
