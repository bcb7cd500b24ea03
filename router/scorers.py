"""Scorers: each maps every candidate to a score in [0, 1], higher is better (GIE style)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import mmh3

from router.types import Replica, RouteRequest


class Scorer(Protocol):
    name: str

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]: ...


def _lower_is_better(values: dict[str, float]) -> dict[str, float]:
    """Min-max normalise so the smallest value scores 1 and the largest 0."""
    low, high = min(values.values()), max(values.values())
    if high <= low:
        return dict.fromkeys(values, 1.0)
    return {k: (high - v) / (high - low) for k, v in values.items()}


class PrefixScorer:
    """Share of the request's prompt blocks already cached on each replica."""

    name = "prefix"

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]:
        if req.num_blocks == 0:
            return {r.id: 0.0 for r in replicas}
        return {r.id: min(req.overlap.get(r.id, 0) / req.num_blocks, 1.0) for r in replicas}


class EstimatedWorkScorer:
    """Less load (prefill work ahead of this request's first token, and weighted decode still
    running) scores higher."""

    name = "estimated_work"

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]:
        return _lower_is_better({r.id: req.load(r) for r in replicas})


class InflightScorer:
    """Fewer requests in flight from this gateway scores higher (the classic least-load)."""

    name = "inflight"

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]:
        return _lower_is_better({r.id: float(r.num_inflight) for r in replicas})


class RoundRobinScorer:
    """Replica number `sequence mod n` (in id order) scores 1, the next ones less, cyclically."""

    name = "round_robin"

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]:
        ids = sorted(r.id for r in replicas)
        n = len(ids)
        first = req.sequence % n if n else 0
        return {rid: 1.0 - ((i - first) % n) / n for i, rid in enumerate(ids)}


class RandomScorer:
    name = "random"

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]:
        return {r.id: rng.random() for r in replicas}


class RendezvousScorer:
    """Highest-random-weight hashing of the request's affinity key (its first K blocks).

    A replica joining or leaving moves only the keys it wins or held.
    """

    name = "consistent_hash"

    def score(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> dict[str, float]:
        key = req.affinity_key
        return {
            r.id: mmh3.mmh3_x64_128_uintdigest(key + r.id.encode()) / 2.0**128 for r in replicas
        }
