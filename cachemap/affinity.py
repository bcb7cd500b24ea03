"""Conversation affinity: where each conversation's latest request went, kept after its KV is
gone (issue 40).

A conversation's next request extends its previous prompt, and hash(i) names the whole prefix
up to block i (`cachemap.keys`), so the next request's chain holds the previous request's last
block hash. The table maps that hash to the replica the router sent the request to:

    record(hashes, replica):   table[hashes[-1]] = (replica, now)   (the entry it extended goes)
    lookup(hashes):            the deepest d with hashes[d-1] in the table, walked from the end
                               ──▶ Home(replica, d, key)            (None: a new conversation)

The directory forgets a block when its engine evicts it; this table forgets a conversation only
by age (`ttl_s`: an entry older than that matches nothing) and by room (`capacity`: least
recently recorded first out). So "the conversation's KV is evicted everywhere" still knows the
replica its previous turns went to, which precise mode's directory, exact about residency,
does not (docs/precise.md, "Conversation affinity").

Worked example (64-token blocks; the tenant's salt in every hash):

    turn 1, blocks a b c        ──▶ r1; record: {c: r1}
    turn 2, blocks a b c d e    lookup: c at depth 3 ──▶ Home(r1, 3); routed to r1;
                                record: {e: r1} (c dropped: one entry per conversation)
    turn 3 after an hour's pause, every replica evicted it: lookup finds e ──▶ Home(r1, 5),
    unless the TTL passed: None.

Salted hashes keep tenants apart: two tenants' chains share no hash, so a lookup never returns
a home another tenant's conversation made.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress

from cachemap.directory import DIRECTORY_CLOCK, Clock
from cachemap.keys import BlockHash

DEFAULT_AFFINITY_CAPACITY = 65_536
"""Conversations remembered per gateway: an entry is a 16-byte key, a replica id and a time in
an OrderedDict node (~200 bytes), so 64k conversations are ~13 MB. A fleet serves far fewer
conversations within the TTL (the issue's trace: 142 sessions in 10.8 hours)."""

DEFAULT_AFFINITY_TTL_S = 3_600.0
"""A conversation silent for an hour is treated as new: a coding agent's human pauses (review,
a meeting, a long build) last minutes to an hour; past that, the replica it went to is as good
as any other (its KV is long gone there too, and the load has moved)."""

DEFAULT_SESSION_HORIZON_S = 1_200.0
"""A conversation recorded within 20 minutes still counts against its home's room
(`ConversationAffinity.committed`): an agent's pauses (a review, a build) last minutes, and its
KV at home is what it comes back for; a conversation silent for longer has likely ended.
docs/precise.md, "Room": 600 / 1,200 / 3,600 s gave 92.7 / 93.4 / 91.4% of the shared LRU."""

MAX_WALK_BLOCKS = 2_048
"""A lookup walks at most this many blocks back from the end: a turn that added more (32k
tokens at the engines' 16-token blocks, ~128k at the directory's 256-byte ones) finds no home.
It bounds the walk of a new conversation, which finds nothing: 2,048 dict probes (~0.1 ms)
rather than a 200k-token prompt's 12,500."""

_REAP_PER_RECORD = 8
"""Expired entries removed from the LRU's front per record(): bounded work on the hot path,
more than one per record so expired entries never pile up behind live ones."""


@dataclass(frozen=True, slots=True)
class Home:
    """Where a request's conversation went last: `replica`, with `depth_blocks` of this
    request's blocks making up that previous request's prompt (`key` is its last block)."""

    replica: str
    depth_blocks: int
    key: BlockHash


class ConversationAffinity:
    """Conversations' last replicas, keyed by the last block of each routed request's chain.

    Invariants:
    - len(self) <= capacity after every record();
    - an entry recorded at t matches no lookup at or after t + ttl_s (and lookups delete the
      expired entries they step on);
    - the LRU is in recording order (front: recorded longest ago), so the expired entries are
      at its front and record() reaps them from there;
    - a record that extends a looked-up home replaces it: one entry per conversation thread,
      so `committed` counts each conversation's latest prompt once;
    - once `committed` has been asked with a horizon, `_counted` is, per replica, the blocks of
      the entries recorded after `_edge` (that horizon before the last ask), and `_records`
      holds those entries' records in recording order: each entry leaving or replaced is
      uncounted, and an ask moves the edge up to its own horizon by uncounting the records it
      passes (so an ask costs the records that aged out since the last, not a walk of every
      conversation within the horizon: ~1,000 at bench point 2, 2.5% of a precise gateway's
      py-spy samples).
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_AFFINITY_CAPACITY,
        ttl_s: float = DEFAULT_AFFINITY_TTL_S,
        clock: Clock = DIRECTORY_CLOCK,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"affinity capacity must be positive, got {capacity}")
        if not ttl_s > 0:
            raise ValueError(f"affinity ttl_s must be positive, got {ttl_s}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[BlockHash, tuple[str, float, int]] = OrderedDict()
        self._horizon_s: float | None = None
        """The horizon `_counted` is kept for (None: not kept; the first ask starts it)."""
        self._edge = float("-inf")
        self._counted: dict[str, int] = {}
        self._records: deque[tuple[BlockHash, tuple[str, float, int]]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, hashes: Sequence[BlockHash]) -> Home | None:
        """The deepest recorded block of `hashes` that has not expired, walking from the end
        (a conversation's previous request is usually a few blocks short of this one), at
        most `MAX_WALK_BLOCKS` deep."""
        entries = self._entries
        if not entries:
            return None
        expired_before = self.clock() - self.ttl_s
        low = max(len(hashes) - MAX_WALK_BLOCKS, 0)
        tail = hashes[low:]
        # the recorded blocks from the end, found by C loops: a new conversation's walk found
        # nothing in a Python step a block (~730 at bench point 2's 16-token blocks: 2.5% of a
        # precise gateway's py-spy samples)
        recorded = compress(range(len(tail) - 1, -1, -1), map(entries.__contains__, reversed(tail)))
        for i in recorded:
            key = tail[i]
            entry = entries[key]
            replica, at, _ = entry
            if at <= expired_before:
                del entries[key]
                self._uncount(entry)
                continue
            return Home(replica, low + i + 1, key)
        return None

    def committed(
        self, home: Home | None = None, horizon_s: float = DEFAULT_SESSION_HORIZON_S
    ) -> dict[str, int]:
        """Per replica, the blocks of the conversations whose home it is, recorded within the
        last `horizon_s` (their previous prompts: the KV they come back for), but `home`'s own.
        Kept as entries come and go (the class's invariants): O(records aged out since the
        last ask); a first ask, another horizon or a clock gone back walks the table once."""
        since = self.clock() - horizon_s
        if horizon_s != self._horizon_s or since < self._edge:
            self._recount(horizon_s, since)
        else:
            counted = self._counted
            records = self._records
            entries = self._entries
            while records and records[0][1][1] <= since:
                key, entry = records.popleft()
                if entries.get(key) is entry:  # still there: it ages out of the horizon now
                    counted[entry[0]] -= entry[2]
            self._edge = since
        out = {replica: blocks for replica, blocks in self._counted.items() if blocks}
        own = self._entries.get(home.key) if home is not None else None
        if own is not None and own[1] > since:
            left = out[own[0]] - own[2]
            if left:
                out[own[0]] = left
            else:
                del out[own[0]]
        return out

    def _recount(self, horizon_s: float, since: float) -> None:
        """Start `_counted` over for `horizon_s`: the entries recorded after `since`."""
        self._horizon_s = horizon_s
        self._edge = since
        counted: dict[str, int] = {}
        self._counted = counted
        self._records = deque()
        for key, entry in self._entries.items():
            if entry[1] > since:
                counted[entry[0]] = counted.get(entry[0], 0) + entry[2]
                self._records.append((key, entry))

    def _uncount(self, entry: tuple[str, float, int]) -> None:
        """`entry` left the table (or was replaced): it no longer counts."""
        if self._horizon_s is not None and entry[1] > self._edge:
            self._counted[entry[0]] -= entry[2]

    def record(self, hashes: Sequence[BlockHash], replica: str, home: Home | None = None) -> None:
        """The request of `hashes` went to `replica`; `home` is what lookup() returned for it,
        whose entry this one supersedes."""
        if not hashes:
            return
        entries = self._entries
        now = self.clock()
        if home is not None and home.key != hashes[-1]:
            gone = entries.pop(home.key, None)
            if gone is not None:
                self._uncount(gone)
        key = hashes[-1]
        replaced = entries.get(key)
        if replaced is not None:
            self._uncount(replaced)
        entries[key] = entry = (replica, now, len(hashes))
        entries.move_to_end(key)
        if self._horizon_s is not None and now > self._edge:
            self._counted[replica] = self._counted.get(replica, 0) + entry[2]
            self._records.append((key, entry))
            if len(self._records) > 2 * self.capacity:  # asked no more: stop keeping it
                self._horizon_s = None
                self._records.clear()
        expired_before = now - self.ttl_s
        for _ in range(_REAP_PER_RECORD):
            oldest = next(iter(entries.values()))
            if oldest[1] > expired_before:
                break
            self._uncount(entries.popitem(last=False)[1])
        while len(entries) > self.capacity:
            self._uncount(entries.popitem(last=False)[1])
        assert len(entries) <= self.capacity
