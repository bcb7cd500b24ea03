"""The what-if workload format of `kvgate billing simulate`: one JSON object per line.

A request:
    {"t": 240, "tenant": "acme",
     "segments": [{"id": "system", "tokens": 10000, "cache_control": {"ttl": "5m"}},
                  {"id": "turn-1", "tokens": 500, "role": "user"}],
     "output_tokens": 100, "max_tokens": 100,
     "first_token_s": 1.5, "stored_s": 0.6, "mode": "explicit", "cached_content": "doc",
     "cache_control": {}}

An explicit cached-content operation:
    {"t": 0, "tenant": "acme", "op": "cache.create", "id": "doc", "segments": [...], "ttl_s": 7200}
    {"t": 5400, "tenant": "acme", "op": "cache.delete", "id": "doc"}
    {"t": 3600, "tenant": "acme", "op": "cache.update", "id": "doc", "ttl_s": 7200}

`t` is seconds after `--start` (default the Unix epoch, so `t` may be absolute). Two requests
whose segment-id sequences share a prefix share that content exactly. Optional: `cache_control`
(on a segment: a breakpoint; at the top level: Anthropic's automatic breakpoint on the last
segment), `max_tokens` (0 is Anthropic's ping), `first_token_s` (default 0), `stored_s` (when
the gateway indexed the engine's BlockStored of the prompt, precise mode with KV events: its
entries are visible from the earlier of the two; docs/billing.md#common-model), `mode`, `role`
on a segment ("user"/"tool" segments carry OpenAI's implicit breakpoint; without any role, the
last segment does), `cached_content`. Decimal values are parsed exactly (never through a float).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import mmh3

from gateway.billing.pricing.money import dec

MAX_T = Decimal(253_402_300_800)
"""9999-12-31T23:59:59Z + 1 s: instants must print as ISO-8601."""
OPS = ("cache.create", "cache.update", "cache.delete")
_IMPLICIT_ROLES = frozenset({"user", "tool", "function"})
_REQUEST_FIELDS = frozenset(
    {
        "t",
        "tenant",
        "segments",
        "output_tokens",
        "max_tokens",
        "first_token_s",
        "stored_s",
        "mode",
        "cached_content",
        "cache_control",
    }
)
_OP_FIELDS = frozenset({"t", "tenant", "op", "id", "segments", "ttl_s", "expire_time"})


class EventError(ValueError):
    """A malformed line; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class Segment:
    id: str
    tokens: int
    ttl: str | None = None
    """None: no cache mark; "": a mark without a TTL; else the TTL named."""
    role: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    line: int
    t: Decimal
    tenant: str
    op: str = "request"
    segments: tuple[Segment, ...] = ()
    output_tokens: int = 0
    max_tokens: int | None = None
    first_token_s: Decimal = Decimal(0)
    stored_s: Decimal | None = None
    """The engine's BlockStored of the prompt, indexed (KV events on); None: events off."""
    explicit_mode: bool = False
    cached_content: str | None = None
    auto_ttl: str | None = None
    object_id: str | None = None
    ttl_s: Decimal | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def visible_after(event: Event) -> Decimal:
    """Seconds from the request's start until its entries are visible: its first token, or its
    BlockStored indexed, whichever came first (docs/billing.md#common-model)."""
    if event.stored_s is None:
        return event.first_token_s
    return min(event.first_token_s, event.stored_s)


def chain_keys(ids: Iterable[str], root: bytes = b"kvgate-billing/v1") -> list[bytes]:
    """key_i = H(key_{i-1} ‖ 0x00 ‖ id_i): equal keys ⇔ equal id sequences (128-bit mmh3)."""
    keys: list[bytes] = []
    parent = root
    for segment_id in ids:
        parent = mmh3.mmh3_x64_128_digest(parent + b"\x00" + segment_id.encode())
        keys.append(parent)
    return keys


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EventError(f"{where} must be an integer ≥ {minimum}, got {value!r}")
    return value


def _decimal(value: Any, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | Decimal | str):
        raise EventError(f"{where} must be a number, got {value!r}")
    try:
        return dec(value)
    except ValueError as exc:
        raise EventError(f"{where}: {exc}") from None


def _ttl(mark: Any, where: str) -> str:
    if not isinstance(mark, dict):
        raise EventError(f'{where} must be an object such as {{"ttl": "5m"}}')
    ttl = mark.get("ttl", "")
    if not isinstance(ttl, str):
        raise EventError(f'{where}.ttl must be a string such as "5m" or "1h"')
    return ttl


def _segments(raw: Any, where: str) -> tuple[Segment, ...]:
    if not isinstance(raw, list):
        raise EventError(f"{where}: segments must be a list of {{id, tokens}} objects")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}: segments[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise EventError(f"{at} must be an object with a string 'id'")
        ttl = (
            _ttl(item["cache_control"], f"{at}.cache_control") if "cache_control" in item else None
        )
        role = item.get("role")
        if role is not None and not isinstance(role, str):
            raise EventError(f"{at}.role must be a string")
        out.append(Segment(item["id"], _int(item.get("tokens"), f"{at}.tokens"), ttl, role))
    return tuple(out)


def parse_event(text: str, line: int) -> Event | None:
    """One line → an Event (None for a blank line or a `#` comment)."""
    stripped = text.strip()
    if not stripped or stripped.startswith("#"):
        return None
    where = f"line {line}"
    try:
        raw = json.loads(stripped, parse_float=Decimal)
    except json.JSONDecodeError as exc:
        raise EventError(f"{where}: malformed JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise EventError(f"{where}: each line must be a JSON object")
    t = _decimal(raw.get("t"), f"{where}: t")
    if not 0 <= t < MAX_T:
        raise EventError(f"{where}: t must be ≥ 0 and before the year 10000 (unix seconds)")
    tenant = raw.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise EventError(f"{where}: tenant must be a non-empty string")
    op = raw.get("op")
    if op is not None:
        return _op_event(raw, line, where, t, tenant, op)
    unknown = set(raw) - _REQUEST_FIELDS
    if unknown:
        raise EventError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; valid: "
            f"{', '.join(sorted(_REQUEST_FIELDS))}"
        )
    segments = _segments(raw.get("segments"), where)
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None:
        max_tokens = _int(max_tokens, f"{where}: max_tokens")
    output = _int(raw.get("output_tokens", 0), f"{where}: output_tokens")
    if max_tokens is not None and output > max_tokens:
        raise EventError(f"{where}: output_tokens {output} exceeds max_tokens {max_tokens}")
    mode = raw.get("mode", "implicit")
    if mode not in ("implicit", "explicit"):
        raise EventError(f"{where}: mode must be 'implicit' or 'explicit', got {mode!r}")
    first = _decimal(raw.get("first_token_s", 0), f"{where}: first_token_s")
    if first < 0 or t + first >= MAX_T:
        raise EventError(f"{where}: first_token_s must not be negative")
    stored = raw.get("stored_s")
    if stored is not None:
        stored = _decimal(stored, f"{where}: stored_s")
        if stored < 0 or t + stored >= MAX_T:
            raise EventError(f"{where}: stored_s must not be negative")
    cached = raw.get("cached_content")
    if cached is not None and not isinstance(cached, str):
        raise EventError(f"{where}: cached_content must be a string id")
    auto = _ttl(raw["cache_control"], f"{where}: cache_control") if "cache_control" in raw else None
    return Event(
        line,
        t,
        tenant,
        segments=segments,
        output_tokens=output,
        max_tokens=max_tokens,
        first_token_s=first,
        stored_s=stored,
        explicit_mode=mode == "explicit",
        cached_content=cached,
        auto_ttl=auto,
    )


def _op_event(
    raw: dict[str, Any], line: int, where: str, t: Decimal, tenant: str, op: Any
) -> Event:
    """An explicit-cache operation's line (cache.create / cache.update / cache.delete)."""
    if op not in OPS:
        raise EventError(f"{where}: op {op!r}; valid: {', '.join(OPS)}")
    unknown = set(raw) - _OP_FIELDS
    if unknown:
        raise EventError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for an op")
    object_id = raw.get("id")
    if not isinstance(object_id, str) or not object_id:
        raise EventError(f"{where}: {op} needs a string 'id'")
    ttl_s = _decimal(raw["ttl_s"], f"{where}: ttl_s") if "ttl_s" in raw else None
    if ttl_s is not None and ttl_s <= 0:
        raise EventError(f"{where}: ttl_s must be positive")
    segments = _segments(raw.get("segments", []), where) if op == "cache.create" else ()
    if op == "cache.create" and not segments:
        raise EventError(f"{where}: cache.create needs segments")
    if op == "cache.update" and ttl_s is None:
        raise EventError(f"{where}: cache.update needs ttl_s")
    return Event(line, t, tenant, op, segments, object_id=object_id, ttl_s=ttl_s)


def parse_events(lines: Iterable[str]) -> list[Event]:
    """Every line parsed, then ordered by start (stable: equal starts keep file order)."""
    events = [e for i, text in enumerate(lines, 1) if (e := parse_event(text, i)) is not None]
    events.sort(key=lambda e: e.t)
    return events


def implicit_flags(segments: tuple[Segment, ...]) -> list[bool]:
    """Which segments may carry OpenAI's implicit breakpoint: user/tool ones when roles are
    given, else every segment (the latest eligible one is the last)."""
    if not any(s.role for s in segments):
        return [True] * len(segments)
    return [s.role in _IMPLICIT_ROLES for s in segments]
