"""The in-process directory, told as stories with exact outcomes."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.memory import MemoryDirectory, MemoryIndex, OrderedLru


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(name: str, n: int) -> list[BlockHash]:
    return [BlockHash(f"{name}{i}".encode()) for i in range(n)]


def test_lookup_returns_each_replicas_contiguous_leading_depth() -> None:
    index = MemoryIndex(clock=Clock())
    a = chain("a", 6)
    index.record("r1", a[:4])
    index.record("r2", a[:2])
    index.record("r3", a[1:5])  # holds blocks 1..4 but not block 0: no usable prefix
    assert index.lookup(a) == {"r1": 4, "r2": 2}
    assert index.lookup(chain("b", 3)) == {}
    assert index.lookup([]) == {}


def test_the_walk_stops_at_the_first_block_no_replica_holds() -> None:
    index = MemoryIndex(clock=Clock())
    a = chain("a", 5)
    index.record("r1", a[:2])
    index.record("r1", a[3:5])  # a gap at block 2
    assert index.lookup(a) == {"r1": 2}


def test_entries_expire_after_the_ttl_and_recording_refreshes_them() -> None:
    clock = Clock()
    index = MemoryIndex(ttl_s=60, clock=clock)
    a = chain("a", 3)
    index.record("r1", a)
    clock.now += 59
    assert index.lookup(a) == {"r1": 3}
    index.record("r1", a[:1])  # a shorter request refreshed block 0 only
    clock.now += 2
    assert index.lookup(a) == {"r1": 1}
    clock.now += 60
    assert index.lookup(a) == {}


def test_capacity_evicts_least_recent_first_and_a_chains_tail_before_its_head() -> None:
    index = MemoryIndex(capacity_blocks=5, clock=Clock())
    a, b = chain("a", 3), chain("b", 3)
    index.record("r1", a)
    index.record("r1", b)  # 6 entries > 5: the oldest chain's tail (a2) goes first
    assert index.num_entries("r1") == 5
    assert index.lookup(a) == {"r1": 2}
    assert index.lookup(b) == {"r1": 3}
    index.record("r1", chain("c", 2))  # two more evictions: a1, then a0
    assert index.lookup(a) == {}
    assert index.lookup(b) == {"r1": 3}


def test_drop_removes_what_the_engine_did_not_hold() -> None:
    index = MemoryIndex(clock=Clock())
    a = chain("a", 4)
    index.record("r1", a)
    index.record("r2", a)
    index.drop("r1", a[2:])
    assert index.lookup(a) == {"r1": 2, "r2": 4}
    index.drop("r9", a)  # an unknown replica is a no-op


def test_forget_is_an_epoch_bump_and_old_entries_are_reaped_in_bounded_steps() -> None:
    index = MemoryIndex(clock=Clock())
    a = chain("a", 3000)
    index.record("r1", a)
    index.record("r2", a[:10])
    index.forget("r1")
    assert index.lookup(a) == {"r2": 10}  # at once, before any cleanup
    assert index.num_entries("r1") == 0
    index.record("r1", a[:5])  # the new epoch works, and this call reaped a bounded batch
    assert index.lookup(a) == {"r1": 5, "r2": 10}
    for _ in range(3):
        index.record("r2", a[:1])
    # every stale entry of the old epoch is released (3000 > one call's budget), the new stay
    assert not index._graveyard
    assert index.num_entries("r1") == 5


def test_the_index_adds_no_object_for_the_cyclic_gc_to_walk_per_block() -> None:
    """A gateway's directory holds ~225k blocks per engine: per-block objects the collector
    tracks are walked by every older-generation pass (5-7% of the request path's CPU)."""
    index = MemoryIndex(clock=Clock())
    chains = [chain(f"c{c}-", 500) for c in range(40)]  # 20,000 blocks
    gc.collect()
    before = len(gc.get_objects())
    for c, blocks in enumerate(chains):
        index.record(f"r{c % 4}", blocks)
        index.record(f"r{(c + 1) % 4}", blocks[:100])  # blocks held by two replicas
    index.forget("r0")  # an epoch in the graveyard, one current after it
    index.record("r0", chains[0][:50])
    assert index.lookup(chains[1]) == {"r1": 500, "r2": 100}
    gc.collect()
    # a handful of tracked objects (the replicas' LRUs, the index's own dicts), none per block
    assert len(gc.get_objects()) - before < 50


def test_invalid_configuration_names_the_field() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        MemoryIndex(capacity_blocks=0)
    with pytest.raises(ValueError, match="ttl_s"):
        MemoryIndex(ttl_s=0)


async def test_the_async_directory_delegates_to_the_index() -> None:
    directory = MemoryDirectory(MemoryIndex(clock=Clock()))
    a = chain("a", 3)
    await directory.record("r1", a)
    assert await directory.lookup(a) == {"r1": 3}
    await directory.drop("r1", a[1:])
    assert await directory.lookup(a) == {"r1": 1}
    await directory.forget("r1")
    assert await directory.lookup(a) == {}
    await directory.close()


def _reference_walk(
    lru: dict[BlockHash, float], hashes: list[BlockHash], expired_before: float
) -> tuple[int, float] | None:
    """The walk a block at a time (the implementation before the windowed one)."""
    depth, last = 0, 0.0
    for block in hashes:
        used = lru.get(block)
        if used is None or used <= expired_before:
            break
        depth, last = depth + 1, used
    return (depth, last) if depth else None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(0, 50)), max_size=12),
    st.integers(1, 400),
    st.integers(0, 60),
)
def test_lookups_and_records_match_a_block_at_a_time_model(
    records: list[tuple[int, int, int]], chain_len: int, now: int
) -> None:
    """Random chains recorded on random replicas at random times (some past the TTL), then a
    chain looked up: each replica's depth and last use are the block-at-a-time walk's, and
    each replica's order is that of moving each block to the newest end, the tail first."""
    clock = Clock()
    index = MemoryIndex(ttl_s=30, capacity_blocks=100, clock=clock)
    chain = [BlockHash(i.to_bytes(16, "big")) for i in range(400)]
    model: dict[str, dict[BlockHash, float]] = {}
    for replica, length, at in sorted(records, key=lambda r: r[2]):
        clock.now = float(at)
        index.record(f"r{replica}", chain[:length])
        lru = model.setdefault(f"r{replica}", {})
        for block in reversed(chain[:length]):
            lru.pop(block, None)
            lru[block] = float(at)
        while len(lru) > 100:
            del lru[next(iter(lru))]
    clock.now = float(max([now] + [r[2] for r in records]))
    expired_before = clock.now - 30
    want = {
        r: walk
        for r, lru in model.items()
        if (walk := _reference_walk(lru, chain[:chain_len], expired_before)) is not None
    }
    assert index.lookup_detail(chain[:chain_len]) == want
    for replica, lru in model.items():
        newest_first = [(k, t) for k, t in reversed(lru.items()) if t > expired_before]
        assert [e for e in index.entries(replica) if e[1] > expired_before] == newest_first


def _prompt_chains() -> list[list[BlockHash]]:
    """Real chains (each key names its whole prefix) of prompts that share prefixes: three
    stems, each continued three ways, each prefix of each a chain of its own."""
    root = root_hash(b"salt", "model")
    stems = [bytes([65 + s]) * 40 for s in range(3)]
    prompts = [stem + bytes([97 + t]) * (8 * t + 20) for stem in stems for t in range(3)]
    return [chain_hashes(p, root, 4) for p in prompts]


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "older", "drop", "expire", "cap", "forget"]),
        st.integers(0, 2),  # replica
        st.integers(0, 8),  # prompt
        st.integers(1, 30),  # length (blocks), or a capacity
        st.integers(0, 40),  # seconds forward (or back, for "older")
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_a_whole_chains_index_answers_every_lookup_as_the_walk_does(
    ops: list[tuple[str, int, int, int, int]],
) -> None:
    """`whole_chains` looks each replica's depth up by bisection while its epoch is
    prefix-closed: under any mix of records (in and out of time order), drops, expiries,
    capacities and forgets, each lookup's depths and last uses are the block-at-a-time
    walk's (an index without it, given the same calls)."""
    chains = _prompt_chains()
    clock = Clock()
    bisected = MemoryIndex(ttl_s=60, capacity_blocks=60, clock=clock, whole_chains=True)
    walked = MemoryIndex(ttl_s=60, capacity_blocks=60, clock=clock)
    for op, r, p, n, seconds in ops:
        replica, keys = f"r{r}", chains[p][:n]
        for index in (bisected, walked):
            if op == "record":
                index.record(replica, keys, clock.now + seconds)
            elif op == "older":
                index.record(replica, keys, clock.now - seconds)
            elif op == "drop":
                index.drop(replica, keys[n // 2 :: 2])
            elif op == "expire":
                index.expire(replica, clock.now + seconds - 60)
            elif op == "cap":
                index.set_capacity(replica, n if seconds % 2 else None)
            else:
                index.forget(replica)
        if op == "record":
            clock.now += seconds
        for looked_up in chains:
            for length in (1, len(looked_up) // 2, len(looked_up)):
                want = walked.lookup_detail(looked_up[:length])
                assert bisected.lookup_detail(looked_up[:length]) == want


def test_a_whole_chains_index_probes_a_few_blocks_of_a_long_prompt() -> None:
    """A 325-block prompt held whole is one probe past the first block; held in part, a
    bisection (~9); the walk probes every block held. (The definition's probes, counted: the
    compiled `Lru` answers as it does, `test_native.py`.)"""
    chain_ = chain_hashes(bytes(range(256)) * 325, root_hash(b"s", "m"), 256)
    index = MemoryIndex(clock=Clock(), whole_chains=True, lru=OrderedLru)
    index.record("r1", chain_)
    index.record("r2", chain_[:100])
    probes: list[BlockHash] = []
    for lru in index._current.values():
        get = lru.get
        lru.get = lambda key, *default, get=get: probes.append(key) or get(key, *default)  # type: ignore[method-assign]
    assert index.lookup_detail(chain_) == {
        "r1": (325, pytest.approx(1000.0)),
        "r2": (100, pytest.approx(1000.0)),
    }
    assert len(probes) <= 2 + 2 + 10


def test_a_record_older_than_the_replicas_newest_puts_it_back_on_the_walk() -> None:
    """Another worker's record of a shorter prefix, at an older time, leaves a deeper block
    fresher than the blocks before it: bisection would read the deeper block as the depth, the
    walk stops at the first stale block. The index walks that replica from then on."""
    chain_ = _prompt_chains()[0]
    clock = Clock()
    index = MemoryIndex(ttl_s=60, clock=clock, whole_chains=True)
    index.record("r1", chain_[:4], 1000.0)
    index.record("r1", chain_[:3], 990.0)  # older: a sibling's, delayed
    index.record("r1", chain_[:1], 1100.0)
    clock.now = 1055.0  # expired at or before 995: the blocks at 990, not the one at 1000
    assert index.lookup_detail(chain_[:4]) == {"r1": (1, 1100.0)}
    index.forget("r1")  # a fresh epoch is prefix-closed again
    index.record("r1", chain_[:4], 1050.0)
    assert index.lookup_detail(chain_[:4]) == {"r1": (4, 1050.0)}
