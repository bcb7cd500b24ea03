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
    priority: int | None = None
    """The request's `priority` (vLLM's field; lower is served first), read and stripped by the
    front end: flow control's band (gateway.pipeline.flow), never forwarded. None: the tenant's."""
    raw: bytes | None = None
    """The client's JSON that `body` was parsed from, when `body` is exactly it (the OpenAI
    front end): the engine's body is then these bytes with the gateway's fields spliced in,
    not `body` serialized again (`gateway.pipeline.payload`). None: a front end that built
    `body` itself (Anthropic, gRPC)."""
