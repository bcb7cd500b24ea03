"""The Redis directory's key schema, and how a chain of block hashes becomes script arguments.

Key schema (all binary-safe; `{...}` is the Redis Cluster hash tag):

    kvg:{TAG}:<16-byte block hash>   HASH  replica id -> "<generation>:<last use, ms>"
                                     PEXPIRE = ttl, set with every write of a field
    kvg:{TAG}:<block>:p              HASH  replica id -> a placement in flight from this
                                     block: "<generation>:<expiry ms>\n<block suffixes>"
    kvg:{kvg-meta}:gen               HASH  replica id -> current generation
    kvg:{kvg-meta}:count             HASH  replica id -> blocks recorded in this generation
    kvg:{kvg-meta}:live              HASH  replica id -> "<generation>,<oldest live generation>;"
                                           and "<generation>:<entries at it>;" for each live
                                           one (valid only at that generation: `scripts._LIVE`)
    kvg:{kvg-meta}:start             HASH  replica id -> the engine's last seen start marker
    kvg:{kvg-meta}:floor             HASH  replica id -> entries last used at or before this
                                           (ms) no longer match (reconciliation's `expire`)
    kvg:{kvg-meta}:seen              HASH  replica id -> last record or restart report (ms):
                                           a replica quiet for longer than the TTL is pruned
    kvg:{kvg-meta}:genbase           STR   the highest generation of a pruned replica: the
                                           generation of any replica without a `gen` field
    kvg:{kvg-meta}:layout            HASH  version (`LAYOUT`), incarnation (random, made when
                                           the layout is written: a new one means this Redis
                                           lost its state since a gateway last looked)
    channel kvg:gen                  "<replica id>:<generation>" on every generation change,
                                     "<replica id>:live:<oldest>:<generation>" on every change
                                     of the oldest live generation

TAG is the hex of the 6-byte tag every block hash of a chain starts with (`cachemap.keys`: the
salted block 0's first bytes), so every key of one chain sits in one cluster slot — a lookup is
ONE script call whatever the chain length, and any slice of a chain is addressed by itself —
while tenants and system prompts spread over the shards.
A replica id is the 32-bit MurmurHash3 of the replica's name, in hex: every gateway derives the
same id without coordination.
"""

from __future__ import annotations

from collections.abc import Sequence

import mmh3

from cachemap.keys import TAG_BYTES, BlockHash

SUFFIX_BYTES = 16 - TAG_BYTES
"""What follows the tag in a block hash: a block's key is the chain's prefix + these bytes."""

LAYOUT = 2
"""The layout this code writes. 1: before layouts were versioned (no `layout` key, no `seen`
or `genbase`; records counted every re-record). 2 reads and extends 1 in place, so a gateway of
either layout shares one Redis with the other (docs/design/directory.md, "Layout versions")."""
KNOWN_LAYOUTS = (1, 2)

GEN_KEY = b"kvg:{kvg-meta}:gen"
COUNT_KEY = b"kvg:{kvg-meta}:count"
LIVE_KEY = b"kvg:{kvg-meta}:live"
START_KEY = b"kvg:{kvg-meta}:start"
FLOOR_KEY = b"kvg:{kvg-meta}:floor"
SEEN_KEY = b"kvg:{kvg-meta}:seen"
BASE_KEY = b"kvg:{kvg-meta}:genbase"
LAYOUT_KEY = b"kvg:{kvg-meta}:layout"
CHANNEL = "kvg:gen"
LAND_CHANNEL = "kvg:land"
"""Fan-out leaders announce here that their write landed (the landed marker)."""


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def replica_id(replica: str) -> str:
    return format(mmh3.hash(replica, signed=False), "08x")


def chain_call(hashes: Sequence[BlockHash]) -> tuple[list[bytes], list[bytes]]:
    """(keys, leading args) of a chain script: the first block's key (for the slot), then the
    key prefix and the blocks' suffixes joined (see `scripts.CHAIN`)."""
    prefix = b"kvg:{" + hashes[0][:TAG_BYTES].hex().encode() + b"}:"
    blob = b"".join([h[TAG_BYTES:] for h in hashes])
    assert len(blob) == len(hashes) * SUFFIX_BYTES, "block hashes are 16 bytes"
    return [prefix + hashes[0][TAG_BYTES:]], [prefix, blob]


def block_keys(hashes: Sequence[BlockHash]) -> list[bytes]:
    """The Redis key of each block: its chain's tag in braces, then the rest of the hash."""
    if not hashes:
        return []
    prefix = b"kvg:{" + hashes[0][:TAG_BYTES].hex().encode() + b"}:"
    assert all(h[:TAG_BYTES] == hashes[0][:TAG_BYTES] for h in hashes[-1:]), "one chain per call"
    return [prefix + h[TAG_BYTES:] for h in hashes]
