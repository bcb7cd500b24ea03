"""One tolerant decoder for the engines' KV event batches (msgpack payloads).

Accepted, whatever engine sent them (docs/engine.md has the wire; vLLM's
`vllm/distributed/kv_events.py` and SGLang's `disaggregation/kv_events.py` the sources):

    batch         [ts, [event, ...], data_parallel_rank?]      (a map {"ts", "events", ...} too)
    vLLM map      {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                   "block_size", "lora_id", "medium", "lora_name", "extra_keys"?, "group_idx"?,
                   "kv_cache_spec_kind"?, "kv_cache_spec_sliding_window"?}
                  {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"?}
                  {"type": "AllBlocksCleared"}
    vLLM array    ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
                   lora_name, extra_keys?, group_idx?, kind?, sliding_window?]
                  ["BlockRemoved", hashes, medium, group_idx?], ["AllBlocksCleared"]
    SGLang        ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
                   {"cache_salt": ...}?]   (a map in the 8th place is SGLang's metadata)

Tolerance: unknown keys and trailing elements are ignored, short arrays are padded with
nulls, unknown event types are skipped (counted by the caller). A payload that is not such a
batch, or an event whose fields have the wrong types, raises `MalformedBatch`: the caller
counts the batch and skips it whole (applying half a batch would leave the index wrong in a
way no later event repairs). Token ids must be integers in 0..2**32-1, checked in C as they
are packed (msgpack's true and false pass as 1 and 0).

Media map to tiers: GPU (also none, "cuda", "device"), CPU ("CPU", SGLang's "CPU_PINNED",
"host"), anything else STORAGE (disk, remote stores): an unknown medium is never taken for a
GPU hit. The salt of a chain is block 0's extra keys' last string that is not the LoRA name
(vLLM puts LoRA, multimodal then cache_salt keys in that order), or SGLang's metadata. A
block's multimodal keys are its extra keys' [identifier, offset] pairs (current vLLM's
`(mm_feature.identifier, offset)` tuples; an older vLLM's bare identifier strings would be
taken for the salt, so such blocks match no request rather than a wrong one). The
adapter is `lora_name` (vLLM keys its blocks on the name); one with only a `lora_id` roots its
chain in `UNNAMED_ADAPTER` + id, so it can never pass for the base model's.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from cachemap.events import (
    CPU,
    GPU,
    STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EngineHash,
)

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
UNNAMED_ADAPTER = "\x00lora_id:"
"""The root of a LoRA block whose event names its adapter only by `lora_id` (SGLang, older
vLLM): no request is keyed under it (requests name adapters), so it matches nothing — and never
the base model's chain, which it would if it were indexed with no adapter."""
MM_OFFSETS = range(-(2**63), 2**63)
"""An image's offset from its block's first token (negative for a block after the image's
first) in a block's extra keys: hashed as a signed 64-bit integer
(`cachemap.multimodal.mm_key_bytes`), so one outside it makes the batch malformed (it raised
out of the index before)."""
_GPU_NAMES = frozenset(("gpu", "cuda", "device", "hbm"))
_CPU_NAMES = frozenset(("cpu", "cpu_pinned", "host", "dram"))


class MalformedBatch(ValueError):
    """The payload is not a KV event batch; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[CacheEvent]
    rank: int | None
    num_unknown: int = 0
    """Events of a type this decoder does not know (skipped)."""


def tier_of(medium: Any) -> int:
    if medium is None:
        return GPU
    name = str(medium).lower()
    if name in _GPU_NAMES:
        return GPU
    return CPU if name in _CPU_NAMES else STORAGE


def decode_batch(payload: bytes) -> Batch:
    """The batch in `payload` (see the module docstring), or `MalformedBatch`."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise MalformedBatch("a batch is [ts, events, rank?]")
    ts, body = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(body, list):
        raise MalformedBatch("a batch's ts must be a number and its events a list")
    if rank is not None and not isinstance(rank, int):
        raise MalformedBatch("a batch's rank must be an integer")
    events: list[CacheEvent] = []
    unknown = 0
    for item in body:
        event = _event(item)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return Batch(float(ts), events, rank, unknown)


def _fields(item: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(item, dict):
        return {n: item.get(n) for n in names}
    values = list(item[1:]) + [None] * len(names)
    return dict(zip(names, values, strict=False))


def _event(item: Any) -> CacheEvent | None:
    if isinstance(item, dict):
        kind = item.get("type")
    elif isinstance(item, list | tuple) and item:
        kind = item[0]
    else:
        raise MalformedBatch("an event is a map or a tagged array")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind == "BlockRemoved":
        f = _fields(item, _REMOVED_FIELDS)
        return BlockRemoved(_hashes(f["block_hashes"]), tier_of(f["medium"]), _int(f["group_idx"]))
    if kind == "BlockStored":
        return _stored(item)
    return None


def _stored(item: Any) -> BlockStored:
    f = _fields(item, _STORED_FIELDS)
    metadata = f["lora_name"] if isinstance(f["lora_name"], dict) else None
    lora_name = None if metadata is not None else f["lora_name"]
    if lora_name is not None and not isinstance(lora_name, str):
        raise MalformedBatch("BlockStored.lora_name must be a string")
    if lora_name is None and f["lora_id"] is not None:  # an adapter known only by its id
        lora_name = f"{UNNAMED_ADAPTER}{f['lora_id']}"
    hashes = _hashes(f["block_hashes"])
    if not isinstance(f["token_ids"], list):
        raise MalformedBatch("BlockStored.token_ids must be a list of integers")
    try:  # checked in C (a Python step per token was ~4% of a precise gateway at point 2)
        token_ids = array.array("I", f["token_ids"])
    except (TypeError, OverflowError):  # not an int, or outside 0..2**32-1
        raise MalformedBatch("BlockStored.token_ids must be a list of integers") from None
    block_size = f["block_size"]
    if type(block_size) is not int or block_size <= 0:
        raise MalformedBatch("BlockStored.block_size must be a positive integer")
    parent = f["parent_block_hash"]
    if parent is not None:
        parent = _hashes([parent])[0]
    salt = _salt(metadata, f["extra_keys"], lora_name) if parent is None else None
    kind, window = f["kv_cache_spec_kind"], f["kv_cache_spec_sliding_window"]
    full = window is None and (kind is None or "full" in str(kind).lower())
    return BlockStored(
        hashes,
        parent,
        token_ids,
        block_size,
        tier_of(f["medium"]),
        salt,
        lora_name,
        _int(f["group_idx"]),
        full,
        None if metadata is not None else _mm_keys(f["extra_keys"], len(hashes)),
    )


def _mm_keys(extra_keys: Any, num_blocks: int) -> list[tuple[tuple[str, int], ...]] | None:
    """Per block, its multimodal extra keys: the [identifier, offset] pairs among its extra
    keys (the LoRA name and the salt are strings). None when no block has one."""
    if not isinstance(extra_keys, list):
        return None
    out: list[tuple[tuple[str, int], ...]] = []
    found = False
    for keys in extra_keys[:num_blocks]:
        pairs: tuple[tuple[str, int], ...] = ()
        if isinstance(keys, list | tuple):
            pairs = tuple(
                (k[0], k[1])
                for k in keys
                if isinstance(k, list | tuple)
                and len(k) == 2
                and isinstance(k[0], str)
                and type(k[1]) is int
            )
        if any(offset not in MM_OFFSETS for _, offset in pairs):
            raise MalformedBatch(
                "BlockStored.extra_keys: an image offset must be a signed 64-bit integer"
            )
        found = found or bool(pairs)
        out.append(pairs)
    return out if found else None


_HASH_TYPES = frozenset((int, bytes))


def _hashes(value: Any) -> list[EngineHash]:
    """Each an int (not a bool) or bytes: checked by type in C loops (a Python step per hash
    was ~8% of decoding a conversation's events)."""
    if not isinstance(value, list) or not _HASH_TYPES.issuperset(map(type, value)):
        raise MalformedBatch("block_hashes must be a list of integers or bytes")
    return value


def _int(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int:
        raise MalformedBatch("group_idx must be an integer")
    return value


def _salt(metadata: dict[Any, Any] | None, extra_keys: Any, lora_name: str | None) -> str | None:
    if metadata is not None:
        salt = metadata.get("cache_salt")
        return salt if isinstance(salt, str) else None
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    for key in reversed(first):
        if isinstance(key, str) and key != lora_name:
            return key
    return None
