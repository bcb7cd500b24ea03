"""Images in a chat: what identifies each one, where its placeholder tokens sit, and the extra
keys of the KV blocks they fall in — vLLM's multimodal prefix caching, shared by the simulated
engine and the gateway's precise mode so both key an image the same way.

vLLM (`vllm/v1/core/kv_cache_utils.py`) keys a block by its parent's hash, its token ids and
its *extra keys*: the LoRA name, then one `(identifier, offset)` per multimodal input whose
placeholder range overlaps the block (`offset` = where the input starts relative to the
block's first token, negative when it began in an earlier block), then `cache_salt` in block
0. Placeholder tokens are the same id for every image, so without the identifier two images
would share every cached block. `BlockStored.extra_keys` carries the same per-block list.

Here, as there:

    chat part {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
      ──rendering (cachemap.chat_template)──▶ one IMAGE_TOKEN in the message's text
      ──tokenize──▶ one placeholder id ──expand──▶ `tokens_per_image` copies: a Placeholder
      (identifier, offset, length) per image, in the order the placeholders appear
    block i of the ids ──blocks_mm_keys──▶ ((identifier, offset - i × block_size), ...)

The identifier is content-derived: the SHA-256 of the decoded image bytes (vLLM hashes the
item's bytes with the model id, blake3 by default; both sides here are ours, so they only need
to agree). It is not salted itself: it only ever enters a key inside a chain rooted in the
request's `cache_salt` (`precise_root`), so two tenants' equal images still share no key.
Only `data:` URLs are accepted: nothing is fetched (no network), so a remote URL is a 400 that
says so. A part that cannot be decoded, or (in a chat with images) a placeholder typed into its
text beyond them, is a 400 too (`ChatTemplateError`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachemap.chat_template import ChatTemplateError

DEFAULT_TOKENS_PER_IMAGE = 64
"""Placeholder tokens one image expands into (`--mm-tokens-per-image`, `mm_tokens_per_image`):
a 224×224 image in Qwen2-VL (14-pixel patches merged 2×2: 8×8) — four 16-token blocks. A real
processor's count depends on the image's size; a fixed count is what the simulation needs."""

MMKey = tuple[str, int]
"""One multimodal extra key of a block: (identifier, offset of the input from the block's first
token), vLLM's `(mm_feature.identifier, offset - start_token_idx)`."""


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One image's span in the prompt's token ids (vLLM's `PlaceholderRange` + identifier)."""

    identifier: str
    offset: int
    length: int


def image_bytes(part: Mapping[str, Any], where: str) -> bytes:
    """The bytes of an `image_url` part's image: a `data:` URL's base64 payload."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else None
    if not isinstance(url, str):
        raise ChatTemplateError(f"{where}: an image_url part needs a string 'image_url.url'")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ChatTemplateError(
            f"{where}: image URLs are not fetched (no network; got a {scheme!r} URL): send the "
            "image inline as a data:image/...;base64,... URL"
        )
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.endswith(";base64") or not header.startswith("image/"):
        raise ChatTemplateError(f"{where}: an image data URL must be data:image/<type>;base64,...")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ChatTemplateError(f"{where}: the image data URL is not valid base64") from None
    if not data:
        raise ChatTemplateError(f"{where}: the image data URL is empty")
    return data


def image_identifier(data: bytes) -> str:
    """An image's identity (module docstring): the SHA-256 of its bytes, as hex."""
    return hashlib.sha256(data).hexdigest()


def has_parts(messages: Any) -> bool:
    """Whether any message's content is a list of parts (where images can be): one type test
    per message, ~0.1 µs (an agent's chat of hundreds of plain turns pays ~20 µs)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        if type(message) is dict:
            if type(message.get("content")) is list:
                return True
        elif not isinstance(message, Mapping) or isinstance(message.get("content"), list):
            return True
    return False


def image_parts(messages: Sequence[Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, part) of every `image_url` part, in the order the rendering places them
    (message by message, part by part)."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                out.append((f"messages[{i}].content[{j}]", part))
    return out


def identify(part: Mapping[str, Any], where: str) -> str:
    """An `image_url` part's identifier (`image_bytes`, then `image_identifier`)."""
    return image_identifier(image_bytes(part, where))


def image_identifiers(
    messages: Sequence[Any], identify: Callable[[Mapping[str, Any], str], str] = identify
) -> list[str]:
    """The identifier of every image of a chat, in rendering order (`ChatTemplateError` for a
    part that is not an inline image); `identify` may be a cache in front of `identify`."""
    return [identify(part, where) for where, part in image_parts(messages)]


def expand(
    ids: Sequence[int], placeholder_id: int, identifiers: Sequence[str], tokens_per_image: int
) -> tuple[list[int], tuple[Placeholder, ...]]:
    """The ids with each placeholder id repeated `tokens_per_image` times, and each image's
    span (the k-th placeholder is the k-th image). Their counts must agree: a placeholder typed
    into a tool's text would otherwise be taken for an image (`ChatTemplateError`)."""
    positions = [i for i, t in enumerate(ids) if t == placeholder_id]
    if len(positions) != len(identifiers):
        raise ChatTemplateError(
            f"the prompt has {len(positions)} image placeholders for {len(identifiers)} images "
            "(the placeholder text is reserved for images)"
        )
    if not positions:
        return list(ids), ()
    out: list[int] = []
    spans: list[Placeholder] = []
    start = 0
    for position, identifier in zip(positions, identifiers, strict=True):
        out.extend(ids[start:position])
        spans.append(Placeholder(identifier, len(out), tokens_per_image))
        out.extend([placeholder_id] * tokens_per_image)
        start = position + 1
    out.extend(ids[start:])
    return out, tuple(spans)


def blocks_mm_keys(
    spans: Sequence[Placeholder], num_blocks: int, block_size: int, first: int = 0
) -> dict[int, tuple[MMKey, ...]]:
    """Block index -> its multimodal extra keys, for blocks first..num_blocks-1 that have any."""
    out: dict[int, tuple[MMKey, ...]] = {}
    for span in spans:
        low = max(span.offset // block_size, first)
        high = min((span.offset + span.length - 1) // block_size + 1, num_blocks)
        for i in range(low, high):
            out[i] = (*out.get(i, ()), (span.identifier, span.offset - i * block_size))
    return out


def mm_key_bytes(keys: Sequence[MMKey]) -> bytes:
    """The bytes a block's multimodal keys add to its own key (`chain_hashes`' extras): each
    identifier and its offset, length-prefixed so no two lists share an encoding."""
    out = bytearray(b"mm")
    for identifier, offset in keys:
        raw = identifier.encode()
        out += struct.pack("<Iq", len(raw), offset) + raw
    return bytes(out)


def extras_of(
    spans: Sequence[Placeholder], num_blocks: int, block_size: int, first: int = 0
) -> dict[int, bytes]:
    """Block index -> the bytes its multimodal keys add (`mm_key_bytes`), for the blocks that
    have any."""
    return {
        i: mm_key_bytes(k) for i, k in blocks_mm_keys(spans, num_blocks, block_size, first).items()
    }
