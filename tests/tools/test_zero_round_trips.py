"""`tools.zero_round_trips`: when a lookup counts as answerable from a gateway's memory."""

from __future__ import annotations

from loadgen.traces.readers import TraceRequest
from tools.zero_round_trips import served_from_memory


def turns(*arrivals: float) -> list[TraceRequest]:
    """One chain of two blocks looked up again at each arrival (one gateway sees them all)."""
    return [TraceRequest(i, t, 1024, 8, (1, 2)) for i, t in enumerate(arrivals)]


def test_a_lookup_is_fresh_only_when_nothing_it_reads_changed_since_it_read_it() -> None:
    requests = turns(0.0, 10.0, 20.0)
    # turn 1 reads a block nobody recorded; turn 2 reads block 2 for the first time; turn 3
    # reads what turn 2 read, but turn 2's record rewrote it since
    assert (
        served_from_memory(requests, 1, bcast=False, own_writes_invalidate=True, skip_s=0.0) == 0.0
    )
    # the gateway's own record does not invalidate its copy: turn 3 is fresh
    fresh = served_from_memory(requests, 1, bcast=False, own_writes_invalidate=False, skip_s=0.0)
    assert fresh == 1 / 3
    # a record of blocks used within the skip window writes nothing: turn 3 is fresh too
    assert (
        served_from_memory(requests, 1, bcast=False, own_writes_invalidate=True, skip_s=60.0)
        == 1 / 3
    )


def test_another_gateways_write_invalidates_whatever_the_variant() -> None:
    # round robin over two gateways: each turn's blocks were last written by the other one;
    # in broadcast mode the first turn's never-written block is known absent (an empty Redis)
    requests = turns(0.0, 10.0, 20.0, 30.0)
    for bcast, expected in ((False, 0.0), (True, 1 / 4)):
        assert (
            served_from_memory(requests, 2, bcast=bcast, own_writes_invalidate=False, skip_s=0.0)
            == expected
        )
