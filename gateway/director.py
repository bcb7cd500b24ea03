"""The director: serve one request, admit → route → forward → record (GIE `Director`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response

from cachemap.directory import Directory
from cachemap.keys import BlockHash, affinity_key, chain_hashes, root_hash
from gateway.errors import ModelNotFound, NoReplica, UpstreamError
from gateway.forwarder import Complete, Forwarder, Passthrough, RetryableFailure, Streaming
from gateway.replicas import ReplicaSet, ReplicaState
from gateway.requests import CHAT, ParsedRequest
from gateway.settings import Settings
from gateway.tenants import Tenant
from router.profile import Profile
from router.types import Decision, RouteRequest

log = logging.getLogger(__name__)

_PATHS = {CHAT: "/v1/chat/completions", "completion": "/v1/completions"}
_LEARNING_RATE = 0.1
"""Weight of each response in the bytes-per-token estimate (an EMA over ~10 responses)."""


@dataclass(slots=True)
class Routed:
    """A request after routing: its hashes, the decision and the estimates behind it."""

    parsed: ParsedRequest
    tenant: Tenant
    hashes: list[BlockHash]
    route: RouteRequest
    decision: Decision


@dataclass
class DirectorStats:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    retries: int = 0


class Director:
    def __init__(
        self,
        settings: Settings,
        directory: Directory,
        replicas: ReplicaSet,
        forwarder: Forwarder,
        policy: Profile,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.replicas = replicas
        self.forwarder = forwarder
        self.policy = policy
        self.rng = random.Random(settings.seed)
        self.stats = DirectorStats()
        self._sequence = itertools.count()
        self._bytes_per_token: dict[str, float] = {}

    async def handle(self, parsed: ParsedRequest, tenant: Tenant) -> Response:
        """Serve one completion.

        1. Admit: the tenant is authenticated and the body valid (by the caller); the model must
           be served by some replica.
        2. Route: hash the canonical rendering in the tenant's scope, look up each replica's
           cached prefix, let the policy rank the replicas.
        3. Forward: try the ranking in order until an attempt commits (first byte).
        4. Record: after the first token, the prompt's blocks are on the chosen replica; the
           response's usage gains `engine_cached_tokens`.
        """
        candidates = self._admit(parsed)
        routed = await self._route(parsed, tenant, candidates)
        return await self._forward(routed)

    # -- 1. admit --------------------------------------------------------------------------
    def _admit(self, parsed: ParsedRequest) -> list[ReplicaState]:
        candidates = self.replicas.serving(parsed.model)
        if not candidates:
            if not self.replicas.any_healthy():
                raise NoReplica("no healthy engine replica is available")
            raise ModelNotFound(parsed.model, self.replicas.models())
        return candidates

    # -- 2. route --------------------------------------------------------------------------
    async def _route(
        self, parsed: ParsedRequest, tenant: Tenant, candidates: list[ReplicaState]
    ) -> Routed:
        block_bytes = self.settings.block_bytes
        root = root_hash(tenant.salt, parsed.model)
        hashes = chain_hashes(parsed.rendered, root, block_bytes)
        overlap = await self.directory.lookup(hashes) if hashes else {}
        bytes_per_token = self._bytes_per_token.get(parsed.model, self.settings.bytes_per_token)
        key = affinity_key(
            parsed.rendered, root, hashes, self.settings.consistent_hash_blocks, block_bytes
        )
        route = RouteRequest(
            num_blocks=len(hashes),
            num_prompt_tokens=len(parsed.rendered) / bytes_per_token,
            overlap=overlap,
            tokens_per_block=block_bytes / bytes_per_token,
            affinity_key=key,
            sequence=next(self._sequence),
        )
        decision = self.policy.decide(route, [c.snapshot() for c in candidates], self.rng)
        if decision is None:
            raise NoReplica(f"no healthy replica serves model '{parsed.model}'")
        counter_key = (self.policy.name, decision.reason)
        self.stats.decisions[counter_key] = self.stats.decisions.get(counter_key, 0) + 1
        return Routed(parsed, tenant, hashes, route, decision)

    # -- 3. forward ------------------------------------------------------------------------
    def _upstream_payload(self, routed: Routed) -> bytes:
        body = dict(routed.parsed.body)
        body["cache_salt"] = routed.tenant.cache_salt
        if routed.parsed.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    async def _forward(self, routed: Routed) -> Response:
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
            state.pending_prefill_tokens += uncached
            state.num_requests += 1
            try:
                outcome = await self.forwarder.attempt(state.url + path, payload, parsed.stream)
            except RetryableFailure as exc:
                self._release(state, uncached, finished=True)
                failures.append(f"{replica_id}: {exc}")
                if exc.connection:
                    self.replicas.mark_down(replica_id, str(exc))
                self.stats.retries += 1
                log.warning("attempt %d at %s failed: %s", attempt + 1, replica_id, exc)
                continue
            except BaseException:
                self._release(state, uncached, finished=True)
                raise
            if isinstance(outcome, Passthrough):
                self._release(state, uncached, finished=True)
                return Response(
                    outcome.body, status_code=outcome.status, media_type="application/json"
                )
            if isinstance(outcome, Complete):
                self._release(state, uncached, finished=True)
                await self._record(routed, state)
                self._augment_usage(routed, outcome.body)
                return Response(
                    orjson.dumps(outcome.body),
                    media_type="application/json",
                    headers=self._debug_headers(routed, state),
                )
            self._release(state, uncached, finished=False)
            relay = _Relay(self, routed, state, outcome)
            return _RelayResponse(
                relay,
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", **self._debug_headers(routed, state)},
            )
        raise UpstreamError(
            "every attempt at an engine failed: " + "; ".join(failures)
            if failures
            else "no attempt was made"
        )

    @staticmethod
    def _release(state: ReplicaState, uncached: float, *, finished: bool) -> None:
        state.pending_prefill_tokens = max(state.pending_prefill_tokens - uncached, 0.0)
        if finished:
            state.num_inflight -= 1

    def _rewrite_batch(self, routed: Routed, events: list[bytes], include_usage: bool) -> bytes:
        return b"".join(self._rewrite_event(routed, e, include_usage) for e in events)

    def _rewrite_event(self, routed: Routed, event: bytes, include_usage: bool) -> bytes:
        """Pass an SSE event on; the usage chunk gains `engine_cached_tokens`, or is dropped
        when the client did not ask for usage (the gateway always asks the engine)."""
        if b'"usage"' not in event or not event.startswith(b"data: {"):
            return event + b"\n\n"
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return event + b"\n\n"
        self._augment_usage(routed, chunk)
        if not include_usage and not chunk.get("choices"):
            return b""
        if not include_usage:
            chunk.pop("usage", None)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _augment_usage(self, routed: Routed, body: dict[str, Any]) -> None:
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        usage["engine_cached_tokens"] = cached if isinstance(cached, int) else 0
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int) and prompt_tokens > 0:
            model = routed.parsed.model
            observed = len(routed.parsed.rendered) / prompt_tokens
            old = self._bytes_per_token.get(model)
            self._bytes_per_token[model] = (
                observed if old is None else old + _LEARNING_RATE * (observed - old)
            )

    # -- 4. record -------------------------------------------------------------------------
    async def _record(self, routed: Routed, state: ReplicaState) -> None:
        if routed.hashes:
            await self.directory.record(state.id, routed.hashes)

    def _debug_headers(self, routed: Routed, state: ReplicaState) -> dict[str, str]:
        if not self.settings.debug_headers:
            return {}
        return {
            "x-kvgate-replica": state.url,
            "x-kvgate-matched-blocks": str(routed.route.overlap.get(state.id, 0)),
            "x-kvgate-decision": routed.decision.reason,
        }


class _Relay:
    """Relays one upstream SSE stream to the client; `close()` releases it exactly once, whether
    the stream ends, breaks, or the client leaves before the first chunk is pulled."""

    def __init__(
        self, director: Director, routed: Routed, state: ReplicaState, upstream: Streaming
    ) -> None:
        self.director = director
        self.routed = routed
        self.state = state
        self.upstream = upstream
        self.closed = False
        self.client_gone = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.upstream.response.release()  # an unfinished response closes its connection
            self.state.num_inflight -= 1

    def abort(self) -> None:
        """The client left: drop the upstream connection, so the engine aborts the request."""
        self.client_gone = True
        self.upstream.response.close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        director, routed = self.director, self.routed
        include_usage = routed.parsed.include_usage
        try:
            out = director._rewrite_batch(routed, self.upstream.first_batch, include_usage)
            if out:
                yield out
            await director._record(routed, self.state)
            async for batch in self.upstream.batches:
                out = director._rewrite_batch(routed, batch, include_usage)
                if out:
                    yield out
        except (aiohttp.ClientError, TimeoutError) as exc:
            if self.client_gone:
                return
            log.warning("stream from %s broke after its first byte: %s", self.state.url, exc)
            error = {
                "error": {"message": f"upstream stream broke: {exc}", "type": "upstream_error"}
            }
            yield b"data: " + orjson.dumps(error) + b"\n\n"
        finally:
            self.close()


class _RelayResponse(Response):
    """Streams a `_Relay` to the client.

    Starlette's StreamingResponse watches for a disconnect through an anyio task group, which
    cost ~10% of the gateway's CPU per streamed request; here one plain task watches, and a
    disconnect closes the upstream connection (the relay then ends and the engine aborts).
    """

    def __init__(self, relay: _Relay, *, media_type: str, headers: dict[str, str]) -> None:
        # no body and no content-length: the server sends it chunked
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", media_type.encode()),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]
        self._relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        relay = self._relay

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            relay.abort()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in relay.__aiter__():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            relay.close()
