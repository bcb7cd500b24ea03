"""The load view shared by every gateway on one Redis (issue 16, shared mode; issue 17, workers).

A gateway's load bound counts its own requests exactly — each one in flight on a replica, its
uncached prefill until its first token, its expected output until its end (`Lease`) — and the
requests other gateways sent there only through the engine's /metrics: a count of waiting and
running requests, a second old, each assumed the size of this gateway's mean. Behind a Service
spreading requests over N gateways (or `--workers N`), that leaves each gateway seeing its own
1/N of the fleet's prefill exactly and the rest coarsely and late, so two gateways pile long
prefills onto the same replica between scrapes.

Here every gateway publishes its own per-replica figures and reads everyone else's, one call
per round (`round_s`, 0.1 s by default) on a connection of the rounds' own:

    kvg:{kvg-load}:gateways   hash   gateway id -> "<Redis ms>|<its figures>"

A Lua script stamps this gateway's entry with Redis's clock, drops every entry older than
`stale_s` (a gateway that died or lost Redis stops counting within it), and returns the
others'. It runs when this gateway's figures changed since its last write, and once a
heartbeat; a round between (most rounds of a busy gateway: its figures move a few times a
request, its rounds run 10 to 40 times a second) only reads the hash and leaves out the stale
entries and its own itself, by Redis's clock as its last write read it. The peers see the same
figures either way.

The peers' sums land on each `ReplicaState` as `peer` (`ReplicaState.snapshot` adds them to
its own), and a scrape counts them as known (`own_*_at_scrape`), so the engine's queue is
not counted twice: the engine-derived estimate is left for requests no gateway on this Redis
sent. A round is one round trip; an idle gateway (nothing in flight here, nothing seen of its
peers) goes to Redis once a second only, with an empty list (a heartbeat), and at its next
0.1-s round once it has a request in flight.

A round's period does not reach inside a burst (the Mooncake trace's requests come ten to an
arrival millisecond): between two rounds, every gateway would place its share of a burst on the
same view. So a placement is published at once too (`wake`, `publish`: one HSET of this
gateway's figures, stamped with Redis's clock as the last write read it, down the rounds' lane,
at most one a loop turn, off the request path), and the peers' figures are read in the lookup's
own round trip: the hash's HGETALL rides ahead of each pipelined batch of lookups on their lane
(`ride`, `cachemap.redis.lookups.Rider`; one in flight at a time, and only while the last
answer showed a peer), so a decision counts every peer's placement that reached Redis before
its lookup did. On a Cluster the hash is in another slot: the read goes down that master's lane
beside the lookups (`NodeLanes.ride`), and a lookup answered before it routes on the previous
read's figures. Releases (a first token, an end) are published the same way (`changed`), so a
peer's next read counts them: they reached it at this gateway's next round, then the peer's
(up to two rounds, 0.8 trace s at the bench's time scale, while a request waited there for the
room). `kvgate sim --gateways 4 --placement-delay-ms 1.5 --routing-ms 1` models it
(docs/design/directory.md, "Four gateways' hit ratio").

With every change published as it happens, a busy gateway's round writes only its heartbeat
(the script, once a second), and its read repeats the reads in the lookups' round trips: a
round due less than a round after such a read is left out (`fresh`). A round still reads while
no lookup has (a gateway whose requests all wait, or have not come yet).

Even read in the lookup's round trip, a peer's placement reaches this gateway's view a round
trip and a loop turn after it was made: the gateways deciding their shares of one burst at the
same instant each see none of the others' and send their new prompts to the same least-loaded
replica (a herd). So each gateway also knows its place among its live peers (`herd`: how many
there are, and how many of their ids sort before its own, from the names the hash's reads
return), and the router ranks a load tie as the gateways' requests of one instant would be
placed in that order (`router.herd`; the `spread_herd` setting). With `pace_s` (the
`herd_pace_ms` setting, off by default) a burst's next decision also waits until the peers'
placements of the last one's instant can have reached Redis, and reads them (`pace`).

The herd rule reaches a gateway's first request of a burst only. With `ahead` (the
`place_ahead` setting) each request also registers its routing inputs and is decided on the
published load with the requests registered before it and not yet published placed first
(`register`, `decided`; `gateway.fleet.ahead`, `router.ahead`); a write of this gateway's
figures takes its decided requests out of that list in the same call.

When Redis is unreachable the peers' figures from the last answer stand until `stale_s` past it,
then go to zero: the gateway routes on its own figures and the engines', as it did before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
from redis.asyncio.cluster import RedisCluster

from cachemap.redis.client import AnyRedis
from cachemap.redis.lookups import LookupLane
from cachemap.redis.node_lanes import NodeLanes
from gateway.fleet.ahead import (
    AHEAD_KEY,
    AHEAD_TTL_MS,
    PUBLISH,
    REGISTER,
    ahead_keys,
    encode_route,
    parse_entries,
)
from gateway.tasks import BackgroundTasks
from router.ahead import Ahead, ties_by_id
from router.types import RouteRequest

if TYPE_CHECKING:  # the replica set holds this module's SharedLoad
    from gateway.fleet.replicas import ReplicaState

log = logging.getLogger(__name__)

LOAD_KEY = b"kvg:{kvg-load}:gateways"

# KEYS: the load hash. ARGV: this gateway's id, its figures ("" on leaving), the stale bound ms.
# Stamps this gateway's entry with Redis's clock, drops the entries past the bound, returns
# Redis's clock (ms) and the other gateways' figures.
SHARE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = tonumber(ARGV[3])
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], now .. '|' .. ARGV[2])
end
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for j = 1, #all, 2 do
  local v = all[j + 1]
  local bar = string.find(v, '|', 1, true)
  local stamp = bar and tonumber(string.sub(v, 1, bar - 1))
  if not stamp or now - stamp > stale then
    redis.call('HDEL', KEYS[1], all[j])
  elseif all[j] ~= ARGV[1] then
    out[#out + 1] = string.sub(v, bar + 1)
  end
end
redis.call('PEXPIRE', KEYS[1], stale * 4)
return {now, out}
"""


@dataclass(slots=True)
class PeerLoad:
    """Other gateways' requests on one replica, summed."""

    num_inflight: int = 0
    num_prefilling: int = 0
    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0


NO_PEERS = PeerLoad()
"""A replica no peer has a request on (or no shared load)."""

WITHDRAW_DEADLINE_S = 0.5
ROUND_DEADLINE_S = 1.0
"""A round that Redis has not answered within this fails (the client's socket timeout, which
bounded it when it went through the client's pool)."""
HEARTBEAT_S = 1.0
"""An idle round — nothing in flight here, none published last time, no peer's load seen —
goes to Redis at most this often: an idle gateway's rounds were 0.4–0.6% of a core with 64
replicas (`kvgate bench-idle`), for an empty list its peers do not need ten times a second. A
gateway turning busy publishes at its next 0.1-s round; one turning idle publishes its empty
list at once."""
DEFAULT_STALE_ROUNDS = 10
MIN_STALE_S = 3.0
"""A gateway's entry counts for 10 rounds past its last write, and at least 3 heartbeats (an
idle gateway writes once a second; an event loop stalled by a long request parse must not
flicker out of its peers' view either)."""


EMPTY = b"[]"
"""An idle gateway's figures."""


def encode(states: Iterable[ReplicaState]) -> bytes:
    """This gateway's figures: per replica with a request of its in flight, [url, in flight,
    prefilling, pending prefill tokens, expected output tokens]."""
    return orjson.dumps(
        [
            [
                s.url,
                s.num_inflight,
                s.num_prefilling,
                round(s.pending_prefill_tokens),
                round(s.decode_tokens),
            ]
            for s in states
            if s.num_inflight > 0
        ]
    )


Row = tuple[str, int, int, float, float]
"""One replica's figures in a gateway's entry (`encode`), negative figures read as zero."""


def parse(blob: bytes) -> list[Row] | None:
    """A gateway's figures, or None when they cannot be read (a gateway of another version, a
    corrupted value — never a crash)."""
    try:
        return [
            (
                str(url),
                max(int(inflight), 0),
                max(int(prefilling), 0),
                max(float(prefill), 0.0),
                max(float(output), 0.0),
            )
            for url, inflight, prefilling, prefill, output in orjson.loads(blob)
        ]
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None


def _add(out: dict[str, PeerLoad], rows: list[Row], sign: int = 1) -> None:
    for url, inflight, prefilling, prefill, output in rows:
        peer = out.get(url)
        if peer is None:
            peer = out[url] = PeerLoad()
        peer.num_inflight += sign * inflight
        peer.num_prefilling += sign * prefilling
        peer.prefill_tokens += sign * prefill
        peer.decode_tokens += sign * output
        if sign < 0 and peer == NO_PEERS:
            del out[url]


def decode(blobs: Iterable[bytes]) -> tuple[dict[str, PeerLoad], int]:
    """The peers' figures summed per replica, and how many entries were malformed (skipped)."""
    out: dict[str, PeerLoad] = {}
    malformed = 0
    for blob in blobs:
        rows = parse(blob)
        if rows is None:
            malformed += 1
        else:
            _add(out, rows)
    return out, malformed


class PeerSums:
    """The peers' figures summed per replica, kept from one read to the next: an entry whose
    value is the one read last time is neither parsed nor added again. A read in every
    lookup's round trip would otherwise parse and sum every peer's every row (`decode`: ~3 ms
    at 15 peers with requests on 64 replicas each, on a busy 2-core machine); between two
    reads a few peers' entries change."""

    def __init__(self) -> None:
        self._rows: dict[bytes, tuple[bytes, list[Row]]] = {}
        self._sums: dict[str, PeerLoad] = {}

    def fold(self, entries: dict[bytes, bytes]) -> int:
        """The peers' entries now (name -> figures): what changed is taken out and added
        again, what is gone taken out. Returns how many entries were malformed (skipped)."""
        for name in [name for name in self._rows if name not in entries]:
            _add(self._sums, self._rows.pop(name)[1], -1)
        malformed = 0
        for name, blob in entries.items():
            held = self._rows.get(name)
            if held is not None:
                if held[0] == blob:
                    continue
                _add(self._sums, self._rows.pop(name)[1], -1)
            rows = parse(blob)
            if rows is None:
                malformed += 1
                continue
            self._rows[name] = (blob, rows)
            _add(self._sums, rows)
        return malformed

    def view(self) -> dict[str, PeerLoad]:
        """The sums, copied (the next fold changes its own)."""
        return {url: replace(peer) for url, peer in self._sums.items()}


class SharedLoad:
    """Publishes this gateway's figures and applies its peers' to `states` (module docstring).
    `states()` gives the replica states to publish and to update (the replica set's, its
    retired ones included: their requests still run)."""

    def __init__(
        self,
        client: AnyRedis,
        states: Callable[[], Iterable[ReplicaState]],
        round_s: float,
        gateway_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        spread_herd: bool = True,
        pace_s: float = 0.0,
        ahead: bool = False,
    ) -> None:
        self.client = client
        self.states = states
        self.round_s = round_s
        self.stale_s = max(MIN_STALE_S, DEFAULT_STALE_ROUNDS * round_s)
        self._stale_ms = int(self.stale_s * 1000)
        self.gateway_id = gateway_id or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self.clock = clock
        self._sha = client.register_script(SHARE).sha
        self._lane: LookupLane | NodeLanes = (
            NodeLanes(client, SHARE, self._sha)
            if isinstance(client, RedisCluster)
            else LookupLane(client, SHARE, self._sha)
        )
        """The rounds' own connection (`cachemap.redis.lookups`): a round's command is written
        and its reply read there, without the client's per-call machinery (a pooled connection
        taken and given back, the retry wrapper, the send's `wait_for`): ~45% of a call's CPU
        in a tight loop, less in a gateway, where the loop's wake-up and the socket's write
        and read are most of a round (docs/design/directory.md, "The tier's CPU per
        request")."""
        self._tasks = BackgroundTasks("shared load")
        self._answered_s = 0.0
        self._called_s = -math.inf
        self._written: bytes | None = None
        """The figures of this gateway's last write (None: none since it started)."""
        self._written_s = -math.inf
        self._offset_ms = 0.0
        """Redis's clock minus `clock`, in ms, at the last write (the script returns its
        clock)."""
        self._busy = False
        """This gateway published requests in flight, or saw a peer's, at its last call."""
        self._waker: asyncio.Future[None] | None = None
        """Set while the loop sleeps idle (`_idle`): resolved by a lease (`wake`)."""
        self._read_s = -math.inf
        """When the peers' figures were last read outside the rounds (`ride`, `pace`,
        `register`): a round within `round_s` of it only repeats it (`fresh`)."""
        self.ticks = 0
        """The loop's wake-ups (each a round, due or not)."""
        self.skipped = 0
        """Rounds due but left out: the view was `fresh`."""
        self.rounds = 0
        self.writes = 0
        """Rounds that ran the script (the others only read)."""
        self.failed = 0
        self.malformed = 0
        self.num_peers = 0
        self.rank = 0
        """How many of the live peers' ids sort before this gateway's, as the last read of the
        hash's names said (the script's answer carries figures only: a round that ran it
        keeps the last read's rank; every read in a lookup's round trip renews it)."""
        self.spread_herd = spread_herd
        """Rank load ties by this gateway's place among its peers (`herd`, `router.herd`)."""
        self.pace_s = pace_s
        """With peers: the least time between two of this gateway's decisions (`pace`; 0:
        off)."""
        self._next_decision_s = -math.inf
        self.paced = 0
        """Decisions that waited their turn (`pace`), each on a read of the peers' figures."""
        self.key = LOAD_KEY
        self.deadline_s = ROUND_DEADLINE_S
        """The rider's read (`ride`): its key and deadline."""
        self.rides = 0
        """Reads of the peers' figures answered in a lookup's round trip (`ride`)."""
        self.published = 0
        """Placements published as they were made (`wake`)."""
        self._riding = False
        self._publishing = False
        self._stopped = False
        self._sums = PeerSums()
        """The peers' sums as the reads in the lookups' round trips keep them (`ride`)."""
        self.ahead = ahead
        """With peers: register each request and decide with the requests ahead placed first
        (`register`, `gateway.fleet.ahead`, `router.ahead`)."""
        self.ahead_key = AHEAD_KEY
        self.ahead_ttl_ms = AHEAD_TTL_MS
        self._ahead_sha = client.register_script(REGISTER).sha
        self._publish_sha = client.register_script(PUBLISH).sha
        self._requests = 0
        self._decided: list[str] = []
        """This gateway's registered requests decided since its last write (`PUBLISH`
        removes them from the list)."""
        self._placed: dict[str, str] = {}
        """This gateway's registered requests -> where it sent them, until published."""
        self.own: dict[str, Row] = {}
        """This gateway's figures as its last write gave them to its peers (the published
        view's own part, `published`)."""
        self.registered = 0
        self.register_failed = 0
        self.ahead_seen = 0
        """Requests ahead of this gateway's registrations, summed."""

    def due(self, states: list[ReplicaState]) -> bool:
        """Whether this round goes to Redis: while anyone's load is in the view or this
        gateway's changed since its last call, and once a heartbeat otherwise."""
        if self._busy or self.clock() - self._called_s >= HEARTBEAT_S:
            return True
        return any(s.num_inflight > 0 for s in states)

    async def tick(self) -> bool:
        """One 0.1-s round: a call when `due` and the view is not `fresh`. True when it
        called."""
        states = list(self.states())
        if not self.due(states):
            return False
        if self.fresh(states):
            self.skipped += 1
            return False
        await self.round(states)
        return True

    def fresh(self, states: list[ReplicaState]) -> bool:
        """Whether a round would only repeat what this gateway already did: its figures are
        those its last write gave (`publish` writes each change at the end of its loop turn),
        the heartbeat is not due, and the peers' figures were read less than a round ago (in
        a lookup's round trip: `ride`). The view is then as fresh as the round would make it,
        and the peers see the same figures."""
        now_s = self.clock()
        return (
            now_s - self._read_s < self.round_s
            and now_s - self._written_s < HEARTBEAT_S
            and self._written is not None
            and encode(states) == self._written
        )

    async def round(self, states: list[ReplicaState] | None = None) -> None:
        """Publish, read, apply: one call. The script when this gateway's figures changed
        since its last write (or that write is a heartbeat old); else only a read of the
        hash (`_read`): the peers see the same figures either way, at a fraction of Redis's
        time (the script's Lua, its clock, its write and expiry were ~95% of a round's)."""
        states = list(self.states()) if states is None else states
        now_s = self._called_s = self.clock()
        figures = encode(states)
        write = figures != self._written or now_s - self._written_s >= HEARTBEAT_S
        try:
            if write:
                redis_ms, blobs = await self._call(figures, ROUND_DEADLINE_S)
            else:
                blobs = await self._read(now_s)
        except Exception as exc:  # Redis away or slow: the last answer stands until stale
            self.failed += 1
            log.debug("shared load round failed: %r", exc)
            if self.clock() - self._answered_s > self.stale_s:
                self._apply(states, {})
                self.num_peers = 0
            return
        if write:
            self._written, self._written_s = figures, now_s
            self._own(figures)
            self._offset_ms = int(redis_ms) - now_s * 1000
        self._answered_s = self.clock()
        self.rounds += 1
        self.writes += write
        peers, malformed = decode(blobs)
        self.malformed += malformed
        self.num_peers = len(blobs)
        if not self.num_peers:
            self.rank = 0
        self._apply(states, peers)
        self._busy = figures != EMPTY or any(s.peer is not None for s in states)

    async def _read(self, now_s: float) -> list[bytes]:
        """The peers' figures as the script would return them, from one HGETALL (`_others`).
        Removing stale entries is left to the next write."""
        await self._slot_map()
        reply = await self._lane.command(LOAD_KEY, ("HGETALL", LOAD_KEY), "", ROUND_DEADLINE_S)
        return [figures for _, figures in self._others(reply, now_s)]

    def _others(self, reply: Any, now_s: float) -> list[tuple[bytes, bytes]]:
        """An HGETALL of the hash without the entries past the stale bound by Redis's clock
        (estimated from this gateway's last write: off by at most that call's round trip,
        against a bound of seconds) and without this gateway's own, as (name, figures). An own
        entry Redis no longer holds (it lost its data) is written again at the next round."""
        pairs = (
            reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
        )
        redis_ms = now_s * 1000 + self._offset_ms
        own = self.gateway_id.encode()
        out = []
        held = False
        for name, value in pairs:
            stamp, bar, figures = value.partition(b"|")
            if name == own:
                held = True
                continue
            if not bar or not stamp.isdigit():
                continue
            if redis_ms - int(stamp) <= self._stale_ms:
                out.append((name, figures))
        if not held:
            self._written = None
        self.rank = sum(1 for name, _ in out if name < own)
        return out

    def herd(self) -> tuple[int, int]:
        """This gateway's live peers and its place among them (`RouteRequest.peers`,
        `peer_rank`): (0, 0) alone, or with `spread_herd` off, when routing is as before."""
        if not self.spread_herd or not self.num_peers:
            return 0, 0
        return self.num_peers, min(self.rank, self.num_peers)

    def ride(self) -> tuple[tuple[Any, ...], Callable[[asyncio.Future[Any]], None]] | None:
        """The peers' figures read with the next batch of lookups (`cachemap.redis.lookups.
        Rider`): one read in flight at a time, none before the first round or after `stop`,
        and none while the last answer showed no peer (a lone gateway reads nothing more; a
        peer that joins is seen at the next round)."""
        if self._riding or self._stopped or self._written_s == -math.inf or not self.num_peers:
            return None
        self._riding = True
        return ("HGETALL", LOAD_KEY), self._ridden

    async def pace(self) -> None:
        """This gateway's turn to decide (`pace_s`, the `herd_pace_ms` setting): with peers,
        no sooner than `pace_s` after its last decision, and then on a read of the peers'
        figures taken after the wait. A burst's requests decided back to back see none of the
        peers' placements of the same instant; spaced by the time those take to reach Redis,
        each sees the ones before it, as one gateway's burst does (`kvgate sim --pace`,
        docs/design/directory.md, "The herd"). Turns are taken in call order; a decision
        with no other in the last `pace_s` waits for nothing and reads nothing more (its
        lookup's own read is fresh). A read that fails leaves the view as it was."""
        if self.pace_s <= 0 or not self.num_peers or self._stopped:
            return
        now_s = self.clock()
        turn = max(now_s, self._next_decision_s)
        self._next_decision_s = turn + self.pace_s
        if turn <= now_s:
            return
        await asyncio.sleep(turn - now_s)
        self.paced += 1
        try:
            await self._slot_map()
            reply = await self._lane.command(LOAD_KEY, ("HGETALL", LOAD_KEY), "", ROUND_DEADLINE_S)
        except Exception as exc:  # Redis away or slow: the round handles it
            log.debug("shared load read before a paced decision failed: %r", exc)
            return
        self._fold(reply)

    def _ridden(self, future: asyncio.Future[Any]) -> None:
        """The read's answer applied, before the lookups behind it resume (their callers'
        wake-ups are scheduled after this callback). A failure changes nothing: the round
        handles Redis being away."""
        self._riding = False
        if future.cancelled() or future.exception() is not None:
            return
        if self._fold(future.result()):
            self.rides += 1

    def _fold(self, reply: Any) -> bool:
        """An HGETALL of the hash applied to the view (False: not a hash's reply, skipped)."""
        now_s = self.clock()
        try:
            entries = dict(self._others(reply, now_s))
        except (AttributeError, TypeError, ValueError):  # not a hash's reply: skipped
            self.malformed += 1
            return False
        self.malformed += self._sums.fold(entries)
        self.num_peers = len(entries)
        self._answered_s = self._read_s = now_s
        self._apply(list(self.states()), self._sums.view())
        return True

    async def _call(self, figures: bytes | str, deadline_s: float) -> Any:
        """The script down the rounds' lane: this gateway's figures ("" withdraws them)."""
        await self._slot_map()
        command = ("EVALSHA", self._sha, 1, LOAD_KEY, self.gateway_id, figures, self._stale_ms)
        return await self._lane.command(LOAD_KEY, command, SHARE, deadline_s)

    async def _slot_map(self) -> None:
        """A cluster's slot map, read once (the lane routes by it)."""
        if isinstance(self.client, RedisCluster):
            await self.client.initialize()

    @staticmethod
    def _apply(states: list[ReplicaState], peers: dict[str, PeerLoad]) -> None:
        """The peers' sums onto the replicas. Where a peer's prefill or requests left a
        replica, room may have come: flow control's wake-up runs (`FleetLoad.on_freed`), as
        for a lease of this gateway's own, so a request waiting here for that replica goes at
        once, not at its queue's next tick."""
        freed = False
        for state in states:
            old, new = state.peer, peers.get(state.url)
            if old is not None and (
                new is None
                or new.prefill_tokens < old.prefill_tokens
                or new.num_inflight < old.num_inflight
            ):
                freed = True
            state.peer = new
        hook = states[0].fleet.on_freed if freed else None
        if hook is not None:
            hook()

    def wake(self) -> None:
        """A lease started: an idle loop's next round comes at its place (`_idle`), and this
        gateway's figures are published at the end of this loop turn (`publish`)."""
        if self._waker is not None:
            _resolve(self._waker)
        self.changed()

    def changed(self) -> None:
        """This gateway's figures changed (a lease started, its prefill ended, it was
        released): they are published at the end of this loop turn (`publish`: one write
        for the turn's changes), so a peer's next read counts a release as it counts a
        placement, not after this gateway's next round."""
        if not self._publishing and not self._stopped:
            self._publishing = True
            asyncio.get_running_loop().call_soon(self._publish_soon)

    def _publish_soon(self) -> None:
        self._publishing = False
        self.publish()

    def publish(self) -> asyncio.Future[Any] | None:
        """This gateway's figures to its entry, one HSET down the rounds' lane (the placements
        of one loop turn in one write): stamped with Redis's clock as the last script call
        read it, so the peers' stale bound reads it as the script's own. Not before the first
        round (no clock read yet), nor when the figures are the last written. The script's
        heartbeat still runs (it drops stale entries and renews the hash's expiry). Returns
        the write's answer (None: nothing written)."""
        if self._stopped or self._written_s == -math.inf:
            return None
        figures = encode(self.states())
        if figures == self._written and not self._decided:
            return None
        stamp = int(self.clock() * 1000 + self._offset_ms)
        value = b"%d|%s" % (stamp, figures)
        decided, self._decided = self._decided, []
        if decided:  # the figures and the requests they place leave the list in one call
            order, entries, _ = ahead_keys(self.ahead_key)
            command: tuple[Any, ...] = (
                "EVALSHA",
                self._publish_sha,
                3,
                LOAD_KEY,
                order,
                entries,
                self.gateway_id,
                value,
                *decided,
            )
            future = self._lane.command(LOAD_KEY, command, PUBLISH, ROUND_DEADLINE_S)
        else:
            command = ("HSET", LOAD_KEY, self.gateway_id, value)
            future = self._lane.command(LOAD_KEY, command, "", ROUND_DEADLINE_S)
        self._written = figures
        self._own(figures)
        future.add_done_callback(lambda done: self._published(done, decided))
        return future

    def _published(self, future: asyncio.Future[Any], decided: list[str]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.failed += 1
            self._written = None  # the next round writes them
            self._decided.extend(decided)  # and the next publish removes them
            return
        self.published += 1
        for rid in decided:
            self._placed.pop(rid, None)

    def _own(self, figures: bytes) -> None:
        rows = parse(figures)
        self.own = {row[0]: row for row in rows or ()}

    # -- the requests looked up ahead (`gateway.fleet.ahead`) --------------------------------
    async def register(
        self, route: RouteRequest, deadline_s: float = ROUND_DEADLINE_S
    ) -> tuple[str, bool, list[Ahead]] | None:
        """Register `route` (as this gateway decides it, the herd rule's peers and rank in
        it) and read the published load with it: this request's id and the requests ahead, in
        Redis's order, each as its gateway decided it and this gateway's own where it sent
        them, and whether any was (the request is then decided with ties by id). None when
        off, alone, before the first round, or when Redis did not answer
        (decide as before) within `deadline_s` (Redis's time: the request path's, the caller
        gives its lookup's); the caller reports the id's decision (`decided`) either way."""
        if not self.ahead or not self.num_peers or self._stopped or self._written_s == -math.inf:
            return None
        self._requests += 1
        rid = f"{self.gateway_id}#{self._requests}"
        order, entries, counter = ahead_keys(self.ahead_key)
        command = (
            "EVALSHA",
            self._ahead_sha,
            4,
            LOAD_KEY,
            order,
            entries,
            counter,
            self.gateway_id,
            rid,
            encode_route(route),
            self.ahead_ttl_ms,
        )
        try:
            await self._slot_map()
            reply = await self._lane.command(LOAD_KEY, command, REGISTER, deadline_s)
            flat, load = reply[2], reply[3]
            listed, malformed = parse_entries(list(flat))
        except Exception as exc:  # it may be registered: the next publish removes it
            self.register_failed += 1
            self._decided.append(rid)
            log.debug("registering a request ahead failed: %r", exc)
            return None
        self.registered += 1
        self.malformed += malformed
        self._fold(load)
        ahead = [
            Ahead(
                ties_by_id(item.req) if item.had else item.req,
                self._placed.get(item.id) if item.gateway == self.gateway_id else None,
            )
            for item in listed
        ]
        self.ahead_seen += len(ahead)
        return rid, bool(int(reply[1])), ahead

    def decided(self, rid: str, replica: str | None) -> None:
        """The registered request `rid` was placed on `replica` (None: nowhere): its entry
        leaves the list with this gateway's next write of its figures (at the end of this loop
        turn)."""
        self._decided.append(rid)
        if replica is not None:
            self._placed[rid] = replica
        if not self._publishing and not self._stopped:
            self._publishing = True
            asyncio.get_running_loop().call_soon(self._publish_soon)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.round_s
        while True:
            await asyncio.sleep(delay)
            delay = self.round_s
            self.ticks += 1
            if not await self.tick() and not self._busy:
                delay = await self._idle(loop)

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> float:
        """Nothing was due: rather than waking every round to find nothing due again (40 times
        a second at the bench's round: half an idle gateway's CPU), sleep until the round at
        which the heartbeat falls due, or until a lease starts (`wake`). Returns the delay to
        the next round, on the rounds' grid from this one: the rounds run where the plain loop's
        would have, and the peers see the same figures at the same rounds."""
        start = loop.time()
        left_s = self._called_s + HEARTBEAT_S - self.clock()
        heartbeat = start + max(math.ceil(left_s / self.round_s), 1) * self.round_s
        waker = self._waker = loop.create_future()
        timer = loop.call_at(heartbeat, _resolve, waker)
        try:
            await waker
        finally:
            timer.cancel()
            self._waker = None
        now = loop.time()
        if now >= heartbeat:
            return 0.0
        return start + max(math.ceil((now - start) / self.round_s), 1) * self.round_s - now

    async def start(self) -> None:
        await self.round()
        self._tasks.spawn(self._loop(), name="shared load")

    async def stop(self) -> None:
        """Stop the rounds; the peers stop counting this gateway at once (not after the bound)."""
        self._stopped = True
        await self._tasks.close()
        try:  # bounded: a Redis gone at shutdown must not hold the stop (the entry goes stale)
            await self._call("", WITHDRAW_DEADLINE_S)
        except Exception as exc:
            log.debug("shared load not withdrawn: %r", exc)
        await self._lane.close()


def _resolve(waker: asyncio.Future[None]) -> None:
    if not waker.done():
        waker.set_result(None)
