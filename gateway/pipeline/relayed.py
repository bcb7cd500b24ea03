"""A request whose bytes someone else carries: the endpoint-picker side of the pipeline.

Behind Envoy (ext-proc, `gateway.api.epp`) kvgate decides and Envoy forwards. The pipeline runs
the same steps as for the standalone gateway — admit, route (fan-out holds, hot prefixes, the
policy), record — but step 3 is Envoy's: `Director.pick` stops after routing and hands back a
`Pick`, and the response arrives as events (headers, body chunks, end) that feed a
`RelayedExchange`, which calls the same `Recorder` hooks the standalone exchange calls.

    Director.pick ──▶ Pick ──served(replica)──▶ RelayedExchange ──first_token──▶ usage ──▶ end
                        │                                         (lands the fan-out flight)
                        └──abandon()── the engine refused, Envoy failed, the client left

Invariants (each once, whatever the path): the lease taken at the pick is released; the fan-out
flight of a leader is ended (ok at its first token, failed otherwise); the trace ends (`failed`,
`passthrough` or, through the recorder, `finished`). An engine's error status makes no exchange,
as a passthrough makes none in the standalone gateway: nothing is recorded and nothing billed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.fleet.replicas import Lease, ReplicaSet
from gateway.pipeline.exchange import Exchange, ExchangeHooks
from gateway.request.state import Routed
from gateway.request.trace import AttemptTrace, RequestTrace

LandFlight = Callable[[bool, str], None]
"""Ends a leader's fan-out flight: (landed, the replica that wrote the prefix)."""


class RelayedExchange(Exchange):
    """An exchange whose stream Envoy relays; its events come from the ext-proc conversation.

    `first_token` once (the prompt's KV is on the replica: record, observers, siblings
    released), `usage` at most once, `end` once (lease released, observers' finish)."""

    def __init__(
        self,
        hooks: ExchangeHooks,
        routed: Routed,
        lease: Lease,
        trace: RequestTrace,
        land: LandFlight | None,
    ) -> None:
        super().__init__(hooks, routed, lease, trace)
        self._land = land
        self.started = False

    def _maybe_land(self, ok: bool) -> None:
        land, self._land = self._land, None
        if land is not None:
            land(ok, self.record.replica)

    async def first_token(self) -> None:
        if self.started:
            return
        self.started = True
        self.lease.prefilled(first_byte=True)
        self._maybe_land(True)
        await self.hooks.first_token(self)

    async def relay_usage(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The engine's usage through the hooks (billing may rewrite it): what the client gets."""
        if self.record.usage is not None:  # a second usage object is passed on as it came
            return fields
        await self.first_token()
        return (await self.hooks.usage(self, fields)).fields

    async def end(self, ok: bool) -> None:
        if self.closed:
            return
        if not ok:
            self.record.ok = False
        self._maybe_land(ok and self.started)
        await self.finish()


class Pick:
    """The routing decision for a request Envoy forwards: its ranking, the body the engine must
    get, and what must be released once, whichever way the request ends."""

    def __init__(
        self,
        routed: Routed,
        payload: bytes,
        trace: RequestTrace,
        attempt: AttemptTrace,
        lease: Lease,
        replicas: ReplicaSet,
        recorder: ExchangeHooks,
        ranking: list[str],
        land: LandFlight | None,
        *,
        headers: dict[str, str] | None = None,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.routed = routed
        self.payload = payload
        """The upstream body: the tenant's `cache_salt`, usage asked for when it is relayed."""
        self.trace = trace
        self.attempt = attempt
        self.ranking = ranking
        """Replica ids, best first: Envoy tries them in order (its retries)."""
        self.headers = headers or {}
        """What the engine's request gets set, as the standalone gateway sets it on its
        first attempt: the trace context and, when the first pick's prefix is on one of its DP
        ranks, `X-data-parallel-rank` (Envoy sends the same headers down its retry list)."""
        self._lease: Lease | None = lease
        self._replicas = replicas
        self._recorder = recorder
        self._land = land
        self._on_closed = on_closed
        """Called once the request is off the pipeline (the director's count of active ones)."""

    @property
    def replica(self) -> str:
        return self.ranking[0]

    def served(self, replica_id: str | None) -> RelayedExchange:
        """The engine answered (a 2xx); `replica_id` is the one Envoy reports it sent the request
        to (None: not reported, so the first pick). The lease follows the request there."""
        lease = self._lease
        assert lease is not None, "served() or abandon() already ran"
        self._lease = None
        if replica_id is not None and replica_id != lease.state.id:
            lease.release()
            uncached = self.routed.route.uncached_tokens(replica_id)
            lease = self._replicas.get(replica_id).lease(uncached, lease.output_tokens)
        land, self._land = self._land, None
        exchange = RelayedExchange(self._recorder, self.routed, lease, self.trace, land)
        exchange.on_closed, self._on_closed = self._on_closed, None
        return exchange

    def abandon(self, exc: BaseException | None = None, status: int | None = None) -> None:
        """No exchange: the engine answered an error `status`, or `exc` ended the request (Envoy
        or the client went away before the response)."""
        lease, self._lease = self._lease, None
        if lease is None:
            return
        lease.release()
        if self._on_closed is not None:
            self._on_closed()
            self._on_closed = None
        land, self._land = self._land, None
        if land is not None:
            land(False, lease.state.id)
        if status is not None:
            self.trace.passthrough(status)
        elif exc is not None:
            self.attempt.failed(exc)
            self.trace.failed(exc)

    @property
    def open(self) -> bool:
        return self._lease is not None
