"""An Anthropic Messages request, validated and converted to the OpenAI chat shape.

The converted request is what goes upstream (engines speak OpenAI) and what is rendered and
hashed, through the same `cachemap.rendering.render_chat` as `/v1/chat/completions`, so one
conversation maps to the same blocks (and the same replica) through either API:

    Anthropic                                      OpenAI chat
    system: "..." | [text blocks]            →     a leading {"role": "system"} message
    user: [text, image, ...]                 →     {"role": "user", "content": [parts]}
    user: [tool_result a, tool_result b, text] →   {"role": "tool", a}, {"role": "tool", b},
                                                   {"role": "user", [text]}   (in order)
    assistant: [text, tool_use]              →     {"role": "assistant", "content": [text],
                                                    "tool_calls": [{"arguments": JSON}]}
    tools: [{name, description, input_schema}] →   [{"type": "function", "function":
                                                    {name, description, parameters}}]
    cache_control on a block / tool / top level →  a `Mark` (see gateway.request.cache_control)

Invariants: every rule answers a bad request with a 400 naming the field and the valid options;
`cache_control` never reaches the rendering or the engine: the marks stay on the converted
request's tools, messages and parts (and at the top level), where the billing meter reads them,
and the director strips them before forwarding (`gateway.request.cache_control.strip_marks`);
`max_tokens: 0` (a pre-warm) stays 0 for billing and goes upstream as 1 (engines require
>= 1); it is refused with streaming or a forced tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachemap.rendering import NestingError, canonical_json, render_chat
from gateway.api.body import load_json_object, take_priority
from gateway.errors import InvalidRequest
from gateway.request.cache_control import (
    Mark,
    annotate_messages,
    annotate_tools,
    check_marks,
    parse_cache_control,
    place,
)
from gateway.request.parsed import CHAT, ParsedRequest

_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "tools",
        "tool_choice",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "metadata",
        "cache_control",
        "thinking",
        "service_tier",
        "priority",
    }
)
_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none", "tool": None}
_ALL = -1
"""A mark's `num_parts` placeholder: every content part of its message (tool_use marks)."""


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


@dataclass
class _Segment:
    """One converted message under construction, with the marks on its blocks."""

    role: str
    parts: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str | None = None
    text: str | None = None
    """A plain string content (Anthropic's string shorthand)."""
    marks: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(ttl, where, num_parts, num_calls) in the client's order. Tool calls render after the
    content, so a mark on a text block covers the parts up to it (and no call), a mark on a
    tool_use block every part and the calls up to it."""


class _Converter:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.marks: list[Mark] = []
        self.last: Mark | None = None
        """The position of the last block converted (where automatic caching puts its mark)."""

    def flush(self, segment: _Segment) -> None:
        index = len(self.messages)
        message: dict[str, Any] = {"role": segment.role}
        if segment.tool_call_id is not None:
            message["tool_call_id"] = segment.tool_call_id
        if segment.text is not None:
            message["content"] = segment.text
        else:
            message["content"] = segment.parts or (None if segment.calls else "")
        if segment.calls:
            message["tool_calls"] = segment.calls
        self.messages.append(message)
        for ttl, where, num_parts, num_calls in segment.marks:
            self.marks.append(self._mark(segment, index, ttl, where, num_parts, num_calls))
        self.last = Mark("", "", message=index)

    @staticmethod
    def _mark(
        segment: _Segment, index: int, ttl: str, where: str, num_parts: int, num_calls: int
    ) -> Mark:
        if num_parts == _ALL:
            num_parts = len(segment.parts)
        whole = num_calls == len(segment.calls) and num_parts == len(segment.parts)
        if whole or segment.text is not None:
            return Mark(ttl, where, message=index)
        return Mark(ttl, where, message=index, num_parts=num_parts, num_calls=num_calls)


def _text(block: dict[str, Any], where: str) -> dict[str, Any]:
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail(f"{where}.text must be a string", where)
    return {"type": "text", "text": text}


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _fail(f"{where}.source needs string media_type and data", where)
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        link = source.get("url")
        if not isinstance(link, str):
            raise _fail(f"{where}.source.url must be a string", where)
        url = link
    else:
        raise _fail(f"{where}.source.type must be one of base64, url, got {kind!r}", where)
    return {"type": "image_url", "image_url": {"url": url}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise _fail(f"{where} must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _fail(f"{where}[{j}] must be an object with a string 'type'", where)
    return content


def _tool_result(block: dict[str, Any], where: str, segment: _Segment) -> None:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _fail(f"{where}.tool_use_id must be a non-empty string", where)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _fail(f"{where}.is_error must be a boolean", where)
    segment.tool_call_id = tool_use_id
    content = block.get("content", "")
    if isinstance(content, str):
        segment.text = content
        return
    for j, inner in enumerate(_blocks(content, f"{where}.content")):
        here = f"{where}.content[{j}]"
        if inner["type"] == "text":
            segment.parts.append(_text(inner, here))
        elif inner["type"] == "image":
            segment.parts.append(_image(inner, here))
        else:
            raise _fail(f"{here}.type must be one of text, image, got {inner['type']!r}", here)
        if inner.get("cache_control") is not None:
            ttl = parse_cache_control(inner["cache_control"], here)
            segment.marks.append((ttl, here, len(segment.parts), 0))


def _convert_message(message: Any, i: int, out: _Converter) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _fail(f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise _fail(f"{where}.role must be one of assistant, user, got {role!r}", "messages")
    unknown = set(message) - {"role", "content"}
    if unknown:
        raise _fail(f"{where} has unknown fields {sorted(unknown)}; it takes role and content")
    content = message.get("content")
    if isinstance(content, str):
        out.flush(_Segment(role, text=content))
        return
    allowed = _USER_BLOCKS if role == "user" else _ASSISTANT_BLOCKS
    segment = _Segment(role)
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        here = f"{where}.content[{j}]"
        kind = block["type"]
        if kind not in allowed:
            raise _fail(
                f"{here}.type must be one of {', '.join(allowed)} in a {role} message, "
                f"got {kind!r}",
                here,
            )
        if kind == "tool_result":
            if segment.parts:
                out.flush(segment)
                segment = _Segment(role)
            result = _Segment("tool")
            _tool_result(block, here, result)
            if block.get("cache_control") is not None:
                ttl = parse_cache_control(block["cache_control"], here)
                result.marks.append((ttl, here, len(result.parts), 0))
            out.flush(result)
            continue
        if kind == "tool_use":
            segment.calls.append(_tool_call(block, here))
            covers = (_ALL, len(segment.calls))
        else:
            segment.parts.append(_text(block, here) if kind == "text" else _image(block, here))
            covers = (len(segment.parts), 0)
        if block.get("cache_control") is not None:
            ttl = parse_cache_control(block["cache_control"], here)
            segment.marks.append((ttl, here, *covers))
    if segment.parts or segment.calls or not content:
        out.flush(segment)


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise _fail(f"{where} needs a string id and a non-empty string name", where)
    if not isinstance(arguments, dict):
        raise _fail(f"{where}.input must be an object", where)
    function = {"name": name, "arguments": canonical_json(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def _convert_system(system: Any, out: _Converter) -> None:
    if system is None or system == []:
        return
    if isinstance(system, str):
        out.flush(_Segment("system", text=system))
        return
    segment = _Segment("system")
    for j, block in enumerate(_blocks(system, "system")):
        here = f"system[{j}]"
        if block["type"] != "text":
            raise _fail(f"{here}.type must be 'text', got {block['type']!r}", "system")
        segment.parts.append(_text(block, here))
        if block.get("cache_control") is not None:
            ttl = parse_cache_control(block["cache_control"], here)
            segment.marks.append((ttl, here, len(segment.parts), 0))
    out.flush(segment)


def _convert_tools(tools: Any) -> tuple[list[dict[str, Any]], list[Mark]]:
    if not isinstance(tools, list):
        raise _fail("'tools' must be a list of tool definitions", "tools")
    converted: list[dict[str, Any]] = []
    marks: list[Mark] = []
    for k, tool in enumerate(tools):
        here = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise _fail(f"{here} must be an object", "tools")
        if tool.get("type", "custom") != "custom":
            raise _fail(
                f"{here}.type {tool.get('type')!r} is a server tool; kvgate serves custom tools "
                "(name, description, input_schema) only",
                "tools",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _fail(f"{here}.name must be a non-empty string", "tools")
        if not isinstance(schema, dict):
            raise _fail(f"{here}.input_schema must be an object (a JSON Schema)", "tools")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _fail(f"{here}.description must be a string", "tools")
            function["description"] = description
        function["parameters"] = schema
        converted.append({"type": "function", "function": function})
        if tool.get("cache_control") is not None:
            marks.append(Mark(parse_cache_control(tool["cache_control"], here), here, tool=k))
    return converted, marks


def _tool_choice(choice: Any, prewarm: bool) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in _TOOL_CHOICES:
        raise _fail(
            f"'tool_choice.type' must be one of {', '.join(_TOOL_CHOICES)}, got {kind!r}",
            "tool_choice",
        )
    assert isinstance(choice, dict)
    if prewarm and kind in ("any", "tool"):
        raise _fail("'max_tokens: 0' (a cache pre-warm) cannot force a tool", "tool_choice")
    if kind != "tool":
        return _TOOL_CHOICES[kind]
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("'tool_choice.name' must name a tool when type is 'tool'", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _sampling(body: dict[str, Any], upstream: dict[str, Any]) -> None:
    for name in ("temperature", "top_p"):  # both in [0, 1] in Anthropic's API
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _fail(f"'{name}' must be a number", name)
            if not 0 <= value <= 1:
                raise _fail(f"'{name}' must be between 0 and 1, got {value:g}", name)
            upstream[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise _fail("'top_k' must be an integer >= 0", "top_k")
        upstream["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _fail("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
        if stop:
            upstream["stop"] = stop
    metadata = body.get("metadata")
    if metadata is not None:
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        if not isinstance(metadata, dict) or (user is not None and not isinstance(user, str)):
            raise _fail("'metadata' must be an object with an optional string user_id", "metadata")
        if user:
            upstream["user"] = user


def _check_top_level(body: dict[str, Any]) -> tuple[str, int, bool]:
    """(model, max_tokens, stream) of a Messages body, with the combinations kvgate refuses."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("'model' is required and must be a non-empty string", "model")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise _fail("'max_tokens' is required and must be an integer >= 0", "max_tokens")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _fail("'stream' must be a boolean", "stream")
    if max_tokens == 0 and stream:
        raise _fail(
            "'max_tokens: 0' (a cache pre-warm) generates nothing and cannot be streamed",
            "stream",
        )
    thinking = body.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict) or thinking.get("type") != "disabled"
    ):
        raise _fail(
            "extended thinking is not served by kvgate's engines; omit 'thinking'", "thinking"
        )
    return model, max_tokens, bool(stream)


COUNT_TOKENS_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "cache_control", "thinking"}
)
"""What `POST /v1/messages/count_tokens` takes: a Messages body's prompt, without sampling."""


def parse_count_tokens(raw: bytes, max_prompt_bytes: int) -> ParsedRequest:
    """A count_tokens body, validated as the Messages body it would be (with `max_tokens: 1`)."""
    body = load_json_object(raw)
    unknown = set(body) - COUNT_TOKENS_FIELDS
    if unknown:
        raise _fail(
            f"unknown fields {sorted(unknown)}; /v1/messages/count_tokens accepts "
            f"{', '.join(sorted(COUNT_TOKENS_FIELDS))}"
        )
    return parse_message_body({**body, "max_tokens": 1}, max_prompt_bytes)


def parse_messages(raw: bytes, max_prompt_bytes: int) -> ParsedRequest:
    """Validate an Anthropic Messages body and convert it; see the module docstring."""
    return parse_message_body(load_json_object(raw), max_prompt_bytes)


def parse_message_body(body: dict[str, Any], max_prompt_bytes: int) -> ParsedRequest:
    unknown = set(body) - _FIELDS
    if unknown:
        raise _fail(
            f"unknown fields {sorted(unknown)}; /v1/messages accepts {', '.join(sorted(_FIELDS))}"
        )
    priority = take_priority(body)
    model, max_tokens, stream = _check_top_level(body)
    prewarm = max_tokens == 0
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("'messages' must be a non-empty list", "messages")

    out = _Converter()
    tools, tool_marks = _convert_tools(body["tools"]) if body.get("tools") is not None else ([], [])
    _convert_system(body.get("system"), out)
    for i, message in enumerate(messages):
        _convert_message(message, i, out)
    marks = [*tool_marks, *out.marks]
    if body.get("cache_control") is not None:
        ttl = parse_cache_control(body["cache_control"], "cache_control")
        assert out.last is not None
        auto = Mark(
            ttl,
            "cache_control (automatic, on the last block)",
            out.last.message,
            out.last.tool,
            out.last.num_parts,
            out.last.num_calls,
        )
        if not any(_same_place(auto, m) for m in marks):
            marks.append(auto)
    check_marks(marks)

    upstream: dict[str, Any] = {
        "model": model,
        "messages": annotate_messages(out.messages, out.marks),
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if tools:
        upstream["tools"] = annotate_tools(tools, tool_marks)
    if body.get("cache_control") is not None:
        upstream["cache_control"] = body["cache_control"]
    if body.get("tool_choice") is not None:
        upstream["tool_choice"] = _tool_choice(body["tool_choice"], prewarm)
        if body["tool_choice"].get("disable_parallel_tool_use") is True:
            upstream["parallel_tool_calls"] = False
    _sampling(body, upstream)
    try:
        rendered = render_chat(out.messages, tools or None).encode()
    except NestingError as exc:
        raise _fail(str(exc), "messages") from None
    if len(rendered) > max_prompt_bytes:
        raise _fail(
            f"the prompt is {len(rendered)} bytes; the maximum is {max_prompt_bytes}", "messages"
        )
    breakpoints = place(marks, out.messages, tools, len(rendered))
    return ParsedRequest(
        CHAT,
        model,
        upstream,
        rendered,
        stream,
        True,
        breakpoints=breakpoints,
        prewarm=prewarm,
        priority=priority,
    )


def _same_place(a: Mark, b: Mark) -> bool:
    return (a.message, a.tool, a.num_parts, a.num_calls) == (
        b.message,
        b.tool,
        b.num_parts,
        b.num_calls,
    )
