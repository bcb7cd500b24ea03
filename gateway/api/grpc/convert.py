"""A `kvgate.v1.GenerateRequest`, validated and converted to the OpenAI chat shape.

As for `/v1/messages` (`gateway.api.anthropic.convert`), the converted request is what goes upstream
and what is rendered and hashed by `cachemap.rendering.render_chat`, so a conversation sent over
gRPC lands on the same blocks as the same conversation over HTTP:

    Message{role, content: [text | image_url], tool_calls, tool_call_id, name}
        → {"role", "content": [parts], "tool_calls": [{"id", "function": {name, arguments}}],
           "tool_call_id", "name"}
    Tool{name, description, parameters_json} → {"type": "function", "function": {...}}
    cache_control on a part / a message / a tool / the request → a `Mark`, and the same
        `cache_control` hint on the converted part / message / tool, where billing reads it

Invariants: a bad request is an `InvalidRequest` (INVALID_ARGUMENT) naming the field;
JSON travels as text (`arguments_json`, `parameters_json`) so numbers keep their spelling; the
upstream request always streams (an RPC's cancellation then reaches the engine at once).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cachemap.rendering import MAX_JSON_DEPTH, NestingError, render_chat, too_deep
from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.errors import InvalidRequest
from gateway.request.cache_control import (
    TTL_1H,
    TTL_5M,
    Mark,
    annotate_messages,
    annotate_tools,
    check_marks,
    place,
)
from gateway.request.parsed import CHAT, ParsedRequest

ROLES = {
    pb.ROLE_SYSTEM: "system",
    pb.ROLE_USER: "user",
    pb.ROLE_ASSISTANT: "assistant",
    pb.ROLE_TOOL: "tool",
    pb.ROLE_DEVELOPER: "developer",
}


def _ttl(control: pb.CacheControl) -> str:
    return TTL_1H if control.ttl == pb.CACHE_TTL_1H else TTL_5M


def _json_object(text: str, where: str) -> dict[str, Any] | None:
    """A JSON object from text; None for empty text."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    except ValueError as exc:
        raise InvalidRequest(f"{where} is not valid JSON: {exc}", param=where) from None
    if value is None or too_deep(value):
        raise InvalidRequest(f"{where} nests deeper than {MAX_JSON_DEPTH} levels", param=where)
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object", param=where)
    return value


def _message(message: pb.Message, i: int, marks: list[Mark]) -> dict[str, Any]:
    where = f"messages[{i}]"
    role = ROLES.get(message.role)
    if role is None:
        names = ", ".join(pb.Role.Name(r) for r in ROLES)
        raise InvalidRequest(f"{where}.role must be one of {names}", param="messages")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(message.content):
        kind = part.WhichOneof("kind")
        if kind == "text":
            parts.append({"type": "text", "text": part.text})
        elif kind == "image_url":
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise InvalidRequest(f"{where}.content[{j}] needs text or image_url", param="messages")
        if part.HasField("cache_control"):
            whole = j == len(message.content) - 1 and not message.tool_calls
            marks.append(
                Mark(
                    _ttl(part.cache_control),
                    f"{where}.content[{j}]",
                    message=i,
                    num_parts=None if whole else j + 1,
                )
            )
    out: dict[str, Any] = {"role": role}
    if message.name:
        out["name"] = message.name
    if role == "tool":
        if not message.tool_call_id:
            raise InvalidRequest(f"{where}.tool_call_id is required for ROLE_TOOL", param=where)
        out["tool_call_id"] = message.tool_call_id
    calls = []
    for k, call in enumerate(message.tool_calls):
        if not call.name:
            raise InvalidRequest(f"{where}.tool_calls[{k}].name is required", param=where)
        _json_object(call.arguments_json, f"{where}.tool_calls[{k}].arguments_json")
        function = {"name": call.name, "arguments": call.arguments_json or "{}"}
        calls.append({"id": call.id, "type": "function", "function": function})
    out["content"] = parts or (None if calls else "")
    if calls:
        out["tool_calls"] = calls
    if message.HasField("cache_control"):
        marks.append(Mark(_ttl(message.cache_control), where, message=i))
    return out


def _tools(request: pb.GenerateRequest, marks: list[Mark]) -> list[dict[str, Any]]:
    tools = []
    for k, tool in enumerate(request.tools):
        where = f"tools[{k}]"
        if not tool.name:
            raise InvalidRequest(f"{where}.name is required", param="tools")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        parameters = _json_object(tool.parameters_json, f"{where}.parameters_json")
        if parameters is not None:
            function["parameters"] = parameters
        tools.append({"type": "function", "function": function})
        if tool.HasField("cache_control"):
            marks.append(Mark(_ttl(tool.cache_control), where, tool=k))
    return tools


def to_parsed(
    request: pb.GenerateRequest, *, streaming_rpc: bool, max_prompt_bytes: int
) -> ParsedRequest:
    """Validate and convert one request; `streaming_rpc` refuses a pre-warm."""
    if not request.model:
        raise InvalidRequest("'model' is required", param="model")
    if not request.messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    marks: list[Mark] = []
    tools = _tools(request, marks)
    messages = [_message(m, i, marks) for i, m in enumerate(request.messages)]
    if request.HasField("cache_control"):
        last = len(messages) - 1
        if not any(m.message == last and m.num_parts is None for m in marks):
            marks.append(
                Mark(_ttl(request.cache_control), "cache_control (automatic)", message=last)
            )
    check_marks(marks)  # in the client's order: tools, then each message's parts and itself

    # the marks ride on the body for billing (the director strips them before forwarding)
    upstream: dict[str, Any] = {
        "model": request.model,
        "messages": annotate_messages(messages, marks),
        "stream": True,
    }
    if tools:
        upstream["tools"] = annotate_tools(tools, marks)
    if request.user:
        upstream["user"] = request.user
    prewarm = _sampling(request.sampling, upstream)
    if prewarm and streaming_rpc:
        raise InvalidRequest(
            "max_tokens 0 (a cache pre-warm) generates nothing: call Generate, not GenerateStream",
            param="sampling.max_tokens",
        )
    try:
        rendered = render_chat(messages, tools or None).encode()
    except NestingError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    if len(rendered) > max_prompt_bytes:
        raise InvalidRequest(
            f"the prompt is {len(rendered)} bytes; the maximum is {max_prompt_bytes}",
            param="messages",
        )
    breakpoints = place(marks, messages, tools, len(rendered))
    return ParsedRequest(
        CHAT,
        request.model,
        upstream,
        rendered,
        True,
        True,
        breakpoints=breakpoints,
        prewarm=prewarm,
        priority=request.priority if request.HasField("priority") else None,
    )


def _sampling(sampling: pb.Sampling, upstream: dict[str, Any]) -> bool:
    """Copy the sampling fields upstream; True for a pre-warm (max_tokens 0)."""
    prewarm = False
    if sampling.HasField("max_tokens"):
        prewarm = sampling.max_tokens == 0
        upstream["max_tokens"] = max(sampling.max_tokens, 1)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if sampling.HasField(name):
            upstream[name] = getattr(sampling, name)
    if sampling.top_k < 0:
        raise InvalidRequest("'sampling.top_k' must be >= 0", param="sampling.top_k")
    if sampling.stop:
        upstream["stop"] = list(sampling.stop)
    return prewarm


def usage_message(anthropic_usage: Mapping[str, Any], engine: Mapping[str, Any]) -> pb.Usage:
    """The proto usage: the engine's counts, the cache split (`gateway.api.usage.cache_usage`)
    and, with billing on, the cost and the billing record's id."""
    creation = anthropic_usage["cache_creation"]
    billing = engine.get("kvgate_billing")
    billing = billing if isinstance(billing, Mapping) else {}
    return pb.Usage(
        cost=str(engine.get("cost") or ""),
        billing_id=str(billing.get("id") or ""),
        prompt_tokens=_count(engine.get("prompt_tokens")),
        completion_tokens=_count(engine.get("completion_tokens")),
        engine_cached_tokens=anthropic_usage["engine_cached_tokens"],
        input_tokens=anthropic_usage["input_tokens"],
        cache_read_input_tokens=anthropic_usage["cache_read_input_tokens"],
        cache_creation_input_tokens=anthropic_usage["cache_creation_input_tokens"],
        ephemeral_5m_input_tokens=int(creation.get("ephemeral_5m_input_tokens") or 0),
        ephemeral_1h_input_tokens=int(creation.get("ephemeral_1h_input_tokens") or 0),
        output_tokens=anthropic_usage["output_tokens"],
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
