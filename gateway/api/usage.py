"""The usage's cache fields in Anthropic's names — what `/v1/messages` and gRPC report — from
the usage object an exchange ended with.

With billing on, the meter has already rewritten that object with the bill (the tenant's
profile applied; `kvgate_billing` marks it), so every front end reports what the WAL records:
the read, written and uncached tokens and the cost. Without billing, the provisional split of
the engine's physical hit (`gateway.request.cache_control.provisional_cache_usage`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.request.cache_control import provisional_cache_usage
from gateway.request.parsed import ParsedRequest


def cache_usage(parsed: ParsedRequest, engine_usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage fields. With billing on, the meter has already put the contract's
    numbers into the usage (`kvgate_billing` marks it): Anthropic's own fields under the
    anthropic profile, or, under another profile, its read and written tokens, which map onto
    them. Without billing, the provisional split from the engine's physical usage."""
    usage = engine_usage or {}
    if "kvgate_billing" not in usage:
        return provisional_cache_usage(
            usage, parsed.breakpoints, len(parsed.rendered), prewarm=parsed.prewarm
        )
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, Mapping) else {}
    if "cache_read_input_tokens" in usage:
        read = int(usage["cache_read_input_tokens"])
        written = int(usage.get("cache_creation_input_tokens") or 0)
        creation = dict(usage.get("cache_creation") or {})
        uncached = int(usage.get("input_tokens") or 0)
    else:
        read = int(details.get("cached_tokens") or 0)
        written = int(details.get("cache_write_tokens") or 0)
        creation = {"ephemeral_5m_input_tokens": written, "ephemeral_1h_input_tokens": 0}
        uncached = int(usage.get("prompt_tokens") or 0) - read - written
    out: dict[str, Any] = {
        "input_tokens": uncached,
        "output_tokens": 0 if parsed.prewarm else int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "cache_creation": creation,
        "engine_cached_tokens": int(usage.get("engine_cached_tokens") or 0),
    }
    for extension in ("cost", "kvgate_billing"):
        if extension in usage:
            out[extension] = usage[extension]
    return out
