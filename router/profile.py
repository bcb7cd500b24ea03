"""A scheduling profile: filters, then weighted scorers, then a picker (GIE
`scheduler_profile.go`).

Hard filters (health) remove replicas for good. Soft filters (the load bound) demote them: the
ranking lists the replicas that pass every filter first and the demoted ones after, each group
ordered by weighted score, so a retry after an upstream failure still has somewhere to go.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.claims import counted_claims
from router.filters import Filter, HealthyFilter
from router.herd import spread_ties
from router.pickers import max_score_ranking
from router.scorers import Scorer
from router.types import Decision, DecisionMemo, Replica, RouteRequest


@dataclass(frozen=True)
class RoutingProfile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    locality: bool = False
    """A locality profile explains its choice as prefix / load_bound / no_match."""

    def decide(
        self, req: RouteRequest, replicas: Sequence[Replica], rng: random.Random
    ) -> Decision | None:
        """Rank the replicas for `req`; None when no replica survives the hard filters."""
        if req.claimed:  # which speculative claims count, by the queue (router.claims)
            req = counted_claims(req, replicas)
        candidates = list(replicas)
        demoted: list[Replica] = []
        memo = DecisionMemo(req)
        for f in self.filters:
            kept = f.filter(req, candidates, memo)
            if not isinstance(f, HealthyFilter):
                kept_ids = {r.id for r in kept}
                demoted.extend(r for r in candidates if r.id not in kept_ids)
            candidates = kept
            if not candidates:
                break
        if not candidates and not demoted:
            return None
        eligible = self._scores(req, candidates, rng, memo)
        ranking = max_score_ranking(eligible, rng) if eligible else []
        if req.peers and self.locality:  # peers place a burst on this view at once (router.herd)
            ranking = spread_ties(req, ranking, eligible, candidates, memo)
        scored = eligible
        if demoted:
            below = self._scores(req, demoted, rng, memo)
            ranking += max_score_ranking(below, rng)
            scored = {**below, **eligible}
        matched = req.overlap.get(ranking[0], 0)
        reason = self._reason(req, candidates, demoted, matched)
        return Decision(
            tuple(ranking), reason, matched, tuple(scored[r] for r in ranking), self.name
        )

    def _scores(
        self, req: RouteRequest, group: list[Replica], rng: random.Random, memo: DecisionMemo
    ) -> dict[str, float]:
        total = dict.fromkeys((r.id for r in group), 0.0)
        if not group:
            return total
        for scorer, weight in self.scorers:
            for rid, value in scorer.score(req, group, rng, memo).items():
                total[rid] += weight * min(max(value, 0.0), 1.0)
        return total

    def _reason(
        self,
        req: RouteRequest,
        eligible: list[Replica],
        demoted: list[Replica],
        matched: int,
    ) -> str:
        if not self.locality:
            return self.name
        best_demoted = max((req.overlap.get(r.id, 0) for r in demoted), default=0)
        if best_demoted > matched:
            return "load_bound"
        return "prefix" if matched > 0 else "no_match"
