"""Validation of OpenAI-shaped request bodies, and what the director needs from them.

Hand-written rather than pydantic on the hot path (the whole request costs less than one
pydantic model of a long conversation); the same shapes are declared for the OpenAPI document in
`schemas`. Every rule here answers a bad request with a 400 that names the field: anything that
passes is something an engine accepts, so a client's mistake never becomes a 5xx.
Only the fields in `gateway.api.openai.fields` pass through to the engine (OpenAI's, and
vLLM's sampling extras: top_k, ignore_eos, ...); any other is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from cachemap.rendering import NestingError, render_chat, render_completion
from gateway.api.body import load_json_object, take_priority
from gateway.api.openai.fields import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from gateway.errors import InvalidRequest
from gateway.request.parsed import CHAT, COMPLETION, ParsedRequest

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_NUMBER_FIELDS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
"""OpenAI's ranges for its sampling numbers (an engine given one outside answers its own words,
or samples nonsense)."""


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _fail(f"{where}.content must be a string, null or a list of parts", where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _fail(f"{where}.content[{j}] must be an object with a string 'type'", where)
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise _fail(f"{where}.content[{j}].text must be a string", where)
        if part["type"] == "image_url":
            image = part.get("image_url")
            if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                raise _fail(f"{where}.content[{j}].image_url.url must be a string", where)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _fail("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        # the common shape first, with no string built: an agent's body has hundreds of turns
        if not isinstance(message, dict):
            raise _fail(f"messages[{i}] must be an object", "messages")
        role, content = message.get("role"), message.get("content")
        if (
            role in _ROLES
            and (content is None or type(content) is str)
            and message.get("name") is None
            and message.get("tool_calls") is None
            and (role != "tool" or type(message.get("tool_call_id", "")) is str)
        ):
            continue
        _check_message(message, f"messages[{i}]")


def _check_message(message: dict[str, Any], where: str) -> None:
    role = message.get("role")
    if role not in _ROLES:
        raise _fail(
            f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {role!r}", "messages"
        )
    _check_content(message.get("content"), where)
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise _fail(f"{where}.name must be a string", "messages")
    if role == "tool" and not isinstance(message.get("tool_call_id", ""), str):
        raise _fail(f"{where}.tool_call_id must be a string", "messages")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _fail(f"{where}.tool_calls must be a list", "messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), str)
            or not isinstance(call.get("id", ""), str)
        ):
            raise _fail(
                f"{where}.tool_calls[{j}] must have an id and a function with a string "
                "name and string arguments",
                "messages",
            )


def _check_common(body: dict[str, Any]) -> tuple[str, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("'model' is required and must be a non-empty string", "model")
    if "cache_salt" in body:
        raise _fail(
            "'cache_salt' is set by the gateway from your API key and may not be sent",
            "cache_salt",
        )
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _fail("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _fail("'stream_options' must be an object", "stream_options")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise _fail("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = flag
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise _fail(f"'{name}' must be an integer >= 1", name)
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and (value != 1 or isinstance(value, bool)):
            raise _fail(f"'{name}' must be 1: kvgate routes one generation per request", name)
    _check_sampling(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _fail("'user' must be a string", "user")
    return model, bool(stream), include_usage


def _check_sampling(body: dict[str, Any]) -> None:
    for name, (low, high) in _NUMBER_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _fail(f"'{name}' must be a number", name)
        if not low <= value <= high:
            raise _fail(f"'{name}' must be between {low:g} and {high:g}, got {value:g}", name)


def parse_chat(raw: bytes, max_prompt_bytes: int) -> ParsedRequest:
    body = load_json_object(raw)
    model, stream, include_usage = _check_common(body)
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    _check_messages(messages)
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise _fail("'tools' must be a list of objects", "tools")
    try:
        rendered = render_chat(messages, tools).encode()  # type: ignore[arg-type]
    except NestingError as exc:
        raise _fail(str(exc), "messages") from None
    return _parsed(CHAT, model, body, rendered, stream, include_usage, raw, max_prompt_bytes)


def parse_completion(raw: bytes, max_prompt_bytes: int) -> ParsedRequest:
    body = load_json_object(raw)
    model, stream, include_usage = _check_common(body)
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _fail("'prompt' must not be empty", "prompt")
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt)
    ):
        pass
    else:
        raise _fail(
            "'prompt' must be a non-empty string, a list of one string, or a list of token ids "
            "(batches of prompts are not routed: send one request per prompt)",
            "prompt",
        )
    rendered = render_completion(prompt).encode()
    return _parsed(COMPLETION, model, body, rendered, stream, include_usage, raw, max_prompt_bytes)


def _parsed(
    kind: str,
    model: str,
    body: dict[str, Any],
    rendered: bytes,
    stream: bool,
    include_usage: bool,
    raw: bytes,
    max_prompt_bytes: int,
) -> ParsedRequest:
    """The checked request: its size, its `priority` taken out of the body (the raw bytes are
    forwarded as they came only when nothing was taken out)."""
    _check_size(rendered, max_prompt_bytes)
    priority = take_priority(body)
    return ParsedRequest(
        kind,
        model,
        body,
        rendered,
        stream,
        include_usage,
        priority=priority,
        raw=raw if priority is None else None,
    )


def _check_size(rendered: bytes, max_prompt_bytes: int) -> None:
    if len(rendered) > max_prompt_bytes:
        raise _fail(
            f"the prompt is {len(rendered)} bytes; the maximum is {max_prompt_bytes}", "messages"
        )
