"""The event index, narrated: own keys from events' token ids equal the gateway's own keys
for the same prompt; tiers, removals, wipes, continuations and speculative entries."""

from __future__ import annotations

from cachemap.events import (
    CPU,
    GPU,
    BlockRemoved,
    BlockStored,
    EventIndex,
    Match,
    precise_keys,
)

IDS = list(range(100, 164))  # 4 blocks of 16
SALT = "tenant-a"


def stored(
    hashes: list[int], ids: list[int], parent: int | None = None, **kw: object
) -> BlockStored:
    return BlockStored(hashes, parent, ids, 16, cache_salt=SALT if parent is None else None, **kw)  # type: ignore[arg-type]


def test_events_key_blocks_as_the_gateway_keys_requests() -> None:
    index = EventIndex()
    keys = precise_keys([*IDS, 1, 2, 3], SALT, 16)  # a partial block is not keyed
    assert len(keys) == 4
    # the engine stores the first two blocks, then a continuation of two more
    assert index.store("a", stored([11, 12], IDS[:32])) == keys[:2]
    assert index.store("a", stored([13, 14], IDS[32:], parent=12)) == keys[2:]
    assert index.lookup(keys, 0.0) == {"a": Match(4, 0)}
    # another tenant's salt shares nothing; another replica holding block 0 only
    assert index.lookup(precise_keys(IDS, "tenant-b", 16), 0.0) == {}
    index.store("b", stored([91], IDS[:16]))
    assert index.lookup(keys, 0.0) == {"a": Match(4, 0), "b": Match(1, 0)}
    assert index.num_blocks("a") == 4 and index.num_blocks("b") == 1


def test_tiers_removals_and_wipes() -> None:
    index = EventIndex()
    keys = precise_keys(IDS, SALT, 16)
    index.store("a", stored([1, 2, 3, 4], IDS))
    index.store("a", stored([1, 2, 3, 4], IDS, tier=CPU))  # write-through offload
    index.remove("a", BlockRemoved([3, 4], GPU))  # evicted from the GPU, kept on the CPU
    assert index.lookup(keys, 0.0) == {"a": Match(4, 2)}
    assert (index.num_blocks("a", GPU), index.num_blocks("a", CPU)) == (2, 4)
    index.remove("a", BlockRemoved([4], CPU))  # gone from every tier: the chain ends at 3
    assert index.lookup(keys, 0.0) == {"a": Match(3, 1)}
    index.remove("a", BlockRemoved([99], GPU))
    assert index.stats.unknown_removals == 1
    index.clear("a")
    assert index.lookup(keys, 0.0) == {} and index.num_blocks("a", CPU) == 0
    # after a wipe a continuation's parent is unknown: its blocks cannot be keyed
    assert index.store("a", stored([5], IDS[16:32], parent=1)) == []
    assert index.stats.unresolved_parents == 1


def test_sliding_window_groups_never_claim_residency() -> None:
    index = EventIndex()
    keys = precise_keys(IDS, SALT, 16)
    index.store("a", stored([1, 2], IDS[:32], group_idx=0))
    index.store("a", stored([1, 2, 3, 4], IDS, group_idx=1, full_attention=False))
    assert index.lookup(keys, 0.0) == {"a": Match(2, 0)}
    index.remove("a", BlockRemoved([1], GPU, group_idx=1))  # the sliding group's eviction
    assert index.lookup(keys, 0.0) == {"a": Match(2, 0)} and index.stats.skipped_groups == 2


def test_a_speculative_entry_is_confirmed_by_its_event() -> None:
    index = EventIndex(speculative_ttl_s=2.0)
    keys = precise_keys(IDS, SALT, 16)
    index.store("a", stored([1], IDS[:16]))
    # routed at t=10: the next turn, at t=11, already finds the whole prompt on "a"
    assert index.speculate("a", keys, 10.0) == 3  # block 0 is held already
    assert index.lookup(keys, 11.0) == {"a": Match(4, 0, 3)}
    index.store("a", stored([2, 3, 4], IDS[16:], parent=1))  # the event lands at t=11.5
    assert index.stats.speculative_confirmed == 3
    assert index.lookup(keys, 13.0) == {"a": Match(4, 0, 0)}  # past the TTL: held for real
    index.sweep("a", 13.0)
    assert index.stats.speculative_expired == 0 and index.num_speculative("a") == 0


def test_a_speculative_entry_expires_without_its_event() -> None:
    index = EventIndex(speculative_ttl_s=2.0)
    keys = precise_keys(IDS, SALT, 16)
    index.speculate("b", keys, 10.0)
    assert index.lookup(keys, 11.9) == {"b": Match(4, 0, 4)}
    assert index.lookup(keys, 12.0) == {}  # expired: the engine never stored it
    index.sweep("b", 12.0)
    assert index.stats.speculative_expired == 4 and index.num_speculative("b") == 0
