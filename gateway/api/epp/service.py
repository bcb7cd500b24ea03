"""The endpoint picker: Envoy's `ExternalProcessor`, one ext-proc stream per HTTP request.

A stream is a conversation whose messages come in the request's order, and the answers keep
that order (headers → body → trailers, request side then response side):

    request_headers ──────────────▶ (held: the pick needs the body)
    request_body × n, end ────────▶ [override_message_timeout while a fan-out hold or flow
                                     control's queue waits: once, at most max_message_timeout]
                                    HeadersResponse (destination, metadata, key stripped)
                                    + StreamedBodyResponse chunks (cache_salt added)
                                    | ImmediateResponse (4xx / 429 / 503 in the gateway's shape)
    response_headers ─────────────▶ HeadersResponse; a 2xx is an exchange on the served replica
    response_body × n, end ───────▶ the same bytes (the first token recorded, the usage billed)

Who may speak: with `epp_token` set, only a stream carrying it (Envoy's `initial_metadata`)
is read at all (`PickerService`); the tenant's key is checked on the request headers, before
any body byte is kept; the body kept is at most `max_body_bytes` in total (413 past it), and
nothing of the request is kept after the pick or a refusal.

Handlers stay thin, as the HTTP ones do: authenticate (the key header), parse
(`gateway.api.openai.parse`), `Director.pick`, map errors in one place (`gateway.api.errors`).
The request body mode may be FULL_DUPLEX_STREAMED (production: the documented Envoy config) or
BUFFERED; the response body mode FULL_DUPLEX_STREAMED (the first token and the usage are seen
exactly) or NONE (the response headers stand for the first token; no usage, so no billing or
reconciliation): Envoy announces its modes in the stream's first message (`protocol_config`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import grpc
import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from gateway.api.context import FrontEnd
from gateway.api.epp import mutations as m
from gateway.api.epp.relay import ResponseRelay
from gateway.api.errors import openai_error_body
from gateway.api.openai.parse import parse_chat, parse_completion
from gateway.errors import GatewayError, PayloadTooLarge, UpstreamError
from gateway.pipeline.relayed import Pick, RelayedExchange
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from gateway.request.trace import trace_context
from gateway.tenancy.registry import bearer_key

log = logging.getLogger(__name__)

_MODE = processing_mode_pb2.ProcessingMode
_PARSERS = {"/v1/chat/completions": parse_chat, "/v1/completions": parse_completion}
HOLD_TIMEOUT_MARGIN_S = 1.0
"""A hold's timer is its bound plus a second: the pick after the hold (a lookup, a policy) and
the answer's trip must fit too."""


class _NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class Conversation:
    """One ext-proc stream: one HTTP request and its response."""

    def __init__(self, front: FrontEnd, context: Any, max_message_timeout_s: float) -> None:
        self.front = front
        self.context = context
        self.max_message_timeout_s = max_message_timeout_s
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.buffered = False
        self.relay_body = False
        self.body = bytearray()
        self.picked = False
        """The pick was made (or the request refused): request bytes after it are dropped."""
        self.refused = False
        self.tenant: Tenant | None = None
        self.pick: Pick | None = None
        self.exchange: RelayedExchange | None = None
        self.relay: ResponseRelay | None = None
        self.endpoints: dict[str, str] = {}

    async def send(self, response: Any) -> None:
        await self.context.write(response)

    async def handle(self, request: Any) -> None:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            await self._request_headers(request)
        elif kind == "request_body":
            body = request.request_body
            if self.picked:  # picked or refused: nothing more of the request is kept
                return
            if len(self.body) + len(body.body) > self.front.max_body_bytes:
                await self._refuse(
                    PayloadTooLarge(f"the body is over {self.front.max_body_bytes} bytes")
                )
                return
            self.body += body.body
            if body.end_of_stream:
                await self._pick()
        elif kind == "request_trailers":
            if self.refused:
                return
            await self._pick()
            await self.send(m.trailers_continue(response=False))
        elif kind == "response_headers":
            await self._response_headers(request)
        elif kind == "response_body":
            body = request.response_body
            await self._response_body(body.body, body.end_of_stream)
        elif kind == "response_trailers":
            await self.send(m.trailers_continue(response=True))
            await self._end(ok=True)

    # -- the request ------------------------------------------------------------------------
    async def _request_headers(self, request: Any) -> None:
        config = request.protocol_config
        if request.HasField("protocol_config"):
            self.buffered = config.request_body_mode == _MODE.BUFFERED
            self.relay_body = config.response_body_mode == _MODE.FULL_DUPLEX_STREAMED
        self.headers = m.header_map(request.request_headers.headers)
        self.subset = m.subset_hint(request)
        if request.request_headers.end_of_stream:
            self.picked = True
            await self.send(self._bodiless())
            return
        try:  # on the headers: an unknown key's body is never buffered
            self.tenant = self._authenticate()
        except GatewayError as err:
            await self._refuse(err)
            return
        if self.buffered:
            await self.send(m.headers_continue(response=False))

    async def _refuse(self, err: GatewayError) -> None:
        """Answer `err` now; the rest of the request is dropped unread."""
        self.picked = self.refused = True
        self.body = bytearray()
        await self.send(_error(err))

    def _bodiless(self) -> Any:
        """A request without a body: the model list (as the standalone gateway answers it),
        anything else is not something the picker routes."""
        path = self.headers.get(":path", "").split("?", 1)[0]
        try:
            tenant = self._authenticate()
            if path != "/v1/models" or self.headers.get(":method") != "GET":
                raise _NotFound(f"the endpoint picker routes POST {' and '.join(_PARSERS)}")
        except GatewayError as err:
            return _error(err)
        allowed = tenant.policy.models
        served = sorted(
            {
                model
                for state in self.front.replicas.states.values()
                if state.healthy
                for model in state.models
                if not allowed or model in allowed
            }
        )
        data = [{"id": x, "object": "model", "created": 0, "owned_by": "kvgate"} for x in served]
        return m.immediate(200, orjson.dumps({"object": "list", "data": data}))

    def _authenticate(self) -> Tenant:
        headers = self.headers
        key = bearer_key(headers.get("authorization")) or headers.get("x-api-key") or None
        return self.front.tenants.authenticate(key)

    def _parse(self) -> ParsedRequest:
        path = self.headers.get(":path", "").split("?", 1)[0]
        parser = _PARSERS.get(path)
        if parser is None or self.headers.get(":method") != "POST":
            raise _NotFound(f"the endpoint picker routes POST {' and '.join(_PARSERS)}")
        return parser(bytes(self.body), self.front.max_prompt_bytes)

    async def _pick(self) -> None:
        if self.picked:
            return
        self.picked = True
        try:
            tenant = self.tenant or self._authenticate()
            parsed = self._parse()
            pick = await self.front.pipeline.pick(
                parsed,
                tenant,
                trace_context(self.headers),
                only=self._only(),
                relay_usage=self.relay_body,
                on_hold=self._on_hold,
            )
        except GatewayError as err:
            await self._refuse(err)
            return
        self.pick = pick
        self.body = bytearray()
        endpoints = [self.endpoints[r] for r in pick.ranking]
        headers = m.picked_headers(endpoints, len(pick.payload), pick.headers)
        if self.buffered:
            await self.send(m.buffered_body(headers, pick.payload))
            return
        await self.send(headers)
        for chunk in m.body_chunks(pick.payload, response=False):
            await self.send(chunk)

    def _only(self) -> set[str] | None:
        self.endpoints = m.endpoints_of(self.front.replicas.states)
        if self.subset is None:
            return None
        allowed = set(self.subset)
        return {url for url, endpoint in self.endpoints.items() if endpoint in allowed}

    async def _on_hold(self, bound_s: float) -> float:
        """Restart Envoy's message timer for a wait of `bound_s` (a fan-out hold, or flow
        control's queue); Envoy takes one restart per message, at most its
        `max_message_timeout`: returns how long the request may wait."""
        timeout = min(bound_s + HOLD_TIMEOUT_MARGIN_S, self.max_message_timeout_s)
        await self.send(m.extend_timeout(timeout))
        return max(timeout - HOLD_TIMEOUT_MARGIN_S, 0.0)

    # -- the response -----------------------------------------------------------------------
    async def _response_headers(self, request: Any) -> None:
        headers = m.header_map(request.response_headers.headers)
        await self.send(m.headers_continue(response=True))
        pick, self.pick = self.pick, None
        if pick is None:
            return
        status = int(headers.get(":status", "0") or 0)
        if status >= 500 or status < 200:
            pick.abandon(UpstreamError(f"the engine answered {status} through Envoy"))
            return
        if status >= 300:
            pick.abandon(status=status)
            return
        served = m.served_endpoint(request)
        replica = next((u for u, e in self.endpoints.items() if e == served), None)
        exchange = self.exchange = pick.served(replica)
        parsed = exchange.parsed
        if self.relay_body:
            self.relay = ResponseRelay(exchange, parsed.stream, parsed.include_usage)
        else:
            await exchange.first_token()
        if request.response_headers.end_of_stream:
            await self._end(ok=True)

    async def _response_body(self, data: bytes, end: bool) -> None:
        relay = self.relay
        if relay is None:
            for chunk in m.body_chunks(data, response=True, end=end):
                await self.send(chunk)
            return
        out, first = await relay.feed(data, end)
        if first:  # before Envoy has the bytes: billing's open entry exists when they go out
            await relay.exchange.first_token()
        if out or end:
            for chunk in m.body_chunks(out, response=True, end=end):
                await self.send(chunk)
        if end:
            await self._end(ok=True)

    async def _end(self, ok: bool) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            await exchange.end(ok)

    async def close(self, exc: BaseException | None) -> None:
        """The stream ended: whatever is still open ends with it (`exc`: why, if not cleanly).
        Without response body events the response's end is the stream's end."""
        pick, self.pick = self.pick, None
        if pick is not None:
            pick.abandon(exc or UpstreamError("the ext-proc stream ended before the response"))
        await self._end(ok=exc is None and not self.relay_body)


def _error(err: GatewayError) -> Any:
    body = orjson.dumps(openai_error_body(err))
    return m.immediate(err.status, body, err.headers(), details=type(err).__name__)


class PickerService:
    """The `envoy.service.ext_proc.v3.ExternalProcessor` servicer. With a `token`, a stream
    must carry `authorization: Bearer <token>` in its gRPC metadata (Envoy's
    `grpc_service.initial_metadata`): without it the stream is refused UNAUTHENTICATED before
    its first message is read, so no one but Envoy can pose as Envoy (a forged usage event
    after a genuine pick would under-bill)."""

    def __init__(
        self, front: FrontEnd, max_message_timeout_s: float, token: str | None = None
    ) -> None:
        self.front = front
        self.max_message_timeout_s = max_message_timeout_s
        self._token = None if token is None else f"Bearer {token}".encode()

    def _authorized(self, context: Any) -> bool:
        if self._token is None:
            return True
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        given = sent.encode() if isinstance(sent, str) else bytes(sent)
        return hmac.compare_digest(given, self._token)

    async def Process(self, requests: Any, context: Any) -> None:
        if not self._authorized(context):
            log.warning("endpoint picker: refused an ext-proc stream without the picker's token")
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this ext-proc stream needs the picker's token (epp_token) as "
                "'authorization: Bearer TOKEN' metadata",
            )
        conversation = Conversation(self.front, context, self.max_message_timeout_s)
        failure: BaseException | None = None
        try:
            async for request in requests:
                await conversation.handle(request)
        except asyncio.CancelledError as exc:
            failure = exc
            raise
        except Exception as exc:
            failure = exc
            log.exception("endpoint picker: the ext-proc stream failed")
            raise
        finally:
            await conversation.close(failure)
