"""A route receipt: why a request went where it went, in a few fields.

    policy=cache_aware reason=prefix replica=R matched=12/40 score=1.0
    runner_up=S runner_up_matched=3 runner_up_score=0.42            (one line)

`replica` is the decision's first choice; `answered` is added when a retry took the request
elsewhere. The matched blocks are of this request's own salted chain (a tenant's receipt says
nothing of another tenant's prefixes); the scores fold in the replicas' load. The access log
carries the fields on every exchange (operators); the `x-kvgate-route` response header carries
the short form only where the operator turned it on (`debug_headers`, or the tenant's
`route_receipts`), since replica names and load are the fleet's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.request.state import Routed
from router.types import Decision


def receipt_fields(routed: Routed, answered: str) -> dict[str, Any]:
    return decision_fields(routed.decision, routed.route.overlap, routed.route.num_blocks, answered)


def decision_fields(
    decision: Decision, overlap: Mapping[str, int], num_blocks: int, answered: str
) -> dict[str, Any]:
    """`receipt_fields` from the values it reads (what `RecentRoutes` keeps of an exchange)."""
    ranking, scores = decision.ranking, decision.scores
    fields: dict[str, Any] = {
        "policy": decision.policy,
        "reason": decision.reason,
        "replica": ranking[0],
        "matched": f"{decision.matched_blocks}/{num_blocks}",
        "score": _score(scores, 0),
    }
    if answered != ranking[0]:
        fields["answered"] = answered
    if len(ranking) > 1:
        fields["runner_up"] = ranking[1]
        fields["runner_up_matched"] = overlap.get(ranking[1], 0)
        fields["runner_up_score"] = _score(scores, 1)
    return fields


def receipt_header(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def _score(scores: tuple[float, ...], i: int) -> float | None:
    return round(scores[i], 3) if i < len(scores) else None
