"""Salted, chained block hashes: the identity of a prompt prefix.

The one hash function of kvgate (after vLLM's `hash_block_tokens` and GIE's `hashPrompt`):

    root    = H(b"kvgate/v1" || salt || 0x00 || model)
    hash(0) = H(root || block 0)
    hash(i) = tag || H(hash(i-1) || block i)[:10]       tag = hash(0)[:6]

H is 128-bit MurmurHash3 (x64). Blocks are fixed-size slices of the canonical rendering's
UTF-8 bytes; only full blocks are hashed, so a prompt shorter than one block has no hashes and
no locality. Because every hash chains its parent, hash(i) names the whole prefix up to the end
of block i: equal prefixes give equal leading hashes, one changed byte changes every hash from
its block on, and different salts (tenants) or models share nothing.

Every hash of a chain starts with the same 6-byte tag, taken from the salted block 0: any slice
of a chain (a reconciliation drops a tail) names its chain's Redis Cluster slot by itself, and
the other 80 bits keep collisions within one chain family out of reach.
"""

from __future__ import annotations

import array
import functools
import struct
from collections.abc import Mapping, Sequence
from typing import NewType, cast

import mmh3

from cachemap.native import NATIVE

BlockHash = NewType("BlockHash", bytes)
"""16 bytes naming a prefix: every byte from the start of the prompt to the end of a block."""

DEFAULT_BLOCK_BYTES = 256
"""Block size in bytes of the canonical rendering.

~64 tokens of English BPE (~4 bytes/token), i.e. four vLLM blocks of 16 tokens: a prediction
loses at most one block (<1% of a 10k-token prompt) to granularity, while a 100k-token prompt
is ~1,600 hashes (~0.7 ms in CPython) and one directory entry per 256 bytes keeps the directory
small. Chains of 8/64/512 blocks are 2 KB / 16 KB / 128 KB prompts.
"""

_DOMAIN = b"kvgate/v1"
TAG_BYTES = 6
"""48 bits of the salted block 0 shared by every hash of a chain (the cluster hash tag)."""


def root_hash(salt: bytes, model: str) -> BlockHash:
    """The parent of block 0: binds every chain to one isolation scope (salt) and one model."""
    return BlockHash(mmh3.mmh3_x64_128_digest(_DOMAIN + salt + b"\x00" + model.encode()))


def chain_hashes(
    data: bytes,
    root: BlockHash,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    *,
    parent: BlockHash | None = None,
    extras: Mapping[int, bytes] | None = None,
) -> list[BlockHash]:
    """hash(i) = H(hash(i-1) || block i) for every full block of `data`, hash(-1) = `root`.

    `parent`: the chain continues after that hash (its tag kept), so the blocks of a
    continuation get the keys they would have had as the tail of the whole prompt.
    `extras`: block index (from the first block of `data`) -> bytes hashed after that block's
    (an image's identity in the blocks its placeholders fill: `cachemap.multimodal`)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    if len(data) < block_bytes:
        return []
    if extras:
        return _chain_with_extras(data, root, block_bytes, parent, extras)
    if _NATIVE_CHAIN is not None and (parent is None or len(parent) == _HASH_BYTES):
        return cast(list[BlockHash], _NATIVE_CHAIN(data, root, block_bytes, parent))
    return _chain(data, root, block_bytes, parent)


_NATIVE_CHAIN = NATIVE.chain if NATIVE is not None else None
"""`cachemap._native.chain`, where it is built: `_chain` in one C loop (~2.5x faster on the
ramp's 325-block prompts)."""

_HASH_BYTES = 16


def _chain(
    data: bytes, root: BlockHash, block_bytes: int, parent: BlockHash | None
) -> list[BlockHash]:
    """`chain_hashes` of at least one full block, without extras: the definition the compiled
    `chain` is held to."""
    digest = mmh3.mmh3_x64_128_digest
    out: list[bytes] = []
    append = out.append
    first = 0
    if parent is None:
        last = digest(root + data[:block_bytes])
        append(last)
        first = block_bytes
    else:
        last = parent
    tag = last[:TAG_BYTES]
    # the blocks cut by `struct.iter_unpack` over a view of the data: each block a bytes
    # object made in C, where a `range` and a slice a block were two more steps of the loop
    # (~15% of the chain: 88 -> 75 us for the ramp's 325-block prompts, thread CPU). No
    # `BlockHash(...)` per block: a NewType is a Python-level call at run time (~150 ns, a
    # third of the loop); the list is the same objects, named by the cast once
    end = first + (len(data) - first) // block_bytes * block_bytes
    for (block,) in _blocks(block_bytes).iter_unpack(memoryview(data)[first:end]):
        last = tag + digest(last + block)[TAG_BYTES:]
        append(last)
    return cast(list[BlockHash], out)


@functools.lru_cache(maxsize=8)
def _blocks(block_bytes: int) -> struct.Struct:
    """A block of `block_bytes` as one bytes field, to cut a prompt with `iter_unpack`."""
    return struct.Struct(f"{block_bytes}s")


def _chain_with_extras(
    data: bytes,
    root: BlockHash,
    block_bytes: int,
    parent: BlockHash | None,
    extras: Mapping[int, bytes],
) -> list[BlockHash]:
    """`chain_hashes` with extra bytes after some blocks (a Python step per block: only
    prompts with images come here)."""
    digest = mmh3.mmh3_x64_128_digest
    out: list[BlockHash] = []
    last: bytes | None = parent
    tag = parent[:TAG_BYTES] if parent is not None else b""
    for i, start in enumerate(range(0, len(data) - block_bytes + 1, block_bytes)):
        block = data[start : start + block_bytes] + extras.get(i, b"")
        if last is None:
            last = digest(root + block)
            tag = last[:TAG_BYTES]
        else:
            last = tag + digest(last + block)[TAG_BYTES:]
        out.append(BlockHash(last))
    return out


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the bytes `chain_hashes` cuts (4 per id, little-endian): precise mode's keys
    are the same chain over token blocks of `4 * block_size` bytes."""
    if isinstance(token_ids, array.array) and token_ids.typecode == "I":
        return token_ids.tobytes()  # no int boxed per token
    return array.array("I", token_ids).tobytes()


def affinity_key(
    data: bytes,
    root: BlockHash,
    hashes: Sequence[BlockHash],
    num_blocks: int,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> bytes:
    """A key naming the first `num_blocks` blocks, for consistent hashing.

    The chain already names every prefix, so this is hashes[num_blocks-1] when the prompt has
    that many blocks; a shorter prompt is named by a hash of all of it.
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if len(hashes) >= num_blocks:
        return hashes[num_blocks - 1]
    return mmh3.mmh3_x64_128_digest(root + data[: num_blocks * block_bytes])


def hash_prompt(
    data: bytes, salt: bytes, model: str, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[BlockHash]:
    """Convenience: the chained hashes of `data` in the scope (salt, model)."""
    return chain_hashes(data, root_hash(salt, model), block_bytes)
