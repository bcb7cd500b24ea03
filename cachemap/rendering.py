"""One canonical rendering of what the engine will see: tools → system → messages.

Routers that hash raw JSON while the engine caches chat-templated tokens see no overlap
(sglang PR #27386). kvgate hashes one canonical text instead, built from an OpenAI-shaped chat
request (the Anthropic and gRPC front ends convert to that shape first, so one conversation maps
to the same blocks through every API). The layout is ChatML-like:

    <|im_start|>tools\\n[...tools as canonical JSON...]<|im_end|>\\n      (only with tools)
    <|im_start|>system\\nYou are ...<|im_end|>\\n
    <|im_start|>user\\nHello<|im_end|>\\n
    <|im_start|>assistant\\nHi<|tool_call|>{"arguments":{},"id":"c1","name":"ls"}<|im_end|>\\n
    <|im_start|>tool\\n<|tool_call_id|>c1\\n...<|im_end|>\\n
    <|im_start|>assistant\\n                                             (generation prompt)

Invariants:
- Prefix-monotone: appending messages to a conversation appends to its rendering, and the
  generation prompt of turn k is a prefix of the assistant message that turn k+1 carries.
- Canonical JSON: sorted keys, compact separators, so key order in a client's JSON never
  splits the tree. Tool-call arguments that parse as JSON are re-serialized canonically.
- A string content and a list of text parts with the same text render identically.
- Cache hints (`MARK_KEYS` on tools and content parts) are not rendered: they change what a
  request is billed, not what the engine sees, so a marked and an unmarked request share blocks.
- JSON nests at most `MAX_JSON_DEPTH` levels (the front ends check bodies with `too_deep`; a
  tool call's arguments, JSON inside a string, are checked here): deeper input is a
  `NestingError`, never a recursion failure in a serializer.

It is not an engine's chat template: a real model's template (and the simulated engine's,
loadgen/engine/model/) renders tools, tool calls and content parts differently, so byte blocks
and token blocks describe the same conversation but not the same text (docs/engine.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

MARK_KEYS = ("cache_control", "prompt_cache_breakpoint")
"""Cache hints a client may put on a tool, a message or a content part (Anthropic, OpenAI 5.6)."""
IM_START = "<|im_start|>"
IM_END = "<|im_end|>\n"
GENERATION_PROMPT = IM_START + "assistant\n"
MAX_JSON_DEPTH = 64
"""How deep request JSON may nest (objects and arrays). orjson serializes at most 254 levels and
Python's json stops near 1,000, so deeper input would break the upstream payload or this
rendering; real requests stay far below (a tool's JSON Schema, the deepest, rarely reaches 20)."""


class NestingError(ValueError):
    """JSON nested deeper than `MAX_JSON_DEPTH` (the front ends answer a 400)."""


_ORJSON_MAX_DEPTH = 254
"""orjson's recursion guard: it serializes at most 254 nested levels and raises TypeError
("Recursion limit reached") past them (pinned by tests/cachemap/test_rendering.py)."""


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` nests more than `limit` objects or arrays deep.

    At C speed: wrapped in `254 - limit` arrays, a value deeper than `limit` passes orjson's
    guard, so one serialization answers (~12 µs for a 100-message chat, where a Python walk of
    the tree took ~160 µs). A value orjson cannot serialize for another reason (an integer
    beyond 64 bits) is walked instead.

    Before that, a value of at most `limit` objects and arrays cannot nest deeper than `limit`:
    counting them (stopping past `limit`) answers for most bodies in a microsecond — one long
    message, whose serialization is the whole ~80 KB, is 3 containers."""
    if not isinstance(value, dict | list):
        return False
    if _at_most_containers(value, limit):
        return False
    wrapped = value
    for _ in range(_ORJSON_MAX_DEPTH - limit):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except TypeError as exc:
        if str(exc) == "Recursion limit reached":
            return True
        return _walk_too_deep(value, limit)
    return False


def _loads(text: str) -> Any:
    """`json.loads`, at orjson's speed where orjson agrees: what orjson refuses (ints beyond
    64 bits, NaN, lone surrogates, nesting past its 1,024 levels) goes to `json`, so the value,
    and the hash, are the same either way."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def _brackets(text: str) -> int:
    return text.count("[") + text.count("{")


def _at_most_containers(value: dict[str, Any] | list[Any], most: int) -> bool:
    """Whether `value` holds at most `most` dicts and lists, itself counted (it gives up as
    soon as it has seen more, so a large tree costs no more than `most` of its nodes)."""
    stack: list[Any] = [value]
    seen = 1
    while stack:
        item = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                seen += 1
                if seen > most:
                    return False
                stack.append(child)
    return True


def _walk_too_deep(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace; the only serialization that enters a hash."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # ints beyond 64 bits, which orjson refuses
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def render_content(content: Any) -> str:
    """A message's content: a string, null, or a list of parts (text, image_url, others)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            pieces.append(part.get("text", ""))
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url", "") if isinstance(image, Mapping) else str(image)
            pieces.append("<|image|>" + url)
        else:
            pieces.append("<|part|>" + canonical_json(_unmarked(part)))
    return "".join(pieces)


def _unmarked(item: Mapping[str, Any]) -> Mapping[str, Any]:
    if any(key in item for key in MARK_KEYS):
        return {k: v for k, v in item.items() if k not in MARK_KEYS}
    return item


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools block: canonical JSON of the tool list, cache hints left out."""
    return IM_START + "tools\n" + canonical_json([_unmarked(t) for t in tools]) + IM_END


def _render_tool_call(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    arguments: Any = function.get("arguments", "")
    if isinstance(arguments, str):
        try:
            parsed = _loads(arguments) if arguments else {}
        except RecursionError:
            raise NestingError(
                f"tool-call arguments nest deeper than {MAX_JSON_DEPTH} levels"
            ) from None
        except ValueError:  # not JSON: hash the string exactly as sent
            pass
        else:
            # text with fewer brackets than the limit cannot nest past it (a count at memchr
            # speed: the check itself wraps the value in ~190 lists, ~30 µs a call)
            if _brackets(arguments) > MAX_JSON_DEPTH and too_deep(parsed):
                raise NestingError(f"tool-call arguments nest deeper than {MAX_JSON_DEPTH} levels")
            arguments = parsed
    body = {"id": call.get("id", ""), "name": function.get("name", ""), "arguments": arguments}
    return "<|tool_call|>" + canonical_json(body)


def render_message(message: Mapping[str, Any]) -> str:
    return "".join(_message_parts(message))


def _message_parts(message: Mapping[str, Any]) -> list[str]:
    """A message's rendering as pieces to join: its content, often most of a prompt, is
    copied once, by the caller's join, not by each concatenation around it."""
    role = str(message.get("role", ""))
    parts = [IM_START, role]
    name = message.get("name")
    if name:
        parts += (" name=", str(name))
    parts.append("\n")
    if role == "tool":
        parts += ("<|tool_call_id|>", str(message.get("tool_call_id", "")), "\n")
    parts.append(render_content(message.get("content")))
    for call in message.get("tool_calls") or ():
        parts.append(_render_tool_call(call))
    parts.append(IM_END)
    return parts


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The canonical text of a chat request, in the order tools → system → messages."""
    parts: list[str] = []
    if tools:
        parts.append(render_tools(tools))
    for message in messages:
        parts += _message_parts(message)
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def render_completion(prompt: str | Sequence[int]) -> str:
    """The canonical text of a completion prompt: the string itself, or its token ids."""
    if isinstance(prompt, str):
        return prompt
    return "<|token_ids|>" + " ".join(str(int(t)) for t in prompt)
