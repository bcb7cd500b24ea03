"""The director: serve one request, admit → route → forward → record (GIE `Director`)."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from cachemap.keys import affinity_key, chain_hashes, root_hash
from gateway.directory.routing import RoutingDirectory
from gateway.errors import ModelNotFound, NoReplica, UpstreamError
from gateway.fleet.replicas import ReplicaSet, ReplicaState
from gateway.observability.histograms import LOOKUP_BUCKETS_S, LabelledHistograms
from gateway.pipeline.admission import Admission
from gateway.pipeline.exchange import Exchange, ExchangeHooks
from gateway.pipeline.flights import Flight
from gateway.pipeline.forwarder import Complete, Forwarder, Passthrough, RetryableFailure
from gateway.pipeline.placement import Placement
from gateway.request.cache_control import strip_marks
from gateway.request.parsed import CHAT, COMPLETION, ParsedRequest
from gateway.request.state import RequestHook, Routed
from gateway.request.tenant import Tenant
from gateway.request.tokens import TokenEstimator
from gateway.request.trace import NoTracer, RequestTrace, Tracer
from router.profile import RoutingProfile
from router.types import RouteRequest

log = logging.getLogger(__name__)

_PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}


@dataclass
class DirectorStats:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    retries: int = 0
    lookup_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LOOKUP_BUCKETS_S)
    )
    """Directory lookups as the request path waits for them, by source (shared | local)."""


@dataclass(frozen=True)
class RouteKeys:
    """How a request's rendering becomes the directory's keys and the router's units."""

    block_bytes: int
    consistent_hash_blocks: int


class Director:
    def __init__(
        self,
        *,
        keys: RouteKeys,
        admission: Admission,
        directory: RoutingDirectory,
        replicas: ReplicaSet,
        placement: Placement,
        policy: RoutingProfile,
        fallback_policy: RoutingProfile,
        forwarder: Forwarder,
        recorder: ExchangeHooks,
        estimator: TokenEstimator,
        max_attempts: int,
        request_hooks: Sequence[RequestHook] = (),
        tracer: Tracer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.keys = keys
        self.admission = admission
        self.directory = directory
        self.replicas = replicas
        self.placement = placement
        self.policy = policy
        self.fallback_policy = fallback_policy
        self.forwarder = forwarder
        self.recorder = recorder
        self.estimator = estimator
        self.max_attempts = max_attempts
        self.request_hooks = list(request_hooks)
        self.tracer: Tracer = tracer or NoTracer()
        self.rng = rng or random.Random()
        self.stats = DirectorStats()
        self._sequence = itertools.count()

    async def open(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        trace_headers: dict[str, str] | None = None,
    ) -> Exchange | Passthrough:
        """Serve one request up to its commitment: an exchange whose first byte has arrived, or
        an engine's 4xx to pass through. `trace_headers`: the client's W3C trace context.

        1. Admit: the tenant's scope, model and size, then the fleet (404, 503), then the rate
           limit; the request hooks (billing's start) see the scoped tenant.
        2. Route: hash the canonical rendering in the tenant's scope, look up each replica's
           cached prefix, place it (fan-out holds, hot prefixes, the policy's ranking).
        3. Forward: try the ranking in order until an attempt commits.
        4. Record: the exchange's hooks (`gateway.pipeline.record`): after the first token the
           prompt's blocks are on the replica that answered; the usage passes the observers.
        """
        opened_s = time.monotonic()
        trace = self.tracer.begin(parsed, tenant, trace_headers)
        try:
            candidates, tenant, charged = await self._admit(parsed, tenant)
            for hook in self.request_hooks:
                parsed = await hook(parsed, tenant)
            routed, flight = await self._route(parsed, tenant, candidates, trace, opened_s, charged)
            if flight is None:
                return await self._forward(routed, trace)
            return await self._lead(flight, routed, trace)
        except BaseException as exc:
            trace.failed(exc)
            raise

    # -- 1. admit --------------------------------------------------------------------------
    async def _admit(
        self, parsed: ParsedRequest, tenant: Tenant
    ) -> tuple[list[ReplicaState], Tenant, int]:
        """The replicas that may serve the request, the tenant as this request sees it (its
        end user's salt in a `user` scope) and the tokens charged to its rate limit.
        Order: the tenant's scope, model and size (gateway.pipeline.admission), then the fleet
        (404, 503), then the rate limit, so a request that cannot be served spends no budget."""
        prompt_tokens = self.estimator.prompt_tokens(parsed)
        tenant = self.admission.check(parsed, tenant, prompt_tokens)
        candidates = self.replicas.serving(parsed.model)
        if not candidates:
            if not self.replicas.any_healthy():
                raise NoReplica("no healthy engine replica is available")
            raise ModelNotFound(parsed.model, self.replicas.models())
        charged = await self.admission.acquire(parsed, tenant, prompt_tokens)
        return candidates, tenant, charged

    # -- 2. route --------------------------------------------------------------------------
    async def _route(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        candidates: list[ReplicaState],
        trace: RequestTrace,
        opened_s: float,
        charged: int,
    ) -> tuple[Routed, Flight | None]:
        block_bytes = self.keys.block_bytes
        root = root_hash(tenant.salt, parsed.model)
        hashes = chain_hashes(parsed.rendered, root, block_bytes)
        started_ns, started = time.time_ns(), time.perf_counter_ns()
        lookup = await self.directory.lookup(hashes)
        elapsed_ns = time.perf_counter_ns() - started
        source = "shared" if self.directory.shared is not None and not lookup.degraded else "local"
        self.stats.lookup_seconds.labels(source).observe(elapsed_ns / 1e9)
        trace.looked_up(
            started_ns,
            started_ns + elapsed_ns,
            len(hashes),
            "local" if lookup.degraded else "shared",
            max(lookup.overlap.values(), default=0),
        )
        bytes_per_token = self.estimator.bytes_per_token(parsed.model)
        route = RouteRequest(
            num_blocks=len(hashes),
            num_prompt_tokens=len(parsed.rendered) / bytes_per_token,
            overlap=lookup.overlap,
            tokens_per_block=block_bytes / bytes_per_token,
            affinity_key=affinity_key(
                parsed.rendered, root, hashes, self.keys.consistent_hash_blocks, block_bytes
            ),
            sequence=next(self._sequence),
        )
        policy = self.fallback_policy if lookup.degraded else self.policy
        snapshot = [c.snapshot() for c in candidates]
        placed = await self.placement.place(policy, route, snapshot, hashes, lookup, self.rng)
        if placed is None:
            raise NoReplica(f"no healthy replica serves model '{parsed.model}'")
        if placed.new_k is not None and lookup.hot_key is not None:
            self.directory.set_k(lookup.hot_key, placed.new_k)
        decision = placed.decision
        counter_key = (policy.name, decision.reason)
        self.stats.decisions[counter_key] = self.stats.decisions.get(counter_key, 0) + 1
        trace.decided(policy.name, decision, len(hashes))
        routed = Routed(
            parsed,
            tenant,
            hashes,
            placed.route,
            decision,
            lookup.last_use,
            opened_s=opened_s,
            routed_s=time.monotonic(),
            admitted_tokens=charged,
        )
        return routed, placed.flight

    # -- 3. forward ------------------------------------------------------------------------
    async def _lead(
        self, flight: Flight, routed: Routed, trace: RequestTrace
    ) -> Exchange | Passthrough:
        """Forward a fan-out leader: its siblings are released when its first byte is in (the
        engine has prefilled, the KV is written) or it fails."""
        flights = self.placement.flights
        assert flights is not None
        landed = False
        try:
            opened = await self._forward(routed, trace)
            if isinstance(opened, Exchange):
                landed = True
                flight.replica = opened.record.replica  # a retry may have moved it
            return opened
        finally:
            flights.end(flight, ok=landed)

    def _upstream_payload(self, routed: Routed) -> bytes:
        parsed = routed.parsed
        body = dict(parsed.body)
        if parsed.breakpoints or parsed.prewarm:  # a front end that keeps cache hints in the body
            body = strip_marks(body)
            body["max_tokens"] = max(body.get("max_tokens") or 1, 1)
        body["cache_salt"] = routed.tenant.cache_salt
        if parsed.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    async def _forward(self, routed: Routed, trace: RequestTrace) -> Exchange | Passthrough:
        """Walk the ranking until an attempt commits; a retryable failure moves on (a
        connection failure also marks the replica down)."""
        parsed = routed.parsed
        payload = self._upstream_payload(routed)
        path = _PATHS[parsed.kind]
        failures: list[str] = []
        for attempt, replica_id in enumerate(routed.decision.ranking[: self.max_attempts]):
            state = self.replicas.get(replica_id)
            uncached = routed.route.uncached_tokens(replica_id)
            upstream = trace.attempt(replica_id, attempt + 1, uncached)
            with state.lease(uncached) as lease:
                try:
                    outcome = await self.forwarder.attempt(
                        state.url + path, payload, parsed.stream, upstream.headers()
                    )
                except RetryableFailure as exc:
                    upstream.failed(exc)
                    failures.append(f"{replica_id}: {exc}")
                    if exc.connection:
                        self.replicas.mark_down(replica_id, str(exc))
                    self.stats.retries += 1
                    log.warning("attempt %d at %s failed: %s", attempt + 1, replica_id, exc)
                    continue
                except BaseException as exc:
                    upstream.failed(exc)
                    raise
                if isinstance(outcome, Passthrough):
                    trace.passthrough(outcome.status)
                    return outcome
                if isinstance(outcome, Complete):
                    return Exchange(self.recorder, routed, lease.keep(), trace, body=outcome.body)
                return Exchange(self.recorder, routed, lease.keep(), trace, stream=outcome)
        raise UpstreamError(
            "every attempt at an engine failed: " + "; ".join(failures)
            if failures
            else "no attempt was made"
        )
