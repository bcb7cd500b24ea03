"""The routing step the gateway and the simulator share: a hot prefix widened over k replicas
(`router.overflow`), then the policy's decision (`router.profile`).

    plan(policy, route, replicas, rng, hot, overflow) ──▶ Plan(decision, route, k, spread)

The gateway runs it between a fan-out hold and a fan-out lead (`gateway.pipeline.placement`),
`kvgate sim` on every simulated request: the same code decides in both. Pure, like the rest of
`router/`: the caller supplies the prefix's rate and stores the k that comes back.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.overflow import OverflowConfig, widen
from router.profile import RoutingProfile
from router.types import Decision, Replica, RouteRequest


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """The prefix a request matched: its request rate (this request counted) and its k."""

    rate_per_min: float
    k: int


@dataclass(frozen=True, slots=True)
class Plan:
    decision: Decision | None
    """None when no replica passes the policy's filters."""
    route: RouteRequest
    """The request as the policy saw it (a hot prefix's spread counted as held)."""
    k: int | None = None
    """The hot prefix's k after this request (None: no hot-prefix step ran)."""
    spread: bool = False
    """The hot prefix was spread to replicas that did not hold it yet."""


def plan(
    policy: RoutingProfile,
    route: RouteRequest,
    replicas: Sequence[Replica],
    rng: random.Random,
    hot: HotPrefix | None = None,
    overflow: OverflowConfig | None = None,
) -> Plan:
    if overflow is None or hot is None:
        return Plan(policy.decide(route, replicas, rng), route)
    widened, k, added = widen(route, replicas, hot.rate_per_min, hot.k, overflow)
    return Plan(policy.decide(widened, replicas, rng), widened, k, bool(added))
