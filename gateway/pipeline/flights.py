"""Single flight: requests writing a prefix no replica holds yet, and the siblings waiting for
them (the gateway's side of `router.fanout`).

A leader registers the hashes of its uncached blocks when it is routed; a later request of the
same scope walks its own hashes from its matched depth while they are being written (hashes are
salted, so scopes never meet) and finds the leader writing the deepest of them. The leader
lands when its first byte arrives (the engine has prefilled, the KV is written) or fails; either
way every waiter is released at once, and a waiter never waits longer than its bound. A waiter
is never a leader while it waits, so waits cannot form a cycle. In precise mode the leader may
land earlier: when its replica's KV events report the flight's last block stored (`stored`),
the prefix is in the event index its siblings are routed on. What must happen before such a
landing releases anyone (billing makes the leader's entry visible) is the flight's `confirm`.

Across gateways (with Redis): a leader also sets a `Marker` on the flight — one key, its first
block's, holding the marker and the flight's blocks (set-if-absent, expiring after the longest
hold) — which other gateways' lookups find and compare with their own chains in the same
script call; when it lands the marker becomes "ok" (or "fail") for a few seconds and the landing
is published on a channel every gateway listens to. A waiter registers for the landing before it
reads the marker again, so a landing between its lookup and its wait is never missed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram

from cachemap.keys import BlockHash

log = logging.getLogger(__name__)

_ids = itertools.count(1)

PENDING, OK, FAIL = "pending", "ok", "fail"


@dataclass(frozen=True, slots=True)
class Marker:
    """A fan-out leader's marker on the blocks it writes, as the shared directory stores it:

        pending|<gateway id>:<flight id>|<replica>|<expected s>   while the leader writes
        ok|<gateway id>:<flight id>|<replica>                     for LANDED_TTL_S once it
        fail|<gateway id>:<flight id>|<replica>                   landed (or failed)

    The key names the leader across gateways; landings on the channel carry the same text.
    """

    state: str
    key: str
    replica: str
    expected_s: float | None = None

    def format(self) -> str:
        text = f"{self.state}|{self.key}|{self.replica}"
        return text if self.expected_s is None else f"{text}|{self.expected_s:.3f}"

    @classmethod
    def parse(cls, text: str) -> Marker | None:
        """The marker a string holds, or None when it is not one (never raises)."""
        parts = text.split("|")
        if len(parts) < 3 or parts[0] not in (PENDING, OK, FAIL):
            return None
        expected = None
        if parts[0] == PENDING and len(parts) > 3:
            try:
                expected = float(parts[3])
            except ValueError:
                expected = None
        return cls(parts[0], parts[1], parts[2], expected)

    def landed(self, ok: bool) -> Marker:
        return Marker(OK if ok else FAIL, self.key, self.replica)


@dataclass(eq=False)
class Flight:
    """One leader's write of blocks [depth, depth + len(blocks))."""

    replica: str
    blocks: Sequence[BlockHash]
    expected_s: float
    id: int = field(default_factory=lambda: next(_ids))
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    ok: bool = False
    started_s: float = field(default_factory=time.monotonic)
    marker: Marker | None = None
    """The shared marker when the flight is announced through Redis."""
    confirm: Callable[[], Awaitable[None]] | None = None
    """Awaited when the replica's events report the flight's prefix stored, before the
    landing releases the siblings (the director's landed hooks: billing's visibility)."""
    lands_on_events: bool = True
    """False: the flight lands at its first byte only (a leader whose landed hooks cannot run
    there: one Envoy forwards, with billing on)."""
    confirming: bool = False
    placed: bool = False
    """Its placement in flight went to the shared store with its marker (`Flights.lead`'s
    `place`): the director does not write it again."""
    whole: bool = False
    """The flight writes every one of its blocks (no other live flight wrote one when it led):
    it ends by popping them all, none checked (`Flights.end`)."""


@dataclass
class HoldStats:
    holds: int = 0
    released_landed: int = 0
    released_failed: int = 0
    timeouts: int = 0
    landed_on_events: int = 0
    """Leaders landed by their replica's BlockStored, before their first byte."""
    hold_seconds: list[float] = field(default_factory=list)


MAX_JOINED_FLIGHTS = 4096
"""Flights whose siblings are remembered as joined (one arrival each for a prefix's rate): far
more than are ever in flight at once, so a flight is forgotten only long after it landed."""
LANDED_TTL_S = 2.0
"""How long a landed marker stays: long enough for a sibling that looked up just before the
landing to read it when it rechecks; short, because a replica may restart after it."""


class SharedMarkers(Protocol):
    @property
    def landing_poll_s(self) -> float:
        """How often a waiter re-reads its leader's marker (the channel may miss a landing)."""
        ...

    async def lead(
        self, blocks: Sequence[BlockHash], marker: str, ttl_s: float, place_on: str | None = None
    ) -> bool:
        """Set `marker` on the flight writing `blocks` (if absent); False only when it was
        certainly not set. `place_on`: also the placement in flight of `blocks` on that
        replica, in the same call (True: it is dealt with)."""
        ...

    def land(self, blocks: Sequence[BlockHash], marker: str, landed: str, ttl_s: float) -> None: ...

    async def read_marker(self, block: BlockHash) -> str | None:
        """The marker of the flight whose first block is `block`; "" when the store answered
        that it has none (it expired, or the store lost it), None when it did not answer."""
        ...


class Flights:
    def __init__(
        self, registry: CollectorRegistry | None = None, shared: SharedMarkers | None = None
    ) -> None:
        self._writing: dict[BlockHash, Flight] = {}
        self._lasts: dict[BlockHash, Flight] = {}
        """The flights of `_writing` that write their own last block, by it (`stored` looks
        for these only)."""
        self._remote: dict[str, asyncio.Future[Marker]] = {}
        self._waiting: dict[str, int] = {}
        self.shared = shared
        self.gateway_id = os.urandom(4).hex()
        self.stats = HoldStats()
        self._confirming: set[asyncio.Task[None]] = set()
        self._joined: OrderedDict[str, None] = OrderedDict()
        self._histogram = Histogram(
            "kvgate_fanout_hold_seconds",
            "How long siblings waited for their leader's write.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )

    def find(self, hashes: Sequence[BlockHash], depth: int) -> tuple[Flight, int] | None:
        """The flight writing the deepest of `hashes[depth:]` contiguously, and that depth."""
        found: Flight | None = None
        shared = depth
        for i in range(depth, len(hashes)):
            flight = self._writing.get(hashes[i])
            if flight is None:
                break
            found, shared = flight, i + 1
        return (found, shared) if found is not None else None

    def writing(self, block: BlockHash) -> Flight | None:
        """The live flight of this gateway writing `block`, if any."""
        return self._writing.get(block)

    def key(self, flight: Flight) -> str:
        """A flight's name across gateways (its marker's key)."""
        return f"{self.gateway_id}:{flight.id}"

    def join(self, key: str) -> bool:
        """A sibling joined the flight named `key`: True for its first sibling only (the
        siblings of one flight are one arrival for their prefix's rate)."""
        if key in self._joined:
            return False
        self._joined[key] = None
        while len(self._joined) > MAX_JOINED_FLIGHTS:
            self._joined.popitem(last=False)
        return True

    async def lead(
        self,
        replica: str,
        blocks: Sequence[BlockHash],
        expected_s: float,
        ttl_s: float,
        place: bool = False,
    ) -> Flight:
        """Register a leader; blocks another live flight already writes stay with it. With a
        shared store the leader is announced to other gateways too (markers live `ttl_s`).
        `place`: `blocks` are all the request's replica does not hold, and the store writes
        their placement in flight with the marker (`Flight.placed` when it did)."""
        flight = Flight(replica, blocks, expected_s)
        before = len(self._writing)
        # one C loop, not a Python step a block (a precise request at bench point 2 has ~730)
        deque(map(self._writing.setdefault, blocks, repeat(flight)), maxlen=0)
        # as many new entries as blocks: each is this flight's (a chain's blocks are distinct;
        # a repeat only sends `end` the checking way), and stays so until it ends
        flight.whole = len(self._writing) - before == len(blocks)
        if blocks and self._writing[blocks[-1]] is flight:
            self._lasts[blocks[-1]] = flight
        if self.shared is not None:
            # set before the call: a call cancelled (or timed out) on its way may have set the
            # marker all the same, and only the leader's landing clears it before its ttl
            flight.marker = Marker(PENDING, self.key(flight), replica, expected_s)
            try:
                place_on = replica if place else None
                if not await self.shared.lead(blocks, flight.marker.format(), ttl_s, place_on):
                    flight.marker = None  # not sent: nothing to land
                else:
                    flight.placed = place
            except BaseException:  # cancelled while announcing: nobody will end it but us
                self.end(flight, ok=False)
                raise
        return flight

    def end(self, flight: Flight, ok: bool) -> None:
        if flight.landed.is_set():
            return
        flight.ok = ok
        blocks = flight.blocks
        if flight.whole:  # ~half the checking way's 49 µs a 730-block flight (thread CPU)
            own: Sequence[BlockHash] = blocks
        else:
            own = list(compress(blocks, map(is_, map(self._writing.get, blocks), repeat(flight))))
        deque(map(self._writing.pop, own, repeat(None)), maxlen=0)
        if blocks and self._lasts.get(blocks[-1]) is flight:
            del self._lasts[blocks[-1]]
        flight.landed.set()
        if flight.marker is not None and self.shared is not None:
            landed = Marker(flight.marker.state, flight.marker.key, flight.replica).landed(ok)
            self.shared.land(flight.blocks, flight.marker.format(), landed.format(), LANDED_TTL_S)

    def stored(self, replica: str, keys: Sequence[BlockHash]) -> None:
        """`replica`'s engine reports `keys` stored (its KV events): a flight of that replica
        whose last block is among them has written its prefix, so it lands now — after its
        `confirm`, when it has one (in a task: this runs inside the event intake). A flight
        whose last block another flight writes lands at its first byte, as before."""
        lasts = self._lasts
        if not lasts:  # nothing in flight: the usual case of a live feed's event
            return
        # the keys that are a flight's last block, found in one C loop (a Python step a key
        # was ~1% of a precise gateway's CPU at bench point 2, py-spy)
        for key in list(filter(lasts.__contains__, keys)):
            flight = lasts.get(key)
            if (
                flight is not None
                and flight.replica == replica
                and flight.lands_on_events
                and not flight.confirming
                and not flight.landed.is_set()
            ):
                if flight.confirm is None:
                    self.stats.landed_on_events += 1
                    self.end(flight, ok=True)
                    continue
                flight.confirming = True
                task = asyncio.get_running_loop().create_task(self._confirm(flight))
                self._confirming.add(task)
                task.add_done_callback(self._confirming.discard)

    async def _confirm(self, flight: Flight) -> None:
        """Land a flight on its events once its `confirm` ran; if it failed, the flight lands
        at its first byte (or fails) as without events."""
        assert flight.confirm is not None
        try:
            await flight.confirm()
        except Exception:
            log.exception("a fan-out leader's landing on its KV events failed; it lands later")
            return
        if not flight.landed.is_set():
            self.stats.landed_on_events += 1
            self.end(flight, ok=True)

    # -- other gateways' leaders ----------------------------------------------------------------
    def notify(self, text: str) -> None:
        """A landing announced on the channel (a landed `Marker`)."""
        landed = Marker.parse(text)
        if landed is not None and landed.state != PENDING:
            future = self._remote.get(landed.key)
            if future is not None and not future.done():
                future.set_result(landed)

    async def wait_remote(
        self, key: str, timeout_s: float, recheck: Callable[[], Awaitable[str | None]]
    ) -> Marker | None:
        """Wait for another gateway's leader `key`; its landed marker, or None on timeout."""
        self.stats.holds += 1
        started = time.monotonic()
        future = self._remote.get(key)
        if future is None:
            future = self._remote[key] = asyncio.get_running_loop().create_future()
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            landed = await self._await_landing(key, future, timeout_s, recheck)
            if landed is None:
                self.stats.timeouts += 1
        finally:
            held = time.monotonic() - started
            self._histogram.observe(held)
            self.stats.hold_seconds.append(held)
            del self.stats.hold_seconds[:-4096]
            self._waiting[key] -= 1
            if not self._waiting[key]:  # the last waiter cleans up
                del self._waiting[key]
                self._remote.pop(key, None)
        if landed is not None:
            if landed.state == OK:
                self.stats.released_landed += 1
            else:
                self.stats.released_failed += 1
        return landed

    async def _await_landing(
        self,
        key: str,
        future: asyncio.Future[Marker],
        timeout_s: float,
        recheck: Callable[[], Awaitable[str | None]],
    ) -> Marker | None:
        """The landing, from the channel (`notify`) or from re-reading the marker: first at
        once (it may have landed between the lookup and now), then every `landing_poll_s`
        (pub/sub may be down or lose a message). None when `timeout_s` passes first. A marker
        the store no longer has (expired, or lost with the store's state) will never land: the
        waiter is released as if its leader had failed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            text = await recheck()
            if text == "":
                return Marker(FAIL, key, "")
            current = Marker.parse(text) if text is not None else None
            if current is not None and current.state != PENDING:
                return current
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            poll_s = self.shared.landing_poll_s if self.shared is not None else remaining
            try:
                return await asyncio.wait_for(asyncio.shield(future), min(remaining, poll_s))
            except TimeoutError:
                continue

    async def wait(self, flight: Flight, timeout_s: float) -> bool:
        """Wait for a leader; True when it landed (its replica now holds the prefix)."""
        self.stats.holds += 1
        started = time.monotonic()
        try:
            await asyncio.wait_for(flight.landed.wait(), timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
            return False
        finally:
            held = time.monotonic() - started
            self._histogram.observe(held)
            self.stats.hold_seconds.append(held)
            del self.stats.hold_seconds[:-4096]
        if flight.ok:
            self.stats.released_landed += 1
        else:
            self.stats.released_failed += 1
        return flight.ok

    def __len__(self) -> int:
        return len(self._writing)
