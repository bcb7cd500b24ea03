"""`POST /v1/messages`: Anthropic's Messages API in front of OpenAI-speaking engines.

The handler stays thin (authenticate, parse, `Director.open`, translate); the request side is
`gateway.api.anthropic.convert`, the usage's cache fields `gateway.api.usage.cache_usage`.
The key comes from `x-api-key` (Anthropic's header) or `Authorization: Bearer` (what the
`anthropic` SDK sends for `api_key` since 2.x). Errors have Anthropic's shape
(`gateway.errors.to_anthropic_http`), mid-stream ones as an `error` event.

A stream is the engine's OpenAI chunks translated event by event:

    message_start                      (usage: zeros; the engine reports usage at the end)
    content_block_start text           ← the first content delta
    content_block_delta text_delta     ← each content delta
    content_block_stop                 ← a tool call starts, or the stream ends
    content_block_start tool_use       ← a tool call's first delta (id, name)
    content_block_delta input_json_delta ← its argument fragments
    content_block_stop
    message_delta                      (stop_reason, and the cumulative usage: the SDK folds
                                        input/cache/output counts into its final message)
    message_stop
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.anthropic.convert import parse_count_tokens, parse_messages
from gateway.api.anthropic.schemas import openapi_operation
from gateway.api.body import ClientWatch, client_left
from gateway.api.context import FrontEnd
from gateway.api.errors import anthropic_error_body, to_anthropic_http
from gateway.api.responses import ExchangeSSE, JSONBytes, debug_headers
from gateway.api.usage import cache_usage
from gateway.errors import EngineRejected, GatewayError, ModelNotFound, TenantError
from gateway.pipeline.forwarder import Passthrough
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from gateway.request.trace import trace_context
from gateway.tenancy.registry import TenantRegistry, bearer_key

PATH = "/v1/messages"
_STOP_REASONS = {
    "length": "max_tokens",
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
"""OpenAI finish_reason → Anthropic stop_reason (anything else: end_turn)."""


def api_key(request: Request) -> str | None:
    """`x-api-key`, else the bearer key of `Authorization`."""
    key = request.headers.get("x-api-key")
    if key is not None:
        return key.strip() or None
    return bearer_key(request.headers.get("authorization"))


def authenticate(tenants: TenantRegistry, request: Request) -> Tenant:
    key = api_key(request)
    if key is None and len(tenants):
        raise TenantError(
            "missing API key: send it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'",
            code="missing_api_key",
        )
    return tenants.authenticate(key)


def _stop(choice: Mapping[str, Any], parsed: ParsedRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): vLLM names the matched stop string in `stop_reason`."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    stops = parsed.body.get("stop") or ()
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return _STOP_REASONS.get(str(finish), "end_turn"), None


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` must be; a model's
    non-object output is kept whole under `_arguments` rather than dropped."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments else {}
        except (ValueError, RecursionError):  # a model's output may be anything
            value = None
        if isinstance(value, dict):
            return value
    return {"_arguments": arguments}


def message_body(parsed: ParsedRequest, body: Mapping[str, Any]) -> dict[str, Any]:
    """A whole OpenAI chat completion as an Anthropic message."""
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if not parsed.prewarm:
        text = message.get("content")
        if isinstance(text, str) and text:
            content.append({"type": "text", "text": text})
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id") or "",
                    "name": function.get("name") or "",
                    "input": _tool_input(function.get("arguments")),
                }
            )
    stop_reason, stop_sequence = ("max_tokens", None) if parsed.prewarm else _stop(choice, parsed)
    return {
        "id": _message_id(body.get("id")),
        "type": "message",
        "role": "assistant",
        "model": parsed.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": cache_usage(parsed, body.get("usage")),
    }


def _message_id(engine_id: Any) -> str:
    return f"msg_{engine_id}" if isinstance(engine_id, str) and engine_id else "msg_kvgate"


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class StreamTranslator:
    """OpenAI chat chunks in, Anthropic stream events out (one translator per stream).

    Blocks are numbered in the order they open; at most one is open at a time (text deltas
    close an open tool_use block and vice versa, as Anthropic's own streams never interleave).
    """

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed = parsed
        self.started = False
        self.num_blocks = 0
        self.open_block: str | None = None
        """"text", "tool:<index>" or None."""
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.usage: Mapping[str, Any] | None = None

    def start(self, engine_id: Any) -> Iterator[bytes]:
        self.started = True
        message: dict[str, Any] = {
            "id": _message_id(engine_id),
            "type": "message",
            "role": "assistant",
            "model": self.parsed.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 0,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        yield _event("message_start", {"type": "message_start", "message": message})

    def chunk(self, chunk: Mapping[str, Any]) -> Iterator[bytes]:
        if not self.started:
            yield from self.start(chunk.get("id"))
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            self.usage = usage
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.open_block != "text":
                yield from self._open("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            key = f"tool:{call.get('index', 0)}"
            function = call.get("function") or {}
            if self.open_block != key:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.get("id") or "",
                    "name": function.get("name") or "",
                    "input": {},
                }
                yield from self._open(key, block)
            fragment = function.get("arguments")
            if isinstance(fragment, str) and fragment:
                yield self._delta({"type": "input_json_delta", "partial_json": fragment})
        if choice.get("finish_reason") is not None:
            self.stop = _stop(choice, self.parsed)

    def finish(self) -> Iterator[bytes]:
        if not self.started:
            yield from self.start(None)
        yield from self._close()
        reason, sequence = self.stop
        usage = cache_usage(self.parsed, self.usage)
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            },
        )
        yield _event("message_stop", {"type": "message_stop"})

    def _open(self, key: str, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self._close()
        self.open_block = key
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": self.num_blocks, "content_block": block},
        )

    def _close(self) -> Iterator[bytes]:
        if self.open_block is not None:
            self.open_block = None
            index = self.num_blocks
            self.num_blocks += 1
            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self.num_blocks, "delta": delta}
        return _event("content_block_delta", data)


def error_event(err: GatewayError) -> bytes:
    return _event("error", anthropic_error_body(err))


class _AnthropicSSE(ExchangeSSE):
    """Streams an exchange as Anthropic events (a client that leaves aborts the upstream)."""

    async def events(self) -> AsyncIterator[bytes]:
        exchange = self.exchange
        translator = StreamTranslator(exchange.parsed)
        async for chunk in exchange.chunks():
            events = b"".join(translator.chunk(chunk))
            if events:
                yield events
        if exchange.client_gone:
            return
        if exchange.failure is not None:  # Anthropic's mid-stream error: an `error` event, the end
            yield error_event(exchange.failure)
            return
        yield b"".join(translator.finish())

    def error_event(self, err: GatewayError) -> bytes:
        return error_event(err)


async def serve(
    front: FrontEnd,
    parsed: ParsedRequest,
    tenant: Tenant,
    trace_headers: dict[str, str] | None = None,
    client_left: Callable[[], Awaitable[object]] | None = None,
) -> Response:
    """Open an exchange for a converted request and answer in Anthropic's shape."""
    with ClientWatch(client_left):
        opened = await front.pipeline.open(parsed, tenant, trace_headers, client_left)
        if isinstance(opened, Passthrough):
            raise EngineRejected(opened.status, opened.body)
        if opened.parsed.stream:
            return _AnthropicSSE(opened, debug_headers(opened, front.debug_headers))
        body = await opened.complete()
    return JSONBytes(
        orjson.dumps(message_body(parsed, body)),
        debug_headers(opened, front.debug_headers),  # the replica that answered
    )


def register(router: APIRouter, front: FrontEnd) -> Callable[[Request], Awaitable[Response]]:
    """Declare `POST /v1/messages` on the router; returns its handler for the hot path."""
    tenants, max_prompt_bytes = front.tenants, front.max_prompt_bytes

    @router.post(PATH, openapi_extra=openapi_operation(), summary="Create a message (Anthropic)")
    async def messages(request: Request) -> Response:
        try:
            tenant = authenticate(tenants, request)
            parsed = parse_messages(await front.read(request), max_prompt_bytes)
            return await serve(
                front, parsed, tenant, trace_context(request.headers), client_left(request)
            )
        except GatewayError as err:
            return to_anthropic_http(err)

    @router.post(
        PATH + "/count_tokens",
        summary="Count a message's input tokens (Anthropic)",
        response_model=None,
    )
    async def count_tokens(request: Request) -> Response:
        """Anthropic's `{"input_tokens": N}`: the gateway's estimate for the prompt (the bytes
        per token it learned from this tenant's answers on the model), as Anthropic's own count
        is an estimate; no engine is asked and nothing is cached or billed."""
        try:
            tenant = authenticate(tenants, request)
            parsed = parse_count_tokens(await front.read(request), max_prompt_bytes)
            allowed = tenant.policy.models
            served = [m for m in front.replicas.models() if not allowed or m in allowed]
            if parsed.model not in served:
                raise ModelNotFound(parsed.model, served)
            tokens = front.pipeline.estimator.prompt_tokens(parsed, tenant=tenant.name)
            return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")
        except GatewayError as err:
            return to_anthropic_http(err)

    return messages
