"""One request's state as the stages after routing see it, and the observer protocol.

    ParsedRequest ──admit──▶ (scoped Tenant) ──route──▶ Routed ──forward──▶ ExchangeRecord
                                                        fixed from here    filled in by the
                                                                           exchange, read by
                                                                           the observers

`Routed` is immutable: whatever a stage needs later is in it when routing ends. An
`ExchangeRecord` is what is known of one exchange (a request committed to one replica); the
exchange alone writes it — the first token's instant, the usage, the outcome — and observers
(rate-limit settlement, reconciliation, billing, metrics) only read it, in that order.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from cachemap.directory import Held
from cachemap.keys import BlockHash
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from gateway.request.usage import EngineUsage
from router.types import Decision, RouteRequest

RequestHook = Callable[[ParsedRequest, Tenant], Awaitable[ParsedRequest]]
"""Runs after admission, before routing: may validate (raise a GatewayError) or return a
replacement request (billing expands explicit cached contents and strips billing-only fields)."""
RoutedHook = Callable[["Routed"], None]
"""Runs when routing ends, after any fan-out hold, before the first attempt: the request's
start as billing counts it (a held request starts at its release)."""
LandedHook = Callable[["Routed"], Awaitable[None]]
"""Runs when a fan-out leader's replica reports its prefix stored (KV events, precise mode),
before its first token and before its siblings are released: billing makes the leader's
entries visible then, so the siblings read them."""
AbandonedHook = Callable[["Routed"], None]
"""Runs when a fan-out leader ends without a first token (its landed hooks may have run)."""


REQUEST_ID_BATCH = 256
"""Request ids drawn from the OS's random source at once (`new_request_id`)."""
_request_ids: list[str] = []


def new_request_id() -> str:
    """A request id: "req_" and 24 hex digits (96 bits) from the OS's random source, as
    `secrets.token_hex` draws them, but `REQUEST_ID_BATCH` ids a `getrandom` call: a call a
    request was ~1% of a small request's CPU (py-spy, native; strace: one getrandom an
    exchange). A forked child forgets the parent's unused ids (`os.register_at_fork`), so no
    two processes share one."""
    if not _request_ids:
        raw = os.urandom(12 * REQUEST_ID_BATCH).hex()
        _request_ids.extend("req_" + raw[i : i + 24] for i in range(0, len(raw), 24))
    return _request_ids.pop()


os.register_at_fork(after_in_child=_request_ids.clear)


@dataclass(frozen=True, slots=True)
class Routed:
    """A request after admission and routing."""

    parsed: ParsedRequest
    tenant: Tenant
    """As this request sees it: in a `user` scope, its end user's salt."""
    hashes: Sequence[BlockHash]
    route: RouteRequest
    decision: Decision
    last_use: Mapping[str, float]
    """replica -> last use of the deepest matched block (what reconciliation may expire)."""
    opened_s: float
    """When the pipeline took the request (monotonic): TTFT as the client sees it."""
    routed_s: float
    """When routing ended (monotonic; after any fan-out hold, so a held sibling's clock starts
    at its release)."""
    queued_s: float = 0.0
    """Time it waited in flow control's queue for room in the fleet (part of routed - opened)."""
    flow_charge: tuple[int, float] | None = None
    """Flow control's charge to its scope: (band, estimated weighted tokens), settled with the
    engine's usage (gateway.pipeline.flow); None: not charged."""
    admitted_tokens: int = 0
    """Tokens charged to the tenant's tokens/min budget at admission; usage settles the rest."""
    ranks: Mapping[str, int] = field(default_factory=dict)
    """replica -> the data-parallel rank holding the request's prefix (precise mode, engines
    whose ranks share one port): sent as `X-data-parallel-rank`."""
    conversation: int | None = None
    """The conversation precise mode's frontiers placed it in (`gateway.pipeline.frontier`),
    told when its exchange ends; None without them."""
    unpredicted: frozenset[str] = frozenset()
    """Replicas whose prediction is neither read nor written: their KV events route them
    (precise mode, in-process index; `gateway.pipeline.keying`)."""
    held: Mapping[str, Held] = field(default_factory=dict)
    """replica -> what the shared directory held of it from the first block at the lookup
    (`gateway.directory.routing.Lookup.held`): its record leaves the fresh part as it is."""


@dataclass(slots=True, eq=False)
class ExchangeRecord:
    """What is known of one exchange; written by the exchange only (see the module docstring)."""

    routed: Routed
    replica: str
    body: dict[str, Any] | None = None
    """The whole answer of a non-streamed exchange."""
    first_token_s: float | None = None
    usage: EngineUsage | None = None
    ok: bool = True
    """False when the stream broke or the client left."""
    cached_on: str | None = None
    """The replica whose prefix cache the usage's `cached_tokens` describe when it is not
    `replica`: in a P/D exchange, the prefill instance's (`gateway.pipeline.disagg`)."""
    request_id: str = field(default_factory=new_request_id)
    """The gateway's id of the exchange: the answer's `x-request-id`, the access log's
    `request_id`, what the console looks a request up by."""

    @property
    def parsed(self) -> ParsedRequest:
        return self.routed.parsed

    @property
    def tenant(self) -> Tenant:
        return self.routed.tenant


_HookT = TypeVar("_HookT", bound=Callable[..., Awaitable[None]])


def idle_hook(method: _HookT) -> _HookT:
    """Marks an observer's hook that does nothing: the recorder does not await it (a
    coroutine made and awaited for nothing, ten an exchange with the default observers)."""
    method.__dict__["idle_hook"] = True
    return method


def is_idle_hook(method: Callable[..., Any]) -> bool:
    return getattr(method, "idle_hook", False) is True


class ExchangeObserver(Protocol):
    """Hooks around a committed exchange, each awaited on the request's path.

    - `on_first_token`: the engine has written the prompt's KV (placement is known).
    - `on_usage`: the engine's usage, before the client sees it; may rewrite `usage.fields` in
      place (a billing profile's usage fields), and a durable write here happens before the
      response completes.
    - `on_finish`: once, when the exchange ends (`record.ok` says how).
    """

    async def on_first_token(self, record: ExchangeRecord) -> None: ...

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None: ...

    async def on_finish(self, record: ExchangeRecord) -> None: ...
