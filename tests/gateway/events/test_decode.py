"""The tolerant decoder against every encoding the simulated engine publishes, and the shapes
it must survive (vLLM's newer fields, short arrays, garbage)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from cachemap.events import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored
from gateway.events.decode import MalformedBatch, decode_batch
from loadgen.engine.kv_events import ENCODINGS, encode_batch
from loadgen.engine.kvpool import CacheEvent, Cleared, Removed, Stored

H = (b"\x01" * 16, b"\x02" * 16)
EVENTS: list[CacheEvent] = [
    Stored(H, None, tuple(range(32)), 16, "GPU", cache_salt="s1"),
    Stored(H[1:], H[0], tuple(range(16)), 16, "CPU"),
    Removed(H, "GPU"),
    Cleared(),
]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_decodes_to_the_same_events(encoding: str) -> None:
    batch = decode_batch(encode_batch(EVENTS, 12.5, 3, encoding))
    assert batch.ts == 12.5 and batch.rank == 3 and batch.num_unknown == 0
    first, second, removed, cleared = batch.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.cache_salt == "s1" and first.parent is None and first.tier == GPU
    assert list(first.token_ids) == list(range(32)) and len(first.block_hashes) == 2
    assert second.parent == first.block_hashes[0] and second.tier == CPU
    assert second.cache_salt is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == first.block_hashes
    assert isinstance(cleared, AllBlocksCleared)


def test_newer_vllm_fields_and_unknown_keys() -> None:
    sliding = {
        "type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
        "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "LOCAL_DISK",
        "lora_name": "ad", "extra_keys": [["ad", "salt-x"]], "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128,
        "something_new": {"a": 1},
    }  # fmt: skip
    full = dict(sliding, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None)
    batch = decode_batch(msgspec.msgpack.encode([1.0, [sliding, full, {"type": "Future"}]]))
    a, b = batch.events
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert not a.full_attention and b.full_attention and a.group_idx == 1
    assert a.tier == STORAGE and a.cache_salt == "salt-x" and a.lora_name == "ad"
    assert batch.rank is None and batch.num_unknown == 1


def test_short_arrays_are_padded() -> None:
    batch = decode_batch(
        msgspec.msgpack.encode(
            [1, [["BlockStored", [5], None, [2] * 16, 16], ["BlockRemoved", [5]]]]
        )
    )
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.tier == GPU and stored.lora_name is None
    assert isinstance(removed, BlockRemoved) and removed.tier == GPU


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1not msgpack",
        msgspec.msgpack.encode("a string"),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["ts", []]),
        msgspec.msgpack.encode([1.0, [["BlockStored", "not a list", None, [1], 16]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["x"], 16]]]),
        # ids no engine has: before they were caught here, indexing them raised OverflowError
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1] + [2] * 15, 16]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [2**32] + [2] * 15, 16]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [2.0] * 16, 16]]]),
        # an image offset past a signed 64-bit integer (indexing it raised struct.error)
        msgspec.msgpack.encode(
            [1.0, [["BlockStored", [1], None, [2] * 16, 16, None, None, None, [[["i", 2**63]]]]]]
        ),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]),
        msgspec.msgpack.encode([1.0, [42]]),
    ],
)
def test_malformed_batches_raise_one_error(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_a_block_hash_longer_than_any_engines_is_malformed() -> None:
    """Issue 45, item 7: a hash of any length reached the shared index's writer."""
    event = {"type": "BlockStored", "block_hashes": [b"\x01" * 64, 5], "parent_block_hash": None,
             "token_ids": [1] * 32, "block_size": 16}  # fmt: skip
    assert len(decode_batch(msgspec.msgpack.encode([1.0, [event]])).events) == 1
    for long in ({"block_hashes": [b"\x01" * 65]}, {"parent_block_hash": b"\x02" * 300}):
        with pytest.raises(MalformedBatch, match="at most 64 bytes"):
            decode_batch(msgspec.msgpack.encode([1.0, [{**event, **long}]]))
        removed = ["BlockRemoved", long.get("block_hashes", [b"\x03" * 65]), "GPU"]
        with pytest.raises(MalformedBatch, match="at most 64 bytes"):
            decode_batch(msgspec.msgpack.encode([1.0, [removed]]))


@pytest.mark.parametrize("hashes", [[True], ["x"], [1.5], [None], "not a list", None])
def test_a_block_hash_of_another_type_is_malformed_in_either_layout(hashes: Any) -> None:
    """The fast layouts check the hashes as msgspec decodes them (`_Hashes`); a batch they
    fail goes the tolerant way, whose error says what is wrong, as it did for every batch."""
    stored = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
              "token_ids": [1] * 16, "block_size": 16}  # fmt: skip
    removed = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    for event in (stored, removed, list(stored.values()), list(removed.values())):
        with pytest.raises(MalformedBatch, match="block_hashes must be a list"):
            decode_batch(msgspec.msgpack.encode([1.0, [event]]))
