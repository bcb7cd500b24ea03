"""Each domain's eviction order from events and placements, narrated, and against a plain
LRU model under random operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.events import CPU, GPU, BlockRemoved, BlockStored, EventIndex, precise_keys
from cachemap.keys import BlockHash
from cachemap.recency import RUN_MERGE_S, DomainRecency

SALT = "s"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ids(conversation: int, n_blocks: int) -> list[int]:
    return [conversation * 10_000 + i for i in range(16 * n_blocks)]


def test_stores_and_touches_order_a_domain_oldest_first_and_removals_and_wipes_leave() -> None:
    clock = Clock()
    index = EventIndex(track_recency=True, clock=clock)
    cold, hot = ids(1, 4), ids(2, 3)
    index.store("a", BlockStored([1, 2, 3, 4], None, cold, 16, cache_salt=SALT))
    clock.now = 10.0
    index.store("a", BlockStored([5, 6, 7], None, hot, 16, cache_salt=SALT))
    # the cold conversation's 4 blocks go first, used 30 s ago; then the hot one's, 20 s ago
    assert index.eviction_runs("a", 7, 30.0) == ((4, 30.0), (3, 20.0))
    assert index.eviction_runs("a", 2, 30.0) == ((2, 30.0),)  # only as deep as asked
    # a placement of a request sharing the cold chain's first 2 blocks uses them again
    clock.now = 25.0
    assert index.touch("a", precise_keys(cold[:32] + ids(3, 1), SALT, 16), 25.0) == 2
    assert index.eviction_runs("a", 7, 30.0) == ((2, 30.0), (3, 20.0), (2, 5.0))
    # the engine evicts one of the cold blocks, offloads another (its GPU copy gone)
    index.remove("a", BlockRemoved([4], GPU))
    index.store("a", BlockStored([3], 2, cold[32:48], 16, tier=CPU))
    index.remove("a", BlockRemoved([3], GPU))
    assert index.eviction_runs("a", 7, 30.0) == ((3, 20.0), (2, 5.0))
    index.clear("a")
    assert index.eviction_runs("a", 7, 30.0) == () and index.touch("a", [], 0.0) == 0


def test_without_tracking_nothing_is_kept() -> None:
    index = EventIndex()
    index.store("a", BlockStored([1], None, ids(1, 1), 16, cache_salt=SALT))
    assert index.eviction_runs("a", 1, 0.0) == ()
    assert index.touch("a", precise_keys(ids(1, 1), SALT, 16), 0.0) == 0


def test_uses_within_a_second_merge_into_one_run() -> None:
    recency = DomainRecency()
    keys = [BlockHash(bytes([i]) * 8) for i in range(6)]
    recency.use(keys[:2], 0.0)
    recency.use(keys[2:4], RUN_MERGE_S / 2)
    recency.use(keys[4:], 5.0)
    assert recency.runs(6, 5.0) == ((4, 5.0 - RUN_MERGE_S / 2), (2, 0.0))


operations = st.lists(
    st.tuples(
        st.sampled_from(["use", "touch", "remove"]), st.lists(st.integers(0, 30), max_size=8)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.lists(st.integers(0, 30), max_size=12))
def test_runs_are_an_lru_of_the_blocks_held(
    ops: list[tuple[str, list[int]]], excluded: list[int]
) -> None:
    """Against a model: the blocks in last-use order (ties keep their order of use), and the
    same order without a request's own blocks (`exclude`: held or not, repeated or not)."""
    recency = DomainRecency()
    model: dict[int, float] = {}  # block -> last use, insertion order = eviction order
    now = 0.0
    for op, blocks in ops:
        now += 2 * RUN_MERGE_S  # no merging: every use is its own run in the model too
        keys = [BlockHash(b.to_bytes(8, "big")) for b in blocks]
        if op == "use":
            recency.use(keys, now)
            for b in blocks:
                model.pop(b, None)
                model[b] = now
        elif op == "touch":
            held = next((i for i, b in enumerate(blocks) if b not in model), len(blocks))
            assert recency.touch(keys, now) == held
            for b in blocks[:held]:
                model.pop(b, None)
                model[b] = now
        else:
            for b, key in zip(blocks, keys, strict=True):
                assert recency.remove(key) == (model.pop(b, None) is not None)
        assert recency.num_blocks == len(model)
    expected: list[tuple[int, float]] = []
    for used in model.values():
        if expected and expected[-1][1] == now - used:
            expected[-1] = (expected[-1][0] + 1, now - used)
        else:
            expected.append((1, now - used))
    assert recency.runs(len(model), now) == tuple(expected)
    assert sum(n for n, _ in recency.runs(len(model) // 2, now)) == len(model) // 2
    skip = set(excluded)
    rest: list[tuple[int, float]] = []
    for b, used in model.items():
        if b in skip:
            continue
        if rest and rest[-1][1] == now - used:
            rest[-1] = (rest[-1][0] + 1, now - used)
        else:
            rest.append((1, now - used))
    own = [BlockHash(b.to_bytes(8, "big")) for b in excluded]
    assert recency.runs(len(model), now, own) == tuple(rest)
    half = (len(model) - len(skip & model.keys())) // 2
    assert sum(n for n, _ in recency.runs(half, now, own)) == half


def test_oldest_lists_live_runs_with_their_last_use() -> None:
    recency = DomainRecency()
    keys = [BlockHash(bytes([i]) * 8) for i in range(5)]
    recency.use(keys[:2], 0.0)
    recency.use(keys[2:4], 5.0)
    recency.use(keys[4:], 9.0)
    recency.touch(keys[2:4], 12.0)  # the middle run empties: not listed
    assert recency.oldest(8) == [(2, 0.0), (1, 9.0), (2, 12.0)]
    assert recency.oldest(1) == [(2, 0.0)]
