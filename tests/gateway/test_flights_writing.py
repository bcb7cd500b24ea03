"""Which live flight writes a block, through leaders whose blocks overlap, repeat, and end in
any order (`Flights.end` pops a flight that took all its blocks unchecked)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.keys import BlockHash
from gateway.pipeline.flights import Flight, Flights

_BLOCKS = [BlockHash(bytes([i]) * 16) for i in range(8)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("lead"), st.lists(st.sampled_from(_BLOCKS), max_size=6)),
            st.tuples(st.just("end"), st.integers(0, 20)),
        ),
        max_size=20,
    )
)
def test_a_block_is_written_by_its_first_live_leader(ops: list[tuple[str, object]]) -> None:
    """The model: a block is its first leader's among the flights not ended; `find` from 0
    and `writing` answer by it after every lead and end."""

    async def run() -> None:
        flights = Flights()
        live: list[Flight] = []
        writer: dict[BlockHash, Flight] = {}
        for op, arg in ops:
            if op == "lead":
                assert isinstance(arg, list)
                flight = await flights.lead("r", arg, 1.0, 10.0)
                live.append(flight)
                for block in arg:
                    writer.setdefault(block, flight)
            elif live:
                assert isinstance(arg, int)
                flight = live.pop(arg % len(live))
                flights.end(flight, ok=True)
                writer = {b: f for b, f in writer.items() if f is not flight}
            for block in _BLOCKS:
                assert flights.writing(block) is writer.get(block)
            assert len(flights) == len(writer)

    asyncio.run(run())
