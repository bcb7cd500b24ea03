"""The last exchanges' route receipts, by request id: what the console's request lookup reads.

A bounded map (oldest out first) filled by an exchange observer when an exchange ends: a dict
insert per request, whoever looks. It holds the receipt (gateway.request.receipt), the tenant's
name, the model, the token counts and the timings: never a prompt or an answer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from gateway.request.receipt import receipt_fields
from gateway.request.state import ExchangeRecord
from gateway.request.usage import EngineUsage

DEFAULT_RECENT_REQUESTS = 10_000
"""About 5 MB at ~500 bytes an entry: the last minute or two of a busy gateway."""


class RecentRoutes:
    """request id (the gateway's `x-request-id`, or a non-streamed answer's `id`) -> receipt."""

    def __init__(self, capacity: int = DEFAULT_RECENT_REQUESTS) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._entries: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> dict[str, Any] | None:
        return self._entries.get(request_id)

    def latest(self, n: int) -> list[dict[str, Any]]:
        """The last `n` distinct exchanges, newest first."""
        seen: list[dict[str, Any]] = []
        for entry in reversed(self._entries.values()):
            if not seen or entry is not seen[-1]:
                seen.append(entry)
            if len(seen) == n:
                break
        return seen

    async def on_first_token(self, record: ExchangeRecord) -> None:
        return None

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        return None

    async def on_finish(self, record: ExchangeRecord) -> None:
        routed, usage = record.routed, record.usage
        scores = routed.decision.scores
        entry: dict[str, Any] = {
            "request_id": record.request_id,
            "at": time.time(),
            "tenant": routed.tenant.name,
            "model": routed.parsed.model,
            "stream": routed.parsed.stream,
            "complete": record.ok,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "ttft_ms": (
                round((record.first_token_s - routed.opened_s) * 1e3, 1)
                if record.first_token_s
                else None
            ),
            "candidates": [
                {
                    "replica": r,
                    "matched": routed.route.overlap.get(r, 0),
                    "score": round(scores[i], 3) if i < len(scores) else None,
                }
                for i, r in enumerate(routed.decision.ranking)
            ],
            **receipt_fields(routed, record.replica),
        }
        self._put(record.request_id, entry)
        body_id = record.body.get("id") if record.body else None
        if isinstance(body_id, str):
            entry["response_id"] = body_id
            self._put(body_id, entry)

    def _put(self, key: str, entry: dict[str, Any]) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
