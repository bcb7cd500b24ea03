"""The director: serve one request, admit → route → forward → record (GIE `Director`)."""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry.trace import Span, get_current_span, use_span
from starlette.responses import Response

from cachemap.keys import affinity_key, chain_hashes, root_hash
from gateway.directory.routing import RoutingDirectory
from gateway.errors import ModelNotFound, NoReplica, UpstreamError
from gateway.fleet.replicas import ReplicaSet, ReplicaState
from gateway.observability import tracing
from gateway.observability.histograms import LOOKUP_BUCKETS_S, LabelledHistograms
from gateway.observability.tracing import Tracing
from gateway.pipeline.admission import Admission
from gateway.pipeline.exchange import Exchange, ExchangeObserver, OpenAISSE, Routed
from gateway.pipeline.forwarder import Complete, Forwarder, Passthrough, RetryableFailure
from gateway.pipeline.placement import Placement
from gateway.request.cache_control import strip_marks
from gateway.request.parsed import CHAT, ParsedRequest
from gateway.request.tenant import Tenant
from gateway.settings import Settings
from router.filters import LoadBoundFilter
from router.profile import Profile
from router.types import RouteRequest

log = logging.getLogger(__name__)

_PATHS = {CHAT: "/v1/chat/completions", "completion": "/v1/completions"}
RequestHook = Callable[[ParsedRequest, Tenant], Awaitable[ParsedRequest]]
"""Runs before admission: may validate (raise a GatewayError) or return a replacement request
(billing expands explicit cached contents and strips billing-only fields)."""
_LEARNING_RATE = 0.1
"""Weight of each response in the bytes-per-token estimate (an EMA over ~10 responses)."""


@dataclass
class DirectorStats:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    retries: int = 0
    lookup_seconds: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LOOKUP_BUCKETS_S)
    )
    """Directory lookups as the request path waits for them, by source (shared | local)."""


class Director:
    def __init__(
        self,
        settings: Settings,
        directory: RoutingDirectory,
        replicas: ReplicaSet,
        forwarder: Forwarder,
        policy: Profile,
        observers: Sequence[ExchangeObserver] = (),
        fallback_policy: Profile | None = None,
        placement: Placement | None = None,
        admission: Admission | None = None,
        request_hooks: Sequence[RequestHook] = (),
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.replicas = replicas
        self.forwarder = forwarder
        self.policy = policy
        self.fallback_policy = fallback_policy or policy
        self.placement = placement or Placement(
            prefill_tokens_per_s=settings.engine_prefill_tokens_per_s,
            overflow=None,
            fixed_threshold_per_min=None,
            flights=None,
            min_hold_tokens=settings.fanout_min_tokens,
            max_hold_s=settings.fanout_max_hold_s,
            bound=LoadBoundFilter(settings.absolute_slack_tokens, settings.relative_slack),
        )
        self.observers = list(observers)
        self.admission = admission or Admission(None, None)
        self.request_hooks = list(request_hooks)
        self.tracer = tracing.tracer if tracing is not None else None
        """Set when tracing is on (gateway.observability.tracing); None: no span is made."""
        self.trace_ratio = tracing.sample_ratio if tracing is not None else 0.0
        self.rng = random.Random(settings.seed)
        self.stats = DirectorStats()
        self._sequence = itertools.count()
        self._bytes_per_token: dict[str, float] = {}

    # -- 1. admit --------------------------------------------------------------------------
    async def _admit(
        self, parsed: ParsedRequest, tenant: Tenant
    ) -> tuple[list[ReplicaState], Tenant, int]:
        """The replicas that may serve the request, the tenant as this request sees it (its
        end user's salt in a `user` scope) and the tokens charged to its rate limit.
        Order: the tenant's scope, model and size (gateway.pipeline.admission), then the fleet (404,
        503), then the rate limit, so a request that cannot be served spends no budget."""
        prompt_tokens = self.estimate_prompt_tokens(parsed)
        tenant = self.admission.check(parsed, tenant, prompt_tokens)
        candidates = self.replicas.serving(parsed.model)
        if not candidates:
            if not self.replicas.any_healthy():
                raise NoReplica("no healthy engine replica is available")
            raise ModelNotFound(parsed.model, self.replicas.models())
        charged = await self.admission.acquire(parsed, tenant, prompt_tokens)
        return candidates, tenant, charged

    def estimate_prompt_tokens(self, parsed: ParsedRequest) -> int:
        """The gateway does not tokenize: token ids count exactly, text by the bytes-per-token
        ratio learned from this model's usage."""
        prompt = parsed.body.get("prompt") if parsed.kind != CHAT else None
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            return len(prompt)
        ratio = self._bytes_per_token.get(parsed.model, self.settings.bytes_per_token)
        return math.ceil(len(parsed.rendered) / ratio)

    # -- 2. route --------------------------------------------------------------------------
    async def _route(
        self, parsed: ParsedRequest, tenant: Tenant, candidates: list[ReplicaState]
    ) -> Routed:
        block_bytes = self.settings.block_bytes
        root = root_hash(tenant.salt, parsed.model)
        hashes = chain_hashes(parsed.rendered, root, block_bytes)
        traced = self.tracer is not None and get_current_span().is_recording()
        started = time.perf_counter()
        if not traced or self.tracer is None:
            lookup = await self.directory.lookup(hashes)
        else:
            with self.tracer.start_as_current_span(tracing.LOOKUP_SPAN) as span:
                lookup = await self.directory.lookup(hashes)
                span.set_attributes(
                    {
                        "kvgate.blocks": len(hashes),
                        "kvgate.source": "local" if lookup.degraded else "shared",
                        "kvgate.matched_blocks": max(lookup.overlap.values(), default=0),
                    }
                )
        source = "shared" if self.directory.shared is not None and not lookup.degraded else "local"
        self.stats.lookup_seconds.labels(source).observe(time.perf_counter() - started)
        bytes_per_token = self._bytes_per_token.get(parsed.model, self.settings.bytes_per_token)
        key = affinity_key(
            parsed.rendered, root, hashes, self.settings.consistent_hash_blocks, block_bytes
        )
        route = RouteRequest(
            num_blocks=len(hashes),
            num_prompt_tokens=len(parsed.rendered) / bytes_per_token,
            overlap=lookup.overlap,
            tokens_per_block=block_bytes / bytes_per_token,
            affinity_key=key,
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
        if traced:
            tracing.decided(policy.name, decision, len(hashes))
        return Routed(
            parsed, tenant, hashes, placed.route, decision, lookup.last_use, flight=placed.flight
        )

    # -- 3. forward ------------------------------------------------------------------------
    def _upstream_payload(self, routed: Routed) -> bytes:
        parsed = routed.parsed
        body = dict(parsed.body)
        if parsed.breakpoints or parsed.prewarm:  # a front end that keeps cache hints in the body
            body = strip_marks(body)
            body["max_tokens"] = max(body.get("max_tokens") or 1, 1)
        body["cache_salt"] = routed.tenant.cache_salt
        if routed.parsed.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    async def open(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        trace_headers: dict[str, str] | None = None,
    ) -> Exchange | Passthrough:
        """Admit, route and forward until an attempt commits: an exchange whose first byte has
        arrived, or an engine's 4xx to pass through. `trace_headers`: the client's W3C trace
        context (`tracing.incoming`), continued and passed on."""
        opened_s = time.monotonic()
        if self.tracer is None:
            return await self._open(parsed, tenant, opened_s, None, trace_headers)
        # sampled here, at the root, so a request not traced makes no span at all (the global
        # generator, not self.rng: tracing must not change a seeded router's choices); a
        # client's traceparent decides by its own sampled flag
        parent, sampled = tracing.parent_of(trace_headers)
        if sampled is None:
            sampled = random.random() < self.trace_ratio
        if not sampled:
            return await self._open(parsed, tenant, opened_s, None, trace_headers)
        span = tracing.start_request(self.tracer, parsed, tenant, parent)
        try:
            with use_span(span, end_on_exit=False, record_exception=False):
                return await self._open(parsed, tenant, opened_s, span, None)
        except BaseException as exc:
            tracing.fail(span, exc)
            raise

    async def _open(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        opened_s: float,
        span: Span | None,
        trace_headers: dict[str, str] | None,
    ) -> Exchange | Passthrough:
        candidates, tenant, charged = await self._admit(parsed, tenant)
        for hook in self.request_hooks:  # after admission: hooks see the scoped tenant
            parsed = await hook(parsed, tenant)
        routed = await self._route(parsed, tenant, candidates)
        routed.admitted_tokens = charged
        routed.opened_s = opened_s
        routed.span = span
        routed.trace_headers = trace_headers
        flight = routed.flight
        if flight is None:
            return await self._forward(routed)
        flights = self.placement.flights
        assert flights is not None
        landed = False
        try:
            opened = await self._forward(routed)
            # the first byte is in: the engine has prefilled, the KV is written
            if isinstance(opened, Exchange):
                landed = True
                flight.replica = opened.replica.id  # a retry may have moved it
            return opened
        finally:
            flights.end(flight, ok=landed)

    async def _forward(self, routed: Routed) -> Exchange | Passthrough:
        parsed = routed.parsed
        payload = self._upstream_payload(routed)
        path = _PATHS[parsed.kind]
        failures: list[str] = []
        for attempt, replica_id in enumerate(routed.decision.ranking):
            if attempt >= self.settings.max_attempts:
                break
            state = self.replicas.get(replica_id)
            uncached = routed.route.uncached_tokens(replica_id)
            state.num_inflight += 1
            state.begin_prefill(uncached)
            state.num_requests += 1
            upstream = None
            if routed.span is not None and self.tracer is not None:
                upstream = tracing.start_upstream(self.tracer, replica_id, attempt + 1, uncached)
            try:
                headers = (
                    tracing.outgoing(upstream) if upstream is not None else routed.trace_headers
                )
                outcome = await self.forwarder.attempt(
                    state.url + path, payload, parsed.stream, headers
                )
            except RetryableFailure as exc:
                if upstream is not None:
                    tracing.fail(upstream, exc)
                self._release_prefill(state, uncached)
                state.num_inflight -= 1
                failures.append(f"{replica_id}: {exc}")
                if exc.connection:
                    self.replicas.mark_down(replica_id, str(exc))
                self.stats.retries += 1
                log.warning("attempt %d at %s failed: %s", attempt + 1, replica_id, exc)
                continue
            except BaseException as exc:
                if upstream is not None:
                    tracing.fail(upstream, exc)
                self._release_prefill(state, uncached)
                state.num_inflight -= 1
                raise
            self._release_prefill(state, uncached)
            if isinstance(outcome, Passthrough):
                state.num_inflight -= 1
                if routed.span is not None:
                    tracing.passthrough(routed.span, upstream, outcome.status)
                return outcome
            routed.upstream_span = upstream
            if isinstance(outcome, Complete):
                return Exchange(self, routed, state, body=outcome.body)
            return Exchange(self, routed, state, stream=outcome)
        raise UpstreamError(
            "every attempt at an engine failed: " + "; ".join(failures)
            if failures
            else "no attempt was made"
        )

    @staticmethod
    def _release_prefill(state: ReplicaState, uncached: float) -> None:
        state.end_prefill(uncached)

    # -- 4. record: the exchange's hooks ---------------------------------------------------
    async def _on_first_token(self, exchange: Exchange) -> None:
        exchange.first_token_s = time.monotonic()
        if exchange.routed.hashes:
            await self.directory.record(exchange.replica.id, exchange.routed.hashes)
        for observer in self.observers:
            await observer.on_first_token(exchange)

    async def _on_usage(self, exchange: Exchange, usage: dict[str, Any]) -> None:
        """`engine_cached_tokens` (the physical hit) joins the usage; the bytes-per-token
        estimate learns from `prompt_tokens`; then the observers may rewrite the rest."""
        exchange.usage = usage
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        usage["engine_cached_tokens"] = cached if isinstance(cached, int) else 0
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int) and prompt_tokens > 0:
            model = exchange.parsed.model
            observed = len(exchange.parsed.rendered) / prompt_tokens
            old = self._bytes_per_token.get(model)
            self._bytes_per_token[model] = (
                observed if old is None else old + _LEARNING_RATE * (observed - old)
            )
        for observer in self.observers:
            await observer.on_usage(exchange, usage)

    async def _on_finish(self, exchange: Exchange) -> None:
        exchange.replica.num_inflight -= 1
        for observer in self.observers:
            await observer.on_finish(exchange, exchange.ok)
        if exchange.routed.span is not None:
            tracing.finish(exchange.routed, exchange)

    def stream_broke(self, exchange: Exchange, exc: BaseException) -> None:
        log.warning("stream from %s broke after its first byte: %s", exchange.replica.url, exc)

    # -- the OpenAI HTTP shape ---------------------------------------------------------------
    async def handle(
        self,
        parsed: ParsedRequest,
        tenant: Tenant,
        trace_headers: dict[str, str] | None = None,
    ) -> Response:
        """Serve one OpenAI-shaped completion.

        1. Admit: the tenant is authenticated and the body valid (by the caller); the model must
           be served by some replica.
        2. Route: hash the canonical rendering in the tenant's scope, look up each replica's
           cached prefix, let the policy rank the replicas.
        3. Forward: try the ranking in order until an attempt commits (first byte).
        4. Record: after the first token the prompt's blocks are on the chosen replica; the
           usage gains `engine_cached_tokens` and passes the observers (billing, metrics).
        """
        opened = await self.open(parsed, tenant, trace_headers)
        if isinstance(opened, Passthrough):
            return Response(opened.body, status_code=opened.status, media_type="application/json")
        headers = self._debug_headers(opened)
        if opened.stream is None:
            body = await opened.complete()
            return Response(orjson.dumps(body), media_type="application/json", headers=headers)
        return OpenAISSE(opened, headers)

    def _debug_headers(self, exchange: Exchange) -> dict[str, str]:
        if not self.settings.debug_headers:
            return {}
        routed = exchange.routed
        return {
            "x-kvgate-replica": exchange.replica.url,
            "x-kvgate-matched-blocks": str(routed.route.overlap.get(exchange.replica.id, 0)),
            "x-kvgate-decision": routed.decision.reason,
        }
