"""The last exchanges' route receipts, by request id: what the console's request lookup reads.

A bounded map (oldest out first) filled by an exchange observer when an exchange ends: a dict
insert per request, whoever looks. It holds the receipt (gateway.request.receipt), the tenant's
name, the model, the token counts and the timings: never a prompt or an answer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from gateway.request.receipt import decision_fields
from gateway.request.state import ExchangeRecord, idle_hook
from gateway.request.usage import EngineUsage
from router.types import Decision

DEFAULT_RECENT_REQUESTS = 10_000
"""About 5 MB at ~500 bytes an entry: the last minute or two of a busy gateway."""


class _Seen:
    """What an exchange leaves behind for the map: the few values its entry is made of, the
    dict built only when someone reads it (`RecentRoutes.get`, `latest`). Building it per
    exchange (a dict, the candidates' list, the receipt) was ~3% of a small request's CPU,
    for a console read a few times a minute (py-spy, native). Plain values only: one object
    the cyclic GC tracks an entry (the routing's decision, overlap and usage kept as objects
    were five, which the collector walked at every full pass). Holds no prompt or answer."""

    __slots__ = (
        "at",
        "cached_tokens",
        "complete",
        "first_token_s",
        "matched",
        "matched_blocks",
        "model",
        "num_blocks",
        "opened_s",
        "policy",
        "prompt_tokens",
        "ranking",
        "reason",
        "replica",
        "request_id",
        "response_id",
        "scores",
        "stream",
        "tenant",
    )

    def __init__(self, record: ExchangeRecord) -> None:
        routed, usage = record.routed, record.usage
        decision, overlap = routed.decision, routed.route.overlap
        self.request_id = record.request_id
        self.at = time.time()
        self.tenant = routed.tenant.name
        self.model = routed.parsed.model
        self.stream = routed.parsed.stream
        self.complete = record.ok
        self.prompt_tokens = usage.prompt_tokens if usage else None
        self.cached_tokens = usage.cached_tokens if usage else None
        self.first_token_s = record.first_token_s
        self.opened_s = routed.opened_s
        self.ranking = decision.ranking
        self.scores = decision.scores
        self.reason = decision.reason
        self.policy = decision.policy
        self.matched_blocks = decision.matched_blocks
        self.matched = tuple([overlap.get(r, 0) for r in decision.ranking])
        self.num_blocks = routed.route.num_blocks
        self.replica = record.replica
        self.response_id: str | None = None

    def entry(self) -> dict[str, Any]:
        scores = self.scores
        decision = Decision(self.ranking, self.reason, self.matched_blocks, scores, self.policy)
        overlap = dict(zip(self.ranking, self.matched, strict=True))
        entry: dict[str, Any] = {
            "request_id": self.request_id,
            "at": self.at,
            "tenant": self.tenant,
            "model": self.model,
            "stream": self.stream,
            "complete": self.complete,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": (
                round((self.first_token_s - self.opened_s) * 1e3, 1) if self.first_token_s else None
            ),
            "candidates": [
                {
                    "replica": r,
                    "matched": overlap.get(r, 0),
                    "score": round(scores[i], 3) if i < len(scores) else None,
                }
                for i, r in enumerate(self.ranking)
            ],
            **decision_fields(decision, overlap, self.num_blocks, self.replica),
        }
        if self.response_id is not None:
            entry["response_id"] = self.response_id
        return entry


class RecentRoutes:
    """request id (the gateway's `x-request-id`, or a non-streamed answer's `id`) -> receipt."""

    def __init__(self, capacity: int = DEFAULT_RECENT_REQUESTS) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._entries: OrderedDict[str, _Seen] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> dict[str, Any] | None:
        seen = self._entries.get(request_id)
        return seen.entry() if seen is not None else None

    def latest(self, n: int) -> list[dict[str, Any]]:
        """The last `n` distinct exchanges, newest first."""
        seen: list[_Seen] = []
        for entry in reversed(self._entries.values()):
            if not seen or entry is not seen[-1]:
                seen.append(entry)
            if len(seen) == n:
                break
        return [s.entry() for s in seen]

    @idle_hook
    async def on_first_token(self, record: ExchangeRecord) -> None:
        return None

    @idle_hook
    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        return None

    async def on_finish(self, record: ExchangeRecord) -> None:
        seen = _Seen(record)
        self._put(record.request_id, seen)
        body_id = record.body.get("id") if record.body else None
        if isinstance(body_id, str):
            seen.response_id = body_id
            self._put(body_id, seen)

    def _put(self, key: str, entry: _Seen) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
