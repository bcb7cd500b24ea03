"""Conversation affinity (cachemap.affinity), told as stories with exact outcomes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.affinity import ConversationAffinity, Home
from cachemap.keys import BlockHash


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(name: str, n: int) -> list[BlockHash]:
    return [BlockHash(f"{name}{i}".encode()) for i in range(n)]


def test_a_conversation_finds_the_replica_of_its_previous_turn_by_its_last_block() -> None:
    table = ConversationAffinity(clock=Clock())
    a = chain("a", 5)
    assert table.lookup(a[:3]) is None  # a new conversation
    table.record(a[:3], "r1")
    home = table.lookup(a)  # turn 2 extends turn 1's three blocks
    assert home == Home("r1", 3, a[2])
    table.record(a, "r2", home)  # turn 2 went elsewhere: the conversation's home moves
    assert table.lookup(a + chain("x", 2)) == Home("r2", 5, a[4])
    assert len(table) == 1, "the superseded entry went: one entry per conversation"
    assert table.lookup(chain("b", 5)) is None, "another chain shares no block"


def test_the_deepest_recorded_prefix_wins_and_a_branch_keeps_its_own_home() -> None:
    table = ConversationAffinity(clock=Clock())
    system = chain("s", 2)
    table.record(system, "r0")  # a request that was only the shared system prompt
    mine = system + chain("m", 3)
    table.record(mine, "r3")
    assert table.lookup(mine + chain("n", 1)) == Home("r3", 5, mine[-1])
    theirs = system + chain("t", 4)
    assert table.lookup(theirs) == Home("r0", 2, system[-1])


def test_an_entry_expires_after_the_ttl_and_the_lookup_removes_it() -> None:
    clock = Clock()
    table = ConversationAffinity(ttl_s=60, clock=clock)
    a = chain("a", 4)
    table.record(a[:2], "r1")
    clock.now += 59.9
    assert table.lookup(a) == Home("r1", 2, a[1])
    clock.now += 0.1
    assert table.lookup(a) is None
    assert len(table) == 0


def test_recording_reaps_expired_entries_from_the_front() -> None:
    clock = Clock()
    table = ConversationAffinity(ttl_s=10, clock=clock)
    for i in range(3):
        table.record(chain(f"c{i}", 2), f"r{i}")
    clock.now += 10
    table.record(chain("late", 2), "r9")
    assert len(table) == 1
    assert table.lookup(chain("late", 3)) == Home("r9", 2, chain("late", 2)[1])


def test_the_capacity_bounds_the_table_least_recently_recorded_first_out() -> None:
    clock = Clock()
    table = ConversationAffinity(capacity=2, clock=clock)
    a, b, c = chain("a", 3), chain("b", 3), chain("c", 3)
    table.record(a, "r1")
    clock.now += 1
    table.record(b, "r2")
    clock.now += 1
    table.record(a + chain("a+", 1), "r1", table.lookup(a + chain("a+", 1)))  # a again
    clock.now += 1
    table.record(c, "r3")  # b is the oldest: it goes
    assert len(table) == 2
    assert table.lookup(b) is None
    assert table.lookup(a + chain("a+", 1)) is not None
    assert table.lookup(c) == Home("r3", 3, c[2])


def test_an_empty_prompt_records_nothing_and_bad_bounds_are_named() -> None:
    table = ConversationAffinity(clock=Clock())
    table.record([], "r1")
    assert len(table) == 0 and table.lookup([]) is None
    with pytest.raises(ValueError, match="capacity must be positive"):
        ConversationAffinity(capacity=0)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        ConversationAffinity(ttl_s=0)


def test_the_walk_back_is_bounded() -> None:
    from cachemap.affinity import MAX_WALK_BLOCKS

    table = ConversationAffinity(clock=Clock())
    a = chain("a", MAX_WALK_BLOCKS + 2)
    table.record(a[:3], "r1")
    assert table.lookup(a) == Home("r1", 3, a[2])  # the 2,048th block from the end
    longer = a + chain("b", 1)
    assert table.lookup(longer) is None  # one block further: not walked that far


def test_committed_counts_each_live_conversation_once_on_its_home_but_the_asker() -> None:
    """Room (issue 40): per replica, the latest prompt of every conversation homed there and
    recorded within the horizon; the asking conversation's own entry is left out."""
    clock = Clock()
    table = ConversationAffinity(clock=clock)
    a, b, c = chain("a", 40), chain("b", 30), chain("c", 20)
    table.record(a[:10], "r0")
    table.record(a, "r0", table.lookup(a))  # a's turn 2 supersedes its turn 1
    clock.now += 100
    table.record(b, "r0")
    table.record(c, "r1")
    assert table.committed(horizon_s=1_000) == {"r0": 70, "r1": 20}
    asking = table.lookup(a + chain("x", 2))
    assert asking == Home("r0", 40, a[39])
    assert table.committed(asking, horizon_s=1_000) == {"r0": 30, "r1": 20}
    clock.now += 950  # a is 1,050 s old, b and c 950 s
    assert table.committed(horizon_s=1_000) == {"r0": 30, "r1": 20}
    clock.now += 50
    assert table.committed(horizon_s=1_000) == {}


def _walked(table: ConversationAffinity, home: Home | None, horizon_s: float) -> dict[str, int]:
    """`committed` as a walk of the table from its newest entry back to the horizon."""
    out: dict[str, int] = {}
    since = table.clock() - horizon_s
    for key, (replica, at, num_blocks) in reversed(table._entries.items()):
        if at <= since:
            break
        if home is None or key != home.key:
            out[replica] = out.get(replica, 0) + num_blocks
    return out


_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["record", "extend", "ask", "wait", "ask-other"]),
        st.integers(0, 5),  # the conversation
        st.integers(1, 6),  # its length in blocks, or the wait's size
        st.sampled_from(["r0", "r1", "r2"]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_STEPS)
def test_committed_kept_as_entries_come_and_go_equals_walking_the_table(
    steps: list[tuple[str, int, int, str]],
) -> None:
    """Records (new, extending their home, replacing an entry of the same key), expiries by
    lookups and reaps, the capacity's evictions, clocks standing still and moving, asks with
    the default horizon and now and then another: every ask equals the walk."""
    clock = Clock()
    table = ConversationAffinity(capacity=4, ttl_s=2_000, clock=clock)
    waits = [0.0, 0.0, 1.0, 300.0, 700.0, 1_500.0, 2_500.0]
    for kind, conversation, size, replica in steps:
        hashes = chain(f"c{conversation}-", size)
        if kind == "record":
            table.record(hashes, replica)
        elif kind == "extend":
            table.record(hashes, replica, table.lookup(hashes))
        elif kind == "wait":
            clock.now += waits[size]
        else:
            horizon = 1_000.0 if kind == "ask" else 400.0
            home = table.lookup(hashes)
            assert table.committed(home, horizon) == _walked(table, home, horizon)


def test_an_entry_a_lookup_expires_between_two_asks_no_longer_counts() -> None:
    """Counted at the first ask; past the TTL before the second, the lookup that deletes it
    uncounts it (the second ask must not find its blocks left over)."""
    clock = Clock()
    table = ConversationAffinity(ttl_s=2_000, clock=clock)
    a, b = chain("a", 8), chain("b", 3)
    table.record(a, "r0")
    assert table.committed(horizon_s=1_000) == {"r0": 8}
    clock.now += 1_500
    table.record(b, "r1")
    clock.now += 600  # a is past the TTL (no record since to reap it), b within the horizon
    assert table.lookup(a) is None  # expired: deleted
    assert table.committed(horizon_s=1_000) == {"r1": 3}
