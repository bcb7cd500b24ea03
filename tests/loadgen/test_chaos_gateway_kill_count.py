"""gateway-killed's count of cut streams against the WAL after the restart, on the WAL shapes a
`kill -9` leaves (no processes: the count is the part under test).

The shape that failed the small suite once ("3 cut, 2 aborted records; 1 run short"): two long
streams cut before their usage (the restart wrote their aborted records) and one short stream
cut after its record's write (the kill during the usage's fsync, or before `[DONE]` reached
the client): its `ok` record is in the WAL, the response as if it had gone out
(docs/billing.md#durability), and it has no aborted record. That stream is billed; the count
must see it, and must still fail a cut stream nothing bills."""

from __future__ import annotations

from loadgen.chaos.billed import WalContents
from loadgen.chaos.gateway_kill import Kill, count, missed, short

COMPLETED = [f"req-done-{i}" for i in range(8)]


def _wal(*extra: tuple[str, str]) -> WalContents:
    return WalContents([*((i, "ok") for i in COMPLETED), *extra], [])


def _kill(cut: int, cut_ids: tuple[str, ...] = ()) -> Kill:
    return Kill(completed=list(COMPLETED), cut=cut, cut_ids=list(cut_ids))


def test_a_stream_cut_after_its_record_landed_is_counted_as_billed() -> None:
    kill = _kill(cut=3)
    count(kill, _wal(("req-landed", "ok"), ("req-long-0", "aborted"), ("req-long-1", "aborted")))
    assert (kill.aborted, kill.landed, kill.unrecorded, kill.twice) == (2, 1, 0, 0)
    assert kill.aborted < kill.cut  # the old goal (aborted records >= cut streams) missed here
    assert not short(kill) and not missed(kill)


def test_a_cut_stream_nothing_bills_still_misses_the_goal() -> None:
    kill = _kill(cut=3)  # every ok record a response the client read whole: no record for one
    count(kill, _wal(("req-long-0", "aborted"), ("req-long-1", "aborted")))
    assert (kill.aborted, kill.landed) == (2, 0)
    assert short(kill) and missed(kill)


def test_a_cut_stream_that_named_its_record_needs_that_record() -> None:
    """Its usage arrived (the record id with it), `[DONE]` did not: that id must be in the WAL,
    whatever other records make up the number."""
    named = _kill(cut=1, cut_ids=("req-named",))
    count(named, _wal(("req-named", "ok")))
    assert (named.landed, named.cut_unrecorded) == (1, 0) and not missed(named)
    other = _kill(cut=1, cut_ids=("req-named",))
    count(other, _wal(("req-else", "aborted")))
    assert other.cut_unrecorded == 1 and short(other) and missed(other)
