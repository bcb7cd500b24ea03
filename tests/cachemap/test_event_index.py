"""The event index, narrated: own keys from events' token ids equal the gateway's own keys
for the same prompt; tiers, removals, wipes, continuations and speculative entries."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.events import (
    CPU,
    GPU,
    SPECULATIVE_STRIDE,
    STORAGE,
    BlockRemoved,
    BlockStored,
    EventIndex,
    Match,
    domain_of,
    precise_keys,
    rank_of,
    replica_of,
)
from cachemap.keys import token_bytes

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
    # one entry, for the last block of the window of SPECULATIVE_STRIDE (4) blocks: it claims
    # blocks 1-3 (block 0 is held already)
    assert index.speculate("a", keys, 10.0) == 1
    assert index.lookup(keys, 11.0) == {"a": Match(4, 0, 3)}
    assert index.lookup(keys[:3], 11.0) == {"a": Match(1, 0, 0)}  # ends inside the window
    index.store("a", stored([2, 3, 4], IDS[16:], parent=1))  # the event lands at t=11.5
    assert index.stats.speculative_confirmed == 1
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
    assert index.stats.speculative_expired == 1 and index.num_speculative("b") == 0


def _mask(index: EventIndex, key: bytes, domain: str) -> int:
    """The tier mask of `key` on `domain` (0: not held there)."""
    state = index._domains.get(domain)
    return state.maps.mask_of(key) if state is not None else 0


def _claims(index: EventIndex) -> dict[tuple[str, bytes], float]:
    """(domain, key) -> when the domain's speculative entry of the key expires."""
    return {(d, k): t for d, state in index._domains.items() for k, t in state.claims.items()}


def _children(state: Any) -> dict[bytes, int]:
    """Per key (held or broken), how many of its children the domain holds."""
    children: dict[bytes, int] = state.maps.maps()[2]
    return children


def _broken(state: Any) -> set[bytes]:
    """The keys the domain does not hold but holds a child of."""
    broken: set[bytes] = state.maps.maps()[4]
    return broken


def _stepped_lookup(index: EventIndex, keys: list[bytes], now_s: float) -> dict[str, Match]:
    """The lookup stepped key by key: a domain advances over a key it holds or claims (an
    unexpired speculative entry of the key or of a later key of its window of
    SPECULATIVE_STRIDE); the reference the fast lookup must equal."""

    def claimed(domain: str, i: int) -> bool:
        end = min(i - i % SPECULATIVE_STRIDE + SPECULATIVE_STRIDE, len(keys))
        return any(_claims(index).get((domain, keys[p]), 0.0) > now_s for p in range(i, end))

    depth: dict[str, int] = {}
    offloaded: dict[str, int] = {}
    speculative: dict[str, int] = {}
    domains = (
        {d for d in index.domains() if _mask(index, keys[0], d) or claimed(d, 0)} if keys else set()
    )
    for domain in domains:
        i = 0
        while i < len(keys):
            mask = _mask(index, keys[i], domain)
            if mask:
                if not mask & GPU and not claimed(domain, i):
                    offloaded[domain] = offloaded.get(domain, 0) + 1
            elif claimed(domain, i):
                speculative[domain] = speculative.get(domain, 0) + 1
            else:
                break
            i += 1
        depth[domain] = i
    return {d: Match(n, offloaded.get(d, 0), speculative.get(d, 0)) for d, n in depth.items()}


def test_the_lookup_equals_stepping_key_by_key_on_random_indexes() -> None:
    """Holes, tiers, speculative entries (live, expired, confirmed) on three domains: every
    lookup of every prefix of the chain equals the stepped reference, and a speculation adds
    one entry per window of SPECULATIVE_STRIDE blocks not all on the domain's GPU."""
    import random

    rng = random.Random(16)
    ids = list(range(1000, 1000 + 16 * 40))
    keys = precise_keys(ids, SALT, 16)
    for trial in range(60):
        index = EventIndex(speculative_ttl_s=2.0)
        for domain in ("a", "b", "c"):
            cut = rng.randrange(0, 41)
            if cut:
                tier = rng.choice([GPU, GPU, CPU])
                hashes = list(range(100 * trial, 100 * trial + cut))
                index.store(domain, stored(hashes, ids[: 16 * cut], tier=tier))
                half = cut // 2
                if tier == GPU and rng.random() < 0.5:  # some offloaded copies too
                    index.store(domain, stored(hashes[:half], ids[: 16 * half], tier=CPU))
                for h in rng.sample(hashes, k=min(len(hashes), rng.randrange(0, 4))):
                    index.remove(domain, BlockRemoved([h], rng.choice([GPU, CPU])))  # holes
            for _ in range(rng.randrange(0, 3)):  # placements of prompts of this chain
                n = rng.randrange(1, 41)
                at = rng.choice([8.0, 10.0])
                on_gpu = [bool(_mask(index, k, domain) & GPU) for k in keys[:n]]
                windows = range(0, n, SPECULATIVE_STRIDE)
                lacking = sum(not all(on_gpu[w : w + SPECULATIVE_STRIDE]) for w in windows)
                assert index.speculate(domain, keys[:n], at) == lacking
        for now in (9.0, 10.5, 12.5):
            for n in (0, 1, 3, 7, 20, 39, 40):
                assert index.lookup(keys[:n], now) == _stepped_lookup(index, keys[:n], now)


def test_a_speculation_after_the_lookup_of_its_chain_sees_the_events_between() -> None:
    """The speculation of a placement goes by the index as it is then: a store, a removal or a
    wipe between its chain's lookup and it (the routing decision in between) counts."""
    keys = precise_keys(IDS, SALT, 16)
    for between, entries in (
        (lambda index: None, 1),  # held block 0: one entry, for blocks 1-3's window
        # the rest stored since: nothing to claim
        (lambda index: index.store("a", stored([2, 3, 4], IDS[16:], parent=1)), 0),
        (lambda index: index.remove("a", BlockRemoved([1], GPU)), 1),
        (lambda index: index.clear("a"), 1),
    ):
        index = EventIndex(speculative_ttl_s=2.0)
        index.store("a", stored([1], IDS[:16]))
        other = precise_keys(IDS[:32], SALT, 16)
        index.store("b", stored([7, 8], IDS[:32]))
        assert index.lookup(keys, 10.0) == {"a": Match(1, 0), "b": Match(2, 0)}
        between(index)
        assert index.speculate("a", keys, 10.0) == entries
        # a lookup of another chain in between: the speculation finds its own chain's holders
        index.lookup(other, 10.0)
        assert index.speculate("b", keys, 10.0) == 1  # blocks 2-3 of its window lack


def test_a_key_that_leaves_before_its_child_is_broken_until_it_is_whole_again() -> None:
    """Blocks 0-3 held on a GPU: the run is found by bisection. Block 1 evicted while 2 and 3
    stay (out of order): 1 is broken and the chain is read key by key (depth 1, not 4). Held
    again (a re-store under its parent): whole. Evicted again, then its children too: no
    longer broken (nothing of it below is held)."""
    index = EventIndex()
    keys = precise_keys(IDS, SALT, 16)
    index.store("a", stored([1, 2, 3, 4], IDS))
    state = index._domains["a"]
    assert index.lookup(keys, 0.0) == {"a": Match(4, 0)} and index._held_run("a", state, keys) == 4
    assert _children(state) == {keys[0]: 1, keys[1]: 1, keys[2]: 1} and not _broken(state)
    index.remove("a", BlockRemoved([2], GPU))
    assert _broken(state) == {keys[1]}
    assert (
        index.lookup(keys, 0.0) == {"a": Match(1, 0)} and index._held_run("a", state, keys) is None
    )
    assert index.lookup(keys[:1], 0.0) == {"a": Match(1, 0)}
    index.store("a", stored([2], IDS[16:32], parent=1))
    assert not _broken(state) and index.lookup(keys, 0.0) == {"a": Match(4, 0)}
    index.remove("a", BlockRemoved([2], GPU))
    index.remove("a", BlockRemoved([3, 4], GPU))
    assert not _broken(state) and _children(state) == {}
    assert index.lookup(keys, 0.0) == {"a": Match(1, 0)}
    index.clear("a")
    assert index.domains() == [] and index.lookup(keys, 0.0) == {}


def test_a_batch_removal_at_a_branch_point_and_a_store_over_a_broken_key() -> None:
    """The batch paths' bookkeeping (`_remove_whole`, `_hold_all`'s new blocks): a branch's own
    blocks removed in one GPU batch leave their shared parent with its other child; a store of
    new blocks, one of them broken (not held, its child held), makes it whole again."""
    index = EventIndex()
    trunk = [*IDS, *range(500, 532)]  # 6 blocks
    branch = [*IDS[:48], *range(900, 948)]  # its first 3 blocks, then 3 of its own
    index.store("a", stored([1, 2, 3, 4, 5, 6], trunk))
    index.store("a", stored([13, 14, 15], branch[48:], parent=3))
    state = index._domains["a"]
    keys, own = precise_keys(trunk, SALT, 16), precise_keys(branch, SALT, 16)
    assert _children(state)[keys[2]] == 2
    index.remove("a", BlockRemoved([15, 14, 13], GPU))  # the branch, tail first
    assert _children(state)[keys[2]] == 1 and not _broken(state)
    assert index.lookup(own, 0.0) == {"a": Match(3, 0)}
    _check_bookkeeping(index)
    index.remove("a", BlockRemoved([4], GPU))  # out of order: block 3 broken (4 is held)
    index.remove("a", BlockRemoved([3], GPU))  # block 2 not broken (its child 3 is gone)
    assert _broken(state) == {keys[3]}
    index.store("a", stored([3, 4], trunk[32:64], parent=2))  # new blocks, one broken
    assert not _broken(state) and index.lookup(keys, 0.0) == {"a": Match(6, 0)}
    _check_bookkeeping(index)


BRANCH_SPLITS = (8, 3, 5, 0)
"""Branch b shares its first BRANCH_SPLITS[b] blocks with branch 0 (branch 3 nothing)."""


def _branch_ids(branch: int, n: int) -> list[int]:
    return [
        (0 if i < BRANCH_SPLITS[branch] else branch) * 10_000 + i * 16 + t
        for i in range(n)
        for t in range(16)
    ]


def _branch_hash(branch: int, i: int) -> int:
    return 1 + (0 if i < BRANCH_SPLITS[branch] else branch) * 100 + i


_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.sampled_from("ab"),
            st.integers(0, 3),
            st.one_of(st.just(0), st.integers(0, 7)),  # a chain's start, or a continuation
            st.integers(1, 8),
            st.sampled_from([GPU, GPU, GPU, CPU]),
        ),
        st.tuples(
            st.just("remove"),
            st.sampled_from("ab"),
            st.integers(0, 3),
            st.integers(0, 7),
            st.integers(1, 5),
            st.sampled_from([GPU, GPU, CPU]),
        ),
        st.tuples(
            st.just("clear"), st.sampled_from("ab"), st.just(0), st.just(0), st.just(0), st.just(0)
        ),
        st.tuples(
            st.just("speculate"),
            st.sampled_from("ab"),
            st.integers(0, 3),
            st.integers(1, 8),
            st.integers(0, 1),  # 1: with its token bytes (the stores take its keys)
            st.just(0),
        ),
    ),
    max_size=40,
)


def _check_bookkeeping(index: EventIndex) -> None:
    """The module docstring's invariants, from their definitions: a domain holds a key iff one
    of its engine hashes maps to it, its tier counts are its masks' bits, its parent map
    names only keys it holds, `children` counts each key's held children there and `broken`
    is the keys it does not hold with a held child."""
    for state in index._domains.values():
        held, parents, children, engine, broken = state.maps.maps()
        assert all(held.values()) and len(state.maps) == len(held)
        assert set(engine.values()) == set(held)
        assert set(parents) <= set(held)
        for tier in (GPU, CPU, STORAGE):
            assert state.tier_counts[tier] == sum(1 for m in held.values() if m & tier)
        counts: dict[bytes, int] = {}
        for parent in parents.values():
            counts[parent] = counts.get(parent, 0) + 1
        assert children == counts
        assert broken == {k for k in counts if k not in held}
    # every speculative entry is in its domain's queue with its expiry, and the odd ends are
    # entries' keys, none at a window's end
    for state in index._domains.values():
        queued = set(state.speculative)
        assert all((t, k) in queued for k, t in state.claims.items())
        assert set(state.odd_ends) <= set(state.claims)
        stride = SPECULATIVE_STRIDE
        assert all(i % stride != stride - 1 for i in state.odd_ends.values())


@settings(max_examples=400, deadline=None)
@given(_OPS, st.booleans())
def test_bisected_lookups_and_speculations_equal_stepping_key_by_key(
    ops: list[tuple[str, str, int, int, int, int]], offload: bool
) -> None:
    """A tree of four branches on two domains: stores of any run (a continuation only where
    its parent is held), removals in any order (holes: broken keys), wipes, speculative
    entries and, in half the examples, tier moves (else every block is on a GPU: the
    bisection's case). After every op, every branch's lookup equals the stepped reference,
    and a speculation adds one entry per window not all on the domain's GPU. A store confirms
    the entries a store looking every key up confirms (`_entry_keys` skips the others)."""
    index = EventIndex(speculative_ttl_s=2.0)
    every_key = EventIndex(speculative_ttl_s=2.0)
    every_key._entry_keys = lambda state, keys, first: keys  # type: ignore[method-assign]
    chains = [precise_keys(_branch_ids(b, 8), SALT, 16) for b in range(4)]
    for kind, domain, branch, at, count, any_tier in ops:
        tier = any_tier if offload else GPU
        if kind == "store":
            stop = min(8, at + count)
            parent = _branch_hash(branch, at - 1) if at else None
            hashes = [_branch_hash(branch, i) for i in range(at, stop)]
            ids = _branch_ids(branch, stop)[16 * at :]
            for each in (index, every_key):
                each.store(domain, stored(hashes, ids, parent=parent, tier=tier))
            assert _claims(index) == _claims(every_key)
            assert index.stats.speculative_confirmed == every_key.stats.speculative_confirmed
        elif kind == "remove":
            hashes = [_branch_hash(branch, i) for i in range(at, min(8, at + count))]
            index.remove(domain, BlockRemoved(hashes, tier))
            every_key.remove(domain, BlockRemoved(hashes, tier))
        elif kind == "clear":
            index.clear(domain)
            every_key.clear(domain)
        else:
            keys = chains[branch][:at]
            on_gpu = [bool(_mask(index, k, domain) & GPU) for k in keys]
            windows = range(0, len(keys), SPECULATIVE_STRIDE)
            lacking = sum(not all(on_gpu[w : w + SPECULATIVE_STRIDE]) for w in windows)
            data = token_bytes(_branch_ids(branch, at)) if count else None
            assert index.speculate(domain, keys, 10.0, data) == lacking
            every_key.speculate(domain, keys, 10.0, data)
        _check_bookkeeping(index)
        for keys in chains:
            for n in (1, 4, 8):
                assert index.lookup(keys[:n], 10.5) == _stepped_lookup(index, keys[:n], 10.5)


def test_a_domain_name_gives_back_its_replica_and_rank() -> None:
    for replica in ("http://10.0.0.7:8000", "http://[::1]:8000"):
        assert (replica_of(domain_of(replica, 0, 1)), rank_of(domain_of(replica, 0, 1))) == (
            replica,
            None,
        )
        for rank in (0, 3):
            domain = domain_of(replica, rank, 4)
            assert (replica_of(domain), rank_of(domain)) == (replica, rank)
    assert rank_of("http://a:8000#x") is None


def test_a_speculation_past_the_held_run_leaves_the_entries_stepping_window_by_window_leaves() -> (
    None
):
    """A domain holding a leading run of the chain (or none), other domains' entries and its
    own earlier ones on some of the keys: the C loops past the run (`_speculate_past`) count,
    order and time the entries as stepping window by window (`_speculate_each`) does."""
    import random

    rng = random.Random(41)
    ids = list(range(1000, 1000 + 16 * 40))
    keys = precise_keys(ids, SALT, 16)
    past = 0
    for _ in range(200):
        cut, n = rng.randrange(0, 41), rng.randrange(0, 41)
        earlier = [(d, rng.randrange(1, 41)) for d in "ab" if rng.random() < 0.5]
        indexes = [EventIndex(speculative_ttl_s=2.0) for _ in range(2)]
        for index in indexes:
            if cut:
                index.store("a", stored(list(range(cut)), ids[: 16 * cut]))
            for domain, m in earlier:
                index.speculate(domain, keys[:m], 5.0)
        fast, slow = indexes
        state = slow._domain("a")
        run = slow._held_run("a", state, keys[:n])
        past += run is not None and run < n
        slow.sweep("a", 6.0)
        assert fast.speculate("a", keys[:n], 6.0) == slow._speculate_each(state, keys[:n], run, 8.0)
        assert list(fast._domains["a"].speculative) == list(state.speculative)
        assert _claims(fast) == _claims(slow)
    assert past > 50  # half the trials or so took the C loops


def test_a_placed_chain_gives_its_keys_to_the_stores_of_its_engine() -> None:
    """Placed with its token bytes, a chain's blocks the domain lacks are expected: the store
    that starts there takes their keys from the chain (not hashed again), in chunks too; a
    store of other tokens after the same parent, or under another salt, is hashed as before.
    Either way the keys are the ones hashing gives."""
    ids = list(range(1000, 1000 + 16 * 12))
    keys = precise_keys(ids, SALT, 16)
    data = token_bytes(ids)
    for chunks in ([12], [5, 7], [5, 3, 4]):  # from block 0 (no parent), in one store or more
        index = EventIndex()
        index.speculate("a", keys, 10.0, data)
        at = 0
        for count in chunks:
            hashes = list(range(at, at + count))
            event = stored(hashes, ids[16 * at : 16 * (at + count)], parent=at - 1 if at else None)
            assert index.store("a", event) == keys[at : at + count]
            at += count
        assert index.stats.expected_blocks == 12
        assert index.lookup(keys, 10.0) == {"a": Match(12, 0)}
    # block 0-3 held: the placement expects blocks 4.. after key 3
    index = EventIndex()
    index.store("a", stored([0, 1, 2, 3], ids[:64]))
    index.speculate("a", keys, 10.0, data)
    other = [*ids[:64], *range(5000, 5000 + 16 * 8)]  # other tokens after the same parent
    assert (
        index.store("a", stored([40, 41], other[64:96], parent=3))
        == precise_keys(other, SALT, 16)[4:6]
    )
    assert index.stats.expected_blocks == 0
    index.speculate("a", keys, 10.0, data)
    assert index.store("a", stored([4, 5, 6], ids[64:112], parent=3)) == keys[4:7]
    assert index.stats.expected_blocks == 3
    # two chains parting right after the held prefix, both placed before either store: each
    # store takes its own chain's keys
    index = EventIndex()
    index.store("a", stored([0, 1, 2, 3], ids[:64]))
    index.speculate("a", keys, 10.0, data)
    other_keys = precise_keys(other, SALT, 16)
    index.speculate("a", other_keys, 10.0, token_bytes(other))
    assert index.store("a", stored([4, 5], ids[64:96], parent=3)) == keys[4:6]
    assert index.store("a", stored([40, 41], other[64:96], parent=3)) == other_keys[4:6]
    assert index.stats.expected_blocks == 4
    # a store from block 0 under another salt: not the placed chain's root
    index = EventIndex()
    index.speculate("a", keys, 10.0, data)
    event = BlockStored([0, 1], None, ids[:32], 16, cache_salt="tenant-b")
    assert index.store("a", event) == precise_keys(ids[:32], "tenant-b", 16)
    assert index.stats.expected_blocks == 0
