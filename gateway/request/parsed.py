"""The request every front end reduces to: an OpenAI-shaped body, its canonical rendering, and
the cache hints a front end found (breakpoints, a pre-warm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.request.cache_control import Breakpoint

CHAT = "chat"
COMPLETION = "completion"


@dataclass(slots=True)
class ParsedRequest:
    kind: str
    model: str
    body: dict[str, Any]
    rendered: bytes
    stream: bool
    include_usage: bool
    # -- cache hints (the Anthropic and gRPC front ends; billing reads them) --
    breakpoints: tuple[Breakpoint, ...] = ()
    """`cache_control` breakpoints: byte offsets in `rendered`, sorted, with their TTLs."""
    prewarm: bool = False
    """`max_tokens: 0`: read and refresh the cache, generate nothing (one token is generated
    upstream, since engines need max_tokens >= 1, and discarded)."""
