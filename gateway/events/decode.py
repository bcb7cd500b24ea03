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

Two ways in, one semantics. A batch of known events all in one layout (maps, or tagged arrays:
vLLM's two encodings and SGLang's) is decoded by msgspec straight into structs whose fields
are in the array order (`_layouts`, the last layout that worked tried first), then checked by
the same code as the tolerant path; anything else (an unknown event type, a batch as a map,
layouts mixed, a payload that is not one) goes the tolerant way: msgspec's untyped decode,
each event's fields picked by name or place (`_tolerant`). The typed way skips a dict per
event and the lookups of its fields: ~4.5 against ~10 us an event (py-spy of `kvgate
bench-cpu`: decoding was ~45 of the ~110 samples a precise gateway spent on its feed). It
also keeps a stored event's token ids as their msgpack bytes (`msgspec.Raw`), read into the
`array("I")` by `unpack_u32` (compiled in `cachemap._native`): no int object made a token,
0.36 -> 0.16 ms of decoding a request at bench point 2 (`tools.events_replay`). Ids it does
not take (any other type, a value out of range) make the typed way fail over to the tolerant
one, which says what is wrong.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, cast

import msgspec

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
from cachemap.native import NATIVE

_NIL = msgspec.Raw(b"\xc0")


MAX_HASH_BYTES = 64
"""The longest block hash accepted as bytes (vLLM's sha256 hashes are 32 bytes, its ints and
SGLang's are 64-bit): a longer one makes the batch malformed. Unbounded, one engine's hash of
any length reached the shared index's writer, whose map cannot hold it (issue 45, item 7)."""

_Hashes = list[int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]]
"""A list of block hashes as `_hashes` checks them, checked by msgspec as it decodes the fast
layouts (a batch it fails goes the tolerant way, which says what is wrong): a second pass
over ~1,400 hashes a request at bench point 2 was ~0.1 ms of a precise gateway's CPU."""


class _StoredFields(msgspec.Struct, gc=False):
    """A BlockStored's fields in their array order (the hashes `_Hashes`, any other value:
    `_stored` checks them). The token ids are kept as their msgpack bytes, read straight into
    an `array("I")` by `unpack_u32` (an int object a token was ~80% of decoding bench point
    2's batches)."""

    block_hashes: _Hashes | None = None
    parent_block_hash: Any = None
    token_ids: msgspec.Raw = _NIL
    block_size: Any = None
    lora_id: Any = None
    medium: Any = None
    lora_name: Any = None
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: _Hashes | None = None
    medium: Any = None
    group_idx: Any = None


class _MapStored(_StoredFields, tag_field="type", tag="BlockStored"):
    pass


class _MapRemoved(_RemovedFields, tag_field="type", tag="BlockRemoved"):
    pass


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class _ArrayStored(_StoredFields, array_like=True, tag="BlockStored"):
    pass


class _ArrayRemoved(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _BatchOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: Any
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: Any = None


class _BatchOfArrays(msgspec.Struct, array_like=True, gc=False):
    ts: Any
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: Any = None


_STORED_FIELDS = _StoredFields.__struct_fields__
_REMOVED_FIELDS = _RemovedFields.__struct_fields__
_layouts: tuple[msgspec.msgpack.Decoder[Any], ...] = (
    msgspec.msgpack.Decoder(_BatchOfMaps),
    msgspec.msgpack.Decoder(_BatchOfArrays),
)
"""The fast layouts (module docstring), the last to decode a batch first."""
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
    global _layouts
    for decoder in _layouts:  # the layout that decoded the last batch first
        try:
            raw = decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        if decoder is not _layouts[0]:
            _layouts = (decoder, *(d for d in _layouts if d is not decoder))
        try:
            return _batch(raw.ts, raw.events, raw.data_parallel_rank)
        except MalformedBatch:
            break  # the tolerant path raises its own error (the same check)
    return _tolerant(payload)


def _tolerant(payload: bytes) -> Batch:
    """Any payload, as Python objects: every shape the module docstring accepts."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception as exc:  # any failure to decode is a malformed batch
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise MalformedBatch("a batch is [ts, events, rank?]")
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(raw[1], list):
        raise MalformedBatch("a batch's ts must be a number and its events a list")
    events: list[Any] = []
    unknown = 0
    for item in raw[1]:
        event = _event(item)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return _batch(raw[0], events, rank, unknown)


def _batch(ts: Any, events: list[Any], rank: Any, unknown: int = 0) -> Batch:
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedBatch("a batch's ts must be a number and its events a list")
    if not math.isfinite(ts):  # a NaN or an infinity poisoned the lag statistics (issue 45)
        raise MalformedBatch("a batch's ts must be finite")
    if rank is not None and not isinstance(rank, int):
        raise MalformedBatch("a batch's rank must be an integer")
    out: list[CacheEvent] = []
    for event in events:  # the fast layouts' structs, or the tolerant path's events
        kind = type(event)
        if kind is _MapStored or kind is _ArrayStored:
            out.append(_stored(*msgspec.structs.astuple(event), checked=True))
        elif kind is _MapRemoved or kind is _ArrayRemoved:
            out.append(_removed(event.block_hashes, event.medium, event.group_idx, checked=True))
        elif kind is _MapCleared or kind is _ArrayCleared:
            out.append(AllBlocksCleared())
        else:
            out.append(event)
    return Batch(float(ts), out, rank, unknown)


def _fields(item: Any, names: Sequence[str]) -> list[Any]:
    if isinstance(item, dict):
        return [item.get(n) for n in names]
    values = list(item[1 : len(names) + 1])
    return values + [None] * (len(names) - len(values))


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
        return _removed(*_fields(item, _REMOVED_FIELDS))
    if kind == "BlockStored":
        return _stored(*_fields(item, _STORED_FIELDS))
    return None


def _removed(
    block_hashes: Any, medium: Any, group_idx: Any, *, checked: bool = False
) -> BlockRemoved:
    return BlockRemoved(_hashes(block_hashes, checked), tier_of(medium), _int(group_idx))


def _stored(
    block_hashes: Any,
    parent: Any,
    token_ids: Any,
    block_size: Any,
    lora_id: Any,
    medium: Any,
    lora_name: Any,
    extra_keys: Any,
    group_idx: Any,
    kind: Any,
    window: Any,
    *,
    checked: bool = False,
) -> BlockStored:
    """A BlockStored from its fields in `_STORED_FIELDS`' order, checked (`checked`: the
    hashes already are, `_Hashes`)."""
    metadata = lora_name if isinstance(lora_name, dict) else None
    if metadata is not None:
        lora_name = None
    elif lora_name is not None and not isinstance(lora_name, str):
        raise MalformedBatch("BlockStored.lora_name must be a string")
    if lora_name is None and lora_id is not None:  # an adapter known only by its id
        lora_name = f"{UNNAMED_ADAPTER}{lora_id}"
    hashes = _hashes(block_hashes, checked)
    if type(token_ids) is msgspec.Raw:  # the fast layouts'
        ids = _UNPACK_U32(token_ids)
        if ids is None:  # the tolerant path says what is wrong
            raise MalformedBatch("BlockStored.token_ids must be a list of integers")
    elif not isinstance(token_ids, list):
        raise MalformedBatch("BlockStored.token_ids must be a list of integers")
    else:
        try:  # checked in C (a Python step per token was ~4% of a precise gateway at point 2)
            ids = array.array("I", token_ids)
        except (TypeError, OverflowError):  # not an int, or outside 0..2**32-1
            raise MalformedBatch("BlockStored.token_ids must be a list of integers") from None
    if type(block_size) is not int or block_size <= 0:
        raise MalformedBatch("BlockStored.block_size must be a positive integer")
    if parent is not None:
        parent = _hashes([parent])[0]
    salt = _salt(metadata, extra_keys, lora_name) if parent is None else None
    full = window is None and (kind is None or "full" in str(kind).lower())
    return BlockStored(
        hashes,
        parent,
        ids,
        block_size,
        tier_of(medium),
        salt,
        lora_name,
        _int(group_idx),
        full,
        None if metadata is not None or extra_keys is None else _mm_keys(extra_keys, len(hashes)),
    )


def unpack_u32(raw: msgspec.Raw | bytes) -> array.array[int] | None:
    """The msgpack array of integers in 0..2**32-1 (true and false as 1 and 0, as
    `array("I", ...)` takes them) in `raw` as an `array("I")`; None for anything else. The
    definition of `cachemap._native.unpack_u32`, which reads the bytes with no int object
    made a token."""
    try:
        value = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(value, list):
        return None
    try:
        return array.array("I", value)
    except (TypeError, OverflowError):
        return None


_UNPACK_U32 = NATIVE.unpack_u32 if NATIVE is not None else unpack_u32


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


def _hashes(value: Any, checked: bool = False) -> list[EngineHash]:
    """Each an int (not a bool; msgpack's are 64-bit) or bytes of at most `MAX_HASH_BYTES`:
    checked by type in C loops (a Python step per hash was ~8% of decoding a conversation's
    events), and by length only when there are bytes. `checked`: a list the fast layouts'
    decode already checked (`_Hashes`), taken as it is."""
    if checked and value is not None:
        return cast(list[EngineHash], value)
    if not isinstance(value, list):
        raise MalformedBatch("block_hashes must be a list of integers or bytes")
    types = set(map(type, value))
    if not _HASH_TYPES.issuperset(types):
        raise MalformedBatch("block_hashes must be a list of integers or bytes")
    if bytes in types and max(len(h) for h in value if type(h) is bytes) > MAX_HASH_BYTES:
        raise MalformedBatch(f"a block hash must be at most {MAX_HASH_BYTES} bytes")
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
