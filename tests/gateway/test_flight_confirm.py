"""A fan-out flight landed by its replica's KV events releases its siblings only after its
`confirm` ran (billing makes the leader's entry visible there); a confirm that fails leaves
the flight to land at its first byte, as without events."""

from __future__ import annotations

import asyncio

from cachemap.keys import BlockHash
from gateway.pipeline.flights import Flights

BLOCKS = [BlockHash(bytes([i]) * 16) for i in range(3)]


async def test_a_landing_on_events_waits_for_its_confirm_and_happens_once() -> None:
    flights = Flights()
    flight = await flights.lead("r1", BLOCKS, expected_s=1.0, ttl_s=5.0)
    entered, go = asyncio.Event(), asyncio.Event()
    confirms: list[str] = []

    async def confirm() -> None:
        confirms.append("r1")
        entered.set()
        await go.wait()

    flight.confirm = confirm
    sibling = asyncio.ensure_future(flights.wait(flight, 5.0))
    flights.stored("r2", BLOCKS)  # another replica stored them: not this flight's landing
    flights.stored("r1", BLOCKS[:2])  # not its last block yet
    await asyncio.sleep(0)
    assert not confirms
    flights.stored("r1", BLOCKS[2:])
    await asyncio.wait_for(entered.wait(), 1.0)
    flights.stored("r1", BLOCKS[2:])  # the event again while confirming: one confirm only
    await asyncio.sleep(0)
    assert not sibling.done() and not flight.landed.is_set()
    go.set()
    assert await asyncio.wait_for(sibling, 1.0)
    assert confirms == ["r1"] and flights.stats.landed_on_events == 1 and not len(flights)


async def test_a_failed_confirm_leaves_the_flight_to_its_first_byte() -> None:
    flights = Flights()
    flight = await flights.lead("r1", BLOCKS, expected_s=1.0, ttl_s=5.0)

    async def confirm() -> None:
        raise RuntimeError("the store is away")

    flight.confirm = confirm
    flights.stored("r1", BLOCKS)
    for _ in range(10):
        await asyncio.sleep(0)
    assert not flight.landed.is_set() and flights.stats.landed_on_events == 0
    flights.end(flight, ok=True)  # its first byte
    assert await flights.wait(flight, 1.0)


async def test_a_flight_that_lands_only_at_its_first_byte_ignores_its_events() -> None:
    flights = Flights()
    flight = await flights.lead("r1", BLOCKS, expected_s=1.0, ttl_s=5.0)
    flight.lands_on_events = False
    flights.stored("r1", BLOCKS)
    await asyncio.sleep(0)
    assert not flight.landed.is_set() and flights.stats.landed_on_events == 0
