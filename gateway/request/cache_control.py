"""Cache breakpoints (`cache_control`): where they sit in the canonical rendering, their rules,
and the provisional split of usage into Anthropic's cache fields.

The Anthropic and gRPC front ends convert a request to the OpenAI chat shape first, so the
rendering (and so the block hashes and the routing) is the one `cachemap.rendering` gives the
OpenAI endpoints. A client marks breakpoints on the blocks of its own shape; the converter
records each as a `Mark` (a position in the converted messages), and `place` turns the marks
into `Breakpoint`s: byte offsets in the canonical rendering, which is what billing needs
(tokens up to a breakpoint) and what stays true however the client's JSON was laid out.

    <|im_start|>tools\\n[{tool 0},{tool 1}]<|im_end|>\\n
                               ▲ tool 0              ▲ tool 1 (the last tool: the whole segment)
    <|im_start|>user\\nPart one.Part two.<|im_end|>\\n<|im_start|>assistant\\n
                              ▲ part 0             ▲ part 1 (the last part: all of it)

Invariants:
- A mark on the last thing of a segment (the last tool, a message's last part or tool call)
  covers the whole segment, its end marker included; a mark inside a segment ends right after
  the rendered bytes of the marked block. So `rendered[:offset]` of a breakpoint is exactly the
  text the cached prefix holds, and the next turn's rendering starts with it.
- At most `MAX_BREAKPOINTS` per request, and every 1h breakpoint comes before every 5m one in
  the client's order (tools → system → messages): a violation is a 400 that names both marks.
- Breakpoints are returned sorted by offset; equal offsets collapse to one (the first mark's TTL).
- `cache_control` markers never enter the rendering: marking a block does not change its hash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachemap.rendering import IM_END, MARK_KEYS, render_chat, render_message
from gateway.errors import InvalidRequest

MAX_BREAKPOINTS = 4
"""Anthropic's limit per request (automatic breakpoint included)."""
TTL_5M = "5m"
TTL_1H = "1h"
TTLS = (TTL_5M, TTL_1H)
TTL_SECONDS = {TTL_5M: 300, TTL_1H: 3600}

TOP_LEVEL_KEYS = ("cache_control", "prompt_cache_options", "cached_content")
"""Request-level cache hints and billing fields (automatic breakpoint, OpenAI 5.6's options, an
explicit cached-content object): never forwarded to an engine."""

_IM_END_BYTES = len(IM_END.encode())
_TOOLS_CLOSE_BYTES = len(("]" + IM_END).encode())


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A cache breakpoint: the prefix `rendered[:offset]` is cacheable with this TTL."""

    offset: int
    """Bytes of the canonical rendering (UTF-8) up to and including the marked block."""
    ttl: str
    """"5m" or "1h"."""
    where: str
    """The marked block in the client's terms (e.g. "messages[2].content[0]"), for messages."""


@dataclass(frozen=True, slots=True)
class Mark:
    """A `cache_control` marker at a position in a converted (OpenAI-shaped) request.

    `message == -1` marks the tool at index `tool`. Otherwise it marks message `message`: its
    leading `num_parts` content parts and `num_calls` tool calls (tool calls render after the
    content), or the whole message when `num_parts` is None.
    """

    ttl: str
    where: str
    message: int = -1
    tool: int = -1
    num_parts: int | None = None
    num_calls: int = 0


ENGINE_BLOCK_TOKENS = 16
"""vLLM's default KV block (`--block-size`): the granularity of an engine's reported hit."""


def parse_cache_control(value: Any, where: str) -> str:
    """The TTL of a `{"type": "ephemeral", "ttl": "5m" | "1h"}` object (ttl defaults to 5m)."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{where}.cache_control must be an object", param=where)
    if value.get("type") != "ephemeral":
        raise InvalidRequest(
            f"{where}.cache_control.type must be 'ephemeral', got {value.get('type')!r}",
            param=where,
        )
    ttl = value.get("ttl", TTL_5M)
    if ttl not in TTLS:
        raise InvalidRequest(
            f"{where}.cache_control.ttl must be one of {', '.join(TTLS)}, got {ttl!r}",
            param=where,
        )
    unknown = set(value) - {"type", "ttl"}
    if unknown:
        raise InvalidRequest(
            f"{where}.cache_control has unknown fields {sorted(unknown)}; it takes type and ttl",
            param=where,
        )
    return str(ttl)


def check_marks(marks: Sequence[Mark]) -> None:
    """At most `MAX_BREAKPOINTS`; 1h before 5m in the client's order."""
    if len(marks) > MAX_BREAKPOINTS:
        raise InvalidRequest(
            f"a request may have at most {MAX_BREAKPOINTS} cache_control breakpoints, "
            f"found {len(marks)}: {', '.join(m.where for m in marks)}",
            param="cache_control",
        )
    first_5m: Mark | None = None
    for mark in marks:
        if mark.ttl == TTL_5M and first_5m is None:
            first_5m = mark
        elif mark.ttl == TTL_1H and first_5m is not None:
            raise InvalidRequest(
                f"a 1h cache_control breakpoint must come before every 5m one: {mark.where} "
                f"(1h) follows {first_5m.where} (5m)",
                param="cache_control",
            )


def place(
    marks: Sequence[Mark],
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    rendered_bytes: int,
) -> tuple[Breakpoint, ...]:
    """Breakpoints (sorted by offset, deduplicated) for checked marks on a converted request
    whose canonical rendering is `rendered_bytes` long."""
    if not marks:
        return ()
    tools = list(tools or ())
    tools_bytes = len(render_chat([], tools, add_generation_prompt=False).encode()) if tools else 0
    last_message = max(m.message for m in marks)
    starts = [tools_bytes]
    for message in messages[:last_message]:
        starts.append(starts[-1] + len(render_message(message).encode()))
    by_offset: dict[int, Breakpoint] = {}
    for mark in marks:
        offset = _offset(mark, messages, tools, starts)
        assert 0 < offset <= rendered_bytes, (mark, offset, rendered_bytes)
        by_offset.setdefault(offset, Breakpoint(offset, mark.ttl, mark.where))
    return tuple(by_offset[o] for o in sorted(by_offset))


def _offset(
    mark: Mark,
    messages: Sequence[Mapping[str, Any]],
    tools: list[Mapping[str, Any]],
    starts: list[int],
) -> int:
    if mark.message < 0:
        upto = render_chat([], tools[: mark.tool + 1], add_generation_prompt=False).encode()
        return len(upto) - (0 if mark.tool == len(tools) - 1 else _TOOLS_CLOSE_BYTES)
    message = messages[mark.message]
    start = starts[mark.message]
    if mark.num_parts is None:
        return start + len(render_message(message).encode())
    content = message.get("content")
    parts = content[: mark.num_parts] if isinstance(content, list) else content
    calls = (message.get("tool_calls") or [])[: mark.num_calls]
    truncated = {**message, "content": parts, "tool_calls": calls}
    return start + len(render_message(truncated).encode()) - _IM_END_BYTES


# -- the provisional usage split ---------------------------------------------------------------
def provisional_cache_usage(
    engine_usage: Mapping[str, Any],
    breakpoints: Sequence[Breakpoint],
    rendered_bytes: int,
    *,
    prewarm: bool = False,
) -> dict[str, Any]:
    """Anthropic's usage fields, derived from the engine's physical usage.

    Without billing only: with it, the meter's bill (the profile's rules: TTLs from request
    start, minimums, the 20-block lookback) replaces this split (`gateway.api.usage`). Here:

    - A (read) = the engine's cached tokens, at most C;
    - C = the prompt tokens up to the last breakpoint (its byte offset scaled by the prompt's
      tokens per rendered byte); B = the tokens up to the highest 1h breakpoint, at least A;
    - ephemeral_1h = B − A, ephemeral_5m = C − B (Anthropic's mixed-TTL rule), input = the rest.

    An engine reports its hit in whole KV blocks and recomputes at least the prompt's last
    token, and C is scaled from bytes: a hit less than one block (`ENGINE_BLOCK_TOKENS`) short
    of C is the whole prefix read, so a repeated request reports `cache_creation_input_tokens`
    0, as Anthropic does for an identical cached prefix.

    So input + read + creation = prompt_tokens always. `engine_cached_tokens` stays the physical
    hit. A pre-warm (`max_tokens: 0`) generated one token upstream that nobody sees: output 0.
    """
    prompt = _int(engine_usage.get("prompt_tokens"))
    cached = _int(engine_usage.get("engine_cached_tokens"))
    if not cached:
        details = engine_usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0

    def tokens_at(offset: int) -> int:
        return min(prompt, round(prompt * offset / rendered_bytes)) if rendered_bytes else 0

    last = tokens_at(breakpoints[-1].offset) if breakpoints else 0
    read = min(cached, last)
    if read and last - read < ENGINE_BLOCK_TOKENS:
        read = last  # the whole prefix was cached (as Anthropic reports it: creation 0)
    one_hour = [tokens_at(b.offset) for b in breakpoints if b.ttl == TTL_1H]
    upto_1h = max([read, *one_hour])
    write_1h = upto_1h - read
    write_5m = max(last - upto_1h, 0)
    return {
        "input_tokens": prompt - read - write_1h - write_5m,
        "output_tokens": 0 if prewarm else _int(engine_usage.get("completion_tokens")),
        "cache_creation_input_tokens": write_1h + write_5m,
        "cache_read_input_tokens": read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": write_5m,
            "ephemeral_1h_input_tokens": write_1h,
        },
        "engine_cached_tokens": cached,
    }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _hint(ttl: str) -> dict[str, str]:
    return {"type": "ephemeral", "ttl": ttl}


def annotate_messages(messages: list[dict[str, Any]], marks: list[Mark]) -> list[dict[str, Any]]:
    """Copies of the marked messages with `cache_control` on the marked part (or, for a mark
    covering the whole message or its tool calls, on the message): how a front end that
    converts hands its breakpoints to billing (the meter reads the marks on the body; the
    director strips them before forwarding)."""
    out = list(messages)
    for mark in marks:
        if mark.message < 0:
            continue
        message = dict(out[mark.message])
        content = message.get("content")
        if mark.num_parts and isinstance(content, list) and mark.num_calls == 0:
            parts = list(content)
            parts[mark.num_parts - 1] = {
                **parts[mark.num_parts - 1],
                "cache_control": _hint(mark.ttl),
            }
            message["content"] = parts
        else:
            message["cache_control"] = _hint(mark.ttl)
        out[mark.message] = message
    return out


def annotate_tools(tools: list[dict[str, Any]], marks: list[Mark]) -> list[dict[str, Any]]:
    out = list(tools)
    for mark in marks:
        if mark.tool >= 0:
            out[mark.tool] = {**out[mark.tool], "cache_control": _hint(mark.ttl)}
    return out


def strip_marks(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the body without cache hints and billing-only fields, as the engine should
    see it (the one implementation: the billing meter uses it too)."""
    out = {k: v for k, v in body.items() if k not in TOP_LEVEL_KEYS}

    def clean(holder: Any) -> Any:
        if not isinstance(holder, Mapping):
            return holder
        copy = {k: v for k, v in holder.items() if k not in MARK_KEYS}
        if isinstance(copy.get("content"), list):
            copy["content"] = [clean(part) for part in copy["content"]]
        return copy

    for key in ("tools", "messages"):
        if isinstance(out.get(key), list):
            out[key] = [clean(item) for item in out[key]]
    return out
