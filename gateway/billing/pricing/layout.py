"""Where a prompt's blocks and cache marks sit, from an OpenAI-shaped request and its
canonical rendering (`parsed.rendered`), and how byte offsets become token counts.

Blocks, in the rendering's order tools → system → messages: the tools (one block), then each
message, and inside a message with several content parts, each part. A block ends at its last
byte; a message that is followed by the generation prompt's bytes (`<|im_start|>assistant\\n`,
which is also how the next assistant message begins) owns them, so turn k's whole prompt and
turn k+1's prefix end at the same offset. Block keys chain the bytes: equal keys ⇔ equal prefixes.

Marks (any front end may set them; the gateway strips them before forwarding):
- `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a tool, a message or a content
  part (Anthropic); at the top level, the automatic breakpoint on the last block;
- `prompt_cache_breakpoint: true | {"ttl": "30m" | "12h"}` on a message or part (OpenAI 5.6), and
  `prompt_cache_options: {"mode": "explicit" | "implicit", "ttl": ...}` at the top level.

Token positions: proportional, `tokens(b) = round_half_up(b · N / B)` for byte offset b of a
B-byte rendering with N prompt tokens (the engine's count), or exact piece counts when a
tokenizer is configured. If the tokens-per-byte density of the text lies in [ρ_min, ρ_max],
the proportional estimate at offset x is off by at most (ρ_max − ρ_min)·x·(B − x)/B + ½ token
(≤ (ρ_max − ρ_min)·B/4 + ½, worst in the middle, zero at both ends); totals U + W + R = N are
always exact.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import mmh3

from cachemap.rendering import (
    GENERATION_PROMPT,
    IM_END,
    MARK_KEYS,
    render_message,
    render_tools,
)
from gateway.billing.pricing.model import BillingError
from gateway.request.cache_control import TOP_LEVEL_KEYS, strip_marks

__all__ = ["TOP_LEVEL_KEYS", "strip_marks"]

_GP = GENERATION_PROMPT.encode()
_IMPLICIT_ROLES = frozenset({"user", "tool", "function"})
_ROOT = b"kvgate-billing-bytes/v1"
MODES = ("implicit", "explicit")

Tokenizer = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class ByteBlock:
    end: int
    """Byte offset (exclusive) where the block ends in the rendering."""
    mark: str | None
    """"" or a TTL name when the block carries a cache mark; None otherwise."""
    eligible: bool
    """Ends a user or tool message (OpenAI's implicit breakpoint)."""


@dataclass(frozen=True, slots=True)
class Layout:
    blocks: tuple[ByteBlock, ...]
    keys: tuple[bytes, ...]
    num_bytes: int
    explicit_mode: bool = False
    auto_ttl: str | None = None
    default_tier: str | None = None
    """`prompt_cache_options.ttl`: the tier of marks (and the implicit one) that name none."""
    marked: bool = False
    """Some block or the top level carries a billing-only field (validate, then strip)."""


def _mark(holder: Any, where: str) -> str | None:
    if not isinstance(holder, Mapping):
        return None
    found: str | None = None
    control = holder.get("cache_control")
    if control is not None:
        if not isinstance(control, Mapping) or control.get("type", "ephemeral") != "ephemeral":
            raise BillingError(f'{where}.cache_control must be {{"type": "ephemeral"}}')
        ttl = control.get("ttl", "")
        if not isinstance(ttl, str):
            raise BillingError(f"{where}.cache_control.ttl must be a string such as '5m' or '1h'")
        found = ttl
    marker = holder.get("prompt_cache_breakpoint")
    if marker is not None and marker is not False:
        if marker is True:
            found = found or ""
        elif isinstance(marker, Mapping) and isinstance(marker.get("ttl", ""), str):
            found = found or str(marker.get("ttl", ""))
        else:
            raise BillingError(f'{where}.prompt_cache_breakpoint must be true or {{"ttl": ...}}')
    return found


def _chain(rendered: bytes, ends: Sequence[int]) -> tuple[bytes, ...]:
    keys = []
    parent, start = _ROOT, 0
    for end in ends:
        parent = mmh3.mmh3_x64_128_digest(parent + rendered[start:end])
        keys.append(parent)
        start = end
    return tuple(keys)


def _top_level(body: Mapping[str, Any]) -> tuple[bool, str | None, str | None]:
    auto = _mark(body, "body") if "cache_control" in body else None
    options = body.get("prompt_cache_options")
    explicit, tier = False, None
    if options is not None:
        if not isinstance(options, Mapping):
            raise BillingError("'prompt_cache_options' must be an object")
        mode = options.get("mode", "implicit")
        if mode not in MODES:
            raise BillingError(f"prompt_cache_options.mode must be one of {', '.join(MODES)}")
        explicit = mode == "explicit"
        ttl = options.get("ttl")
        if ttl is not None and not isinstance(ttl, str):
            raise BillingError("prompt_cache_options.ttl must be a string such as '30m'")
        tier = ttl
    return explicit, auto, tier


def chat_layout(body: Mapping[str, Any], rendered: bytes) -> Layout:
    """The blocks of a chat request whose canonical rendering is `rendered`."""
    blocks: list[ByteBlock] = []
    offset = 0
    tools = body.get("tools")
    if tools:
        text = render_tools(tools).encode()
        offset += len(text)
        marks = [_mark(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
        mark = next((m for m in reversed(marks) if m is not None), None)
        blocks.append(ByteBlock(offset, mark, eligible=False))
    for i, message in enumerate(body.get("messages") or ()):
        where = f"messages[{i}]"
        start = offset
        offset += len(render_message(message).encode())
        content = message.get("content")
        mark = _mark(message, where)
        if isinstance(content, list) and content:
            for j, part in enumerate(content[:-1]):
                partial = render_message(
                    {**message, "content": content[: j + 1], "tool_calls": None}
                )
                end = start + len(partial.encode()) - len(IM_END.encode())
                blocks.append(ByteBlock(end, _mark(part, f"{where}.content[{j}]"), eligible=False))
            last = _mark(content[-1], f"{where}.content[{len(content) - 1}]")
            mark = mark if mark is not None else last
        end = offset
        if rendered[end : end + len(_GP)] == _GP:
            end += len(_GP)
        blocks.append(ByteBlock(end, mark, eligible=message.get("role") in _IMPLICIT_ROLES))
    if offset + len(_GP) != len(rendered):
        # not the canonical rendering of this body (a front end rendered differently): one block
        blocks = [ByteBlock(len(rendered), None, eligible=True)]
    explicit, auto, tier = _top_level(body)
    ends = [b.end for b in blocks]
    marked = any(b.mark is not None for b in blocks) or any(k in body for k in TOP_LEVEL_KEYS)
    return Layout(
        tuple(blocks), _chain(rendered, ends), len(rendered), explicit, auto, tier, marked
    )


def completion_layout(body: Mapping[str, Any], rendered: bytes) -> Layout:
    """A completion prompt is one block (a user's text), marked only at the top level."""
    explicit, auto, tier = _top_level(body)
    block = ByteBlock(len(rendered), None, eligible=True)
    marked = any(k in body for k in TOP_LEVEL_KEYS)
    keys = _chain(rendered, [len(rendered)])
    return Layout((block,), keys, len(rendered), explicit, auto, tier, marked)


def has_marks(body: Mapping[str, Any]) -> bool:
    """Whether the body carries any billing-only field (cheap: stops at the first)."""
    if any(key in body for key in TOP_LEVEL_KEYS):
        return True
    for holder in (*(body.get("tools") or ()), *(body.get("messages") or ())):
        if isinstance(holder, Mapping):
            if any(key in holder for key in MARK_KEYS):
                return True
            content = holder.get("content")
            if isinstance(content, list) and any(
                isinstance(p, Mapping) and any(k in p for k in MARK_KEYS) for p in content
            ):
                return True
    return False


# -- byte offsets → tokens ----------------------------------------------------------------------
def proportional_ends(ends: Sequence[int], num_bytes: int, num_tokens: int) -> list[int]:
    """round_half_up(b · N / B) for each offset b (exact integer arithmetic)."""
    if num_bytes <= 0:
        return [num_tokens for _ in ends]
    return [(2 * e * num_tokens + num_bytes) // (2 * num_bytes) for e in ends]


DEFAULT_COUNTED_BLOCKS = 32_768
"""Blocks whose token count `BlockCounts` keeps (~5 MB): a few hundred live conversations'."""


class BlockCounts:
    """Token counts of blocks already counted, by (isolation scope, the block's chain key).

    A conversation resends its whole prompt at every step; without this each step counted every
    block again (a 50-step session counted its first blocks 50 times). A block's count depends
    on its own bytes only, and its chain key names those bytes behind one exact prefix, so a
    continuation counts only what it adds. The scope is part of the key: one tenant's request
    never runs faster because another's counted the same text. Bounded: least recently used
    out first."""

    def __init__(self, max_entries: int = DEFAULT_COUNTED_BLOCKS) -> None:
        self.max_entries = max_entries
        self._counts: OrderedDict[tuple[str, bytes], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, scope: str, key: bytes) -> int | None:
        found = self._counts.get((scope, key))
        if found is not None:
            self._counts.move_to_end((scope, key))
        return found

    def put(self, scope: str, key: bytes, count: int) -> None:
        self._counts[(scope, key)] = count
        if len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)


def counted_ends(
    rendered: bytes,
    ends: Sequence[int],
    count: Tokenizer,
    *,
    keys: Sequence[bytes] = (),
    cache: BlockCounts | None = None,
    scope: str = "",
) -> list[int]:
    """Cumulative token counts of each block's bytes, counted piece by piece (with `cache`
    and the blocks' chain `keys`, a block counted before under `scope` is not counted again)."""
    out, total, start = [], 0, 0
    cached = cache is not None and len(keys) == len(ends)
    for i, end in enumerate(ends):
        n = cache.get(scope, keys[i]) if cache is not None and cached else None
        if n is None:
            n = count(rendered[start:end].decode("utf-8", errors="replace"))
            if cache is not None and cached:
                cache.put(scope, keys[i], n)
        total += n
        out.append(total)
        start = end
    return out


def fit_to_total(counted: Sequence[int], num_tokens: int) -> list[int]:
    """Counted ends against the engine's N: the last block absorbs the difference (a chat
    template's extra tokens), every end clamped into [0, N]."""
    if not counted:
        return []
    shift = num_tokens - counted[-1]
    out = [min(max(c, 0), num_tokens) for c in counted]
    out[-1] = min(max(counted[-1] + shift, 0), num_tokens)
    return out


def load_tokenizer(spec: str) -> Tokenizer:
    """A `module:function` taking text and returning its token count (e.g.
    `loadgen.engine.tokenizer:count_tokens` for the simulated engine)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"billing tokenizer {spec!r} must be given as module:function")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load billing tokenizer {spec!r}: {exc}") from None
    if not callable(function):
        raise ValueError(f"billing tokenizer {spec!r} is not callable")
    return function  # type: ignore[no-any-return]


def round_tokens(value: Decimal) -> int:
    return int(value.to_integral_value(rounding=ROUND_HALF_UP))
