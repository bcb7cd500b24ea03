"""Event intake: one ZMQ SUB per engine cache domain, its batches applied to the event index.

    engine rank r ──PUB (topic, seq, payload)──▶ Feed ──decode──▶ EventIndex.apply(domain, ...)
                  ◀──DEALER replay(start seq)──┘ (on a gap)

Per feed, the seq decides (`Feed.accept`):
- the next one expected: applied;
- a gap (seq ahead): the missed batches are replayed over the engine's replay socket first
  (bounded: at most `max_replay_batches`, each answer frame within `replay_timeout_s`; a
  replay cut short leaves the feed at the last batch it applied, so the next one resumes from
  there); without a replay endpoint the gap is counted as unrepaired;
- behind (0, or anything lower, after a higher seq): the engine restarted (vLLM counts from 0
  per process, and a PUB never resends, so a seq going back is a new publisher whose first
  batches may have gone while the SUB reconnected): the domain's entries are dropped before the
  batch is applied, as an `AllBlocksCleared` does (replayed batches already applied are the
  only duplicates, skipped inside the replay);
- a restart whose seq comes back *higher* than expected looks like a gap: the replica set's
  restart detection (`on_restart`: start time, counters going back) drops the domain then;
- the first batch a feed sees with seq > 0: what the engine still buffers is replayed from 0
  (a gateway that restarts recovers the blocks announced while it was away).

Limits (issue 45, item 8: a broken or hostile engine cannot stall or bloat the gateway,
`FeedLimits`): a message over `max_message_bytes` is refused by ZMQ itself (the SUB drops that
connection: libzmq treats it as a protocol error and does not reconnect, so the feed watches
its socket's disconnections and connects again once its queue is read; the batch is a gap),
one callback of a feed's reader applies batches
for at most `drain_budget_s` (at least one; the rest on the next loop turn), a replay reads at
most its span plus `REPLAY_SLACK` frames within `REPLAY_DEADLINE_FACTOR` answer timeouts, and a
domain whose blocks pass the engine's KV capacity (`capacity`, its `num_gpu_blocks`, on the GPU)
or `max_blocks` (all tiers) is wiped: an honest engine never holds more, so its index is wrong
(removals missed) or the engine lies, and starting over is what both need.

Both replay answer layouts are read: (topic, seq, payload), current vLLM, and (seq, payload),
older vLLM and SGLang, each after the DEALER's empty delimiter; seq -1 ends the answer.

Every batch is applied synchronously on the event loop between two awaits (a reader on the
socket's FD, `Feed.run`), and a lookup first drains the sockets (`EventIntake.drain`), so a
wipe is in the index before the next routing decision that runs after its message reached the
gateway's socket, whether or not the loop has run the feed since — unless more than a read's
time budget of batches is queued before it (a flood: `FeedLimits.drain_budget_s`), when it is
applied on a later loop turn.

Shared (`kv_events_shared`, `share`): the index is in Redis (`cachemap.redis.events`) and a
gateway runs the feeds only of the domains whose lease it holds (`Leases`: set if absent,
renewed `RENEWALS_PER_LEASE` times per lease). A feed applies its batches to the
`EventWriter` and commits after each read of its socket (a wipe waits until its new epoch is
written); a lookup does not drain a shared feed (the other gateways read Redis, not its
socket). A new owner starts from the seq its predecessor wrote, so what it missed is replayed
like a gap. An owner that cannot renew within `FENCE_SHARE` of its lease stops writing before
the lease can pass to another gateway. Owners balance (`EventIntake._balance`): each round a
gateway marks itself live with the number of domains it owns; one owning more than
ceil(domains / live gateways), or 2 more than the least loaded, releases the surplus, and one
below the fair share takes free domains up to it — so the first gateway to start does not keep
every engine, and a dead gateway's domains spread over the others once its leases run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from cachemap.events import (
    CPU,
    GPU,
    STORAGE,
    AllBlocksCleared,
    BlockStored,
    CacheEvent,
    domain_of,
    rank_endpoint,
)
from cachemap.redis.events import EventWriter, Leases
from cachemap.redis.frontiers import SharedFrontiers
from gateway.events.decode import MalformedBatch, decode_batch
from gateway.settings import (
    DEFAULT_KV_EVENTS_DRAIN_BUDGET_S,
    DEFAULT_KV_EVENTS_MAX_BLOCKS,
    DEFAULT_KV_EVENTS_MAX_MESSAGE_BYTES,
)
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

END_SEQ = -1
DEFAULT_REPLAY_TIMEOUT_S = 1.0
"""How long a replay waits for each answer frame: a publisher thread answers in microseconds
unless the engine is gone."""
DEFAULT_MAX_REPLAY_BATCHES = 10_000
"""vLLM's default `buffer_steps`: an engine never keeps more to replay."""
RECEIVE_HWM = 100_000
"""Batches a SUB socket queues while the event loop is busy: vLLM's PUB `hwm` default, so a
burst the engine could send is held rather than dropped (a drop is a gap)."""
REFRESH_INTERVAL_S = 1.0
"""How often the intake matches its feeds to the replica set (discovery adds and removes)."""
REPLAY_SLACK = 64
"""Frames a replay reads past its span (an answer's duplicates and its end): more is an engine
that answers forever (it looped on duplicate or malformed frames before)."""
REPLAY_DEADLINE_FACTOR = 10
"""A whole replay ends this many answer timeouts after it started (10 s by default; 10,000
batches replay in well under that), however steadily the engine drips frames."""
_LAGS_KEPT = 4096
RENEWALS_PER_LEASE = 3
"""A lease is renewed three times per lease period: two renewals may fail (a Redis failover,
a busy loop) before the lease runs out."""
FENCE_SHARE = 0.8
"""An owner whose last renewal was sent this share of a lease ago stops writing: its lease may
be gone by the time it would write, and another gateway may own the domain."""


class EventSink(Protocol):
    """Where a feed applies its batches: the in-process `EventIndex` or the `EventWriter`."""

    def apply(self, domain: str, event: CacheEvent) -> None: ...

    def clear(self, domain: str) -> None: ...

    def num_blocks(self, domain: str, tier: int = GPU) -> int: ...


@dataclass(frozen=True)
class FeedLimits:
    """What one engine's feed may cost the gateway (module docstring, "Limits")."""

    max_message_bytes: int = DEFAULT_KV_EVENTS_MAX_MESSAGE_BYTES
    drain_budget_s: float = DEFAULT_KV_EVENTS_DRAIN_BUDGET_S
    max_blocks: int = DEFAULT_KV_EVENTS_MAX_BLOCKS
    capacity: Callable[[str], int | None] = lambda replica: None
    """replica -> its KV capacity in GPU blocks, from its metrics (None: unknown)."""


Commit = Callable[[str, int | None, bool], Awaitable[None]]
"""After each batch: (domain, next seq, whether it wiped the domain)."""


@dataclass(frozen=True)
class EventsConfig:
    """Where each engine publishes (docs/precise.md): a per-replica endpoint, or the replica's
    host with `port` (rank r on port + r, as vLLM offsets them)."""

    port: int | None = None
    replay_port: int | None = None
    endpoints: dict[str, str] = field(default_factory=dict)
    """replica URL -> its PUB endpoint (rank 0), e.g. tcp://10.0.0.7:5557"""
    replay_endpoints: dict[str, str] = field(default_factory=dict)
    topic: str = ""
    dp_size: int = 1

    def feeds(self, replica: str) -> list[FeedConfig]:
        """The feeds of one replica (one per DP rank); none when it publishes nowhere known."""
        host = urlsplit(replica).hostname or "127.0.0.1"
        endpoint = self.endpoints.get(replica)
        if endpoint is None and self.port is not None:
            endpoint = f"tcp://{host}:{self.port}"
        if endpoint is None:
            return []
        replay = self.replay_endpoints.get(replica)
        if replay is None and self.replay_port is not None:
            replay = f"tcp://{host}:{self.replay_port}"
        return [
            FeedConfig(
                replica,
                rank,
                domain_of(replica, rank, self.dp_size),
                rank_endpoint(endpoint, rank),
                rank_endpoint(replay, rank) if replay is not None else None,
                self.topic,
            )
            for rank in range(self.dp_size)
        ]


@dataclass(frozen=True)
class FeedConfig:
    replica: str
    rank: int
    domain: str
    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass
class FeedStats:
    batches: int = 0
    malformed: int = 0
    unknown_events: int = 0
    duplicates: int = 0
    gaps: int = 0
    unrepaired_gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    restarts: int = 0
    wipes: int = 0
    over_capacity: int = 0
    """Wipes because the domain's blocks passed the engine's capacity (`FeedLimits`)."""
    disconnects: int = 0
    """The SUB's connection lost (an engine restart, a message over the size limit)."""
    cut_replays: int = 0
    """Replays ended by their frame or time bound."""
    last_batch_s: float | None = None
    last_wipe_s: float | None = None
    lags_s: deque[float] = field(default_factory=lambda: deque(maxlen=_LAGS_KEPT))
    """Publish (the batch's ts) to indexed, per batch: the event lag."""


class Feed:
    """One domain's SUB socket (and replay DEALER) and its seq tracking (module docstring)."""

    def __init__(
        self,
        config: FeedConfig,
        index: EventSink,
        ctx: zmq.asyncio.Context,
        *,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        max_replay_batches: int = DEFAULT_MAX_REPLAY_BATCHES,
        clock: Callable[[], float] = time.time,
        next_seq: int | None = None,
        commit: Commit | None = None,
        limits: FeedLimits | None = None,
    ) -> None:
        self.config = config
        self.limits = limits if limits is not None else FeedLimits()
        self.index = index
        self.stats = FeedStats()
        self.next_seq: int | None = next_seq
        """The seq expected next (None: none seen; a new owner starts from its predecessor's)."""
        self.commit = commit
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_batches = max_replay_batches
        self.clock = clock
        self._ctx = ctx
        self.socket: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.SUB)
        """A plain socket of the feed's context, read without awaiting (`drain`), from a
        reader on its FD (`run`) and from `EventIntake.drain`'s poll."""
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.set_hwm(RECEIVE_HWM)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        self.socket.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
        self.socket.connect(config.endpoint)
        monitor = f"inproc://kv-events-monitor-{id(self)}"
        self.socket.monitor(monitor, zmq.EVENT_DISCONNECTED)
        self._monitor: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
        """The SUB's disconnections (`_disconnected`)."""
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(monitor)
        self._reconnect = False
        """A disconnection was seen: connect again once the queue is read (`drain`)."""
        self._held: tuple[int, bytes] | None = None
        self._busy = False
        """`run`'s task awaits a replay or a commit: the socket waits (batches stay in order)."""
        self._closed = False
        self._work = asyncio.Event()
        """Set by the reader when `run`'s task has something to await: a held batch's replay,
        or (shared) a commit."""
        self._reading: asyncio.AbstractEventLoop | None = None
        """The loop the reader is on (None: not reading)."""
        self._committed_wipes = 0
        self._dealer: zmq.asyncio.Socket | None = None
        self._resume: asyncio.Handle | None = None
        """The reader's next turn, when a drain stopped at its budget with batches left."""

    @property
    def live(self) -> bool:
        """The engine publishes: this feed has applied a batch."""
        return self.stats.last_batch_s is not None

    async def run(self) -> None:
        """Apply batches as they reach the socket: a reader on its FD drains it from a loop
        callback (`_readable`), so a batch costs no task step nor poll future (zmq.asyncio's
        poll per batch was ~50 us of the loop's CPU a batch, ~45% of a live feed's). This task
        awaits only what must be awaited: the replay a held batch asks for, and, shared, the
        commit of what was applied."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.socket.FD, self._readable)
        loop.add_reader(self._monitor.FD, self._disconnected)
        self._reading = loop
        try:
            self._disconnected()  # (a read to empty arms its FD: ZMQ's signal is an edge)
            self._readable()  # what reached the socket before the reader
            while True:
                await self._work.wait()
                self._work.clear()
                held, self._held = self._held, None
                self._busy = True  # the socket is not read while this task awaits
                try:
                    if held is not None:
                        await self.receive(*held)  # its replay, the batch, the commit
                    else:
                        await self._commit()
                finally:
                    self._busy = False
                self._readable()  # the batches that queued meanwhile
        finally:
            self._stop_reading()

    def _readable(self) -> None:
        """The socket's FD signalled: apply what it holds (`drain`), and hand the task what
        must be awaited. While the task awaits a replay or a commit (or is about to), the
        signal is only cleared: the socket is read again when that ends (a shared feed's
        batches are applied between its commits, as before)."""
        if self._closed:
            return
        if self._busy or self._held is not None:
            self.socket.get(zmq.EVENTS)  # clears the FD's signal
            return
        applied = self.next_seq
        self.drain()
        if self.commit is not None and self.next_seq != applied:
            self._work.set()

    def _disconnected(self) -> None:
        """The SUB lost its connection: an engine that restarted, or one that sent a message
        over `max_message_bytes` (a protocol error, after which libzmq never reconnects). Either
        way the feed connects again, after reading what the socket queued (a `disconnect`
        drops it): a new connection of a restarted engine replaces libzmq's own retry."""
        while not self._closed:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._reconnect = True
            self.stats.disconnects += 1
        if self._reconnect:
            self._readable()

    def _maybe_reconnect(self) -> None:
        self._reconnect = False
        with contextlib.suppress(zmq.ZMQError):  # (already gone)
            self.socket.disconnect(self.config.endpoint)
        self.socket.connect(self.config.endpoint)

    def _resume_later(self) -> None:
        """A drain stopped at its budget: the FD signals only new batches, so the reader runs
        again on the loop's next turn (once, however many drains stop meanwhile)."""
        if self._reading is not None and self._resume is None:
            self._resume = self._reading.call_soon(self._resumed)

    def _resumed(self) -> None:
        self._resume = None
        self._readable()

    def _stop_reading(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._reading is not None:
            self._reading.remove_reader(self.socket.FD)
            self._reading.remove_reader(self._monitor.FD)
            self._reading = None

    def drain(self) -> None:
        """Apply, in order and without awaiting, every batch the socket has already received:
        called before a lookup too (`EventIntake.drain`), so a wipe that reached this gateway
        is in the index before the routing decision even when the loop has not yet run this
        feed's reader. A batch whose seq calls for a replay is held for `run`; nothing is taken
        while its task awaits a replay or a commit (batches stay in order). Ends on a read that
        finds nothing (zmq.Again), which also clears the FD's signal (checking the EVENTS flag
        before each read instead costs ~2 us more a batch in bursts, and no less paced), or
        once `drain_budget_s` is spent (at least one frame read; the reader runs again on the
        loop's next turn): a flood waits for requests, not requests for the flood."""
        if self._busy or self._closed:
            return
        socket = self.socket
        deadline = time.perf_counter() + self.limits.drain_budget_s
        read = False
        while self._held is None:
            if read and time.perf_counter() > deadline:  # the rest on the loop's next turn
                self._resume_later()
                return
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if self._reconnect:  # the queue is read: nothing of it is lost
                    self._maybe_reconnect()
                return
            read = True
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats.malformed += 1
                continue
            seq, payload = int.from_bytes(frames[1], "big"), frames[2]
            if self._replay_span(seq) is not None:
                self._held = (seq, payload)
                self._work.set()  # the task replays (held by a lookup's drain too)
                return
            self._accept(seq, payload)

    async def receive(self, seq: int, payload: bytes) -> None:
        """One published batch, after whatever replay its seq calls for."""
        await self._receive(seq, payload)
        await self._commit()

    def _wipes(self) -> int:
        return self.stats.wipes + self.stats.restarts

    async def _commit(self) -> None:
        """Shared: write what was applied since the last commit (`EventWriter.commit`),
        waiting for a new epoch if a wipe came since."""
        if self.commit is not None:
            wipes = self._wipes()
            wiped, self._committed_wipes = wipes != self._committed_wipes, wipes
            await self.commit(self.config.domain, self.next_seq, wiped)

    async def _receive(self, seq: int, payload: bytes) -> None:
        span = self._replay_span(seq)
        if span is None:
            self._accept(seq, payload)
            return
        gap = self.next_seq is not None  # else a late joiner reading the engine's buffer
        self.stats.gaps += gap
        await self._replay(*span)
        if gap and self.next_seq != seq:
            self.stats.unrepaired_gaps += 1
        self._apply(seq, payload)

    def _replay_span(self, seq: int) -> tuple[int, int] | None:
        """The batches to replay before `seq`: a gap, or a late joiner's first batch."""
        if self.config.replay_endpoint is None:
            return None
        expected = self.next_seq
        if expected is None:
            return (0, seq) if seq > 0 else None
        return (expected, seq) if seq > expected else None

    def _accept(self, seq: int, payload: bytes) -> None:
        """A batch that needs no replay (the next seq, a restart, or a gap with nothing to
        replay it from)."""
        expected = self.next_seq
        if expected is not None and seq < expected:
            # a PUB socket never resends: a seq going back is a new publisher (its seq 0 may
            # have been sent while the SUB was reconnecting)
            self.stats.restarts += 1
            self.wipe()
        elif expected is not None and seq > expected:
            self.stats.gaps += 1
            self.stats.unrepaired_gaps += 1
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            self.stats.malformed += 1
            log.warning("KV events from %s: batch %d skipped: %s", self.config.domain, seq, exc)
            return
        domain = self.config.domain
        index = self.index
        gpu_capacity = self.limits.capacity(self.config.replica)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.stats.wipes += 1
                self.wipe()
                continue
            index.apply(domain, event)
            if isinstance(event, BlockStored) and self._over_capacity(gpu_capacity):
                break
        now = self.clock()
        self.stats.batches += 1
        self.stats.unknown_events += batch.num_unknown
        self.stats.last_batch_s = now
        self.stats.lags_s.append(max(now - batch.ts, 0.0))

    def _over_capacity(self, gpu_capacity: int | None) -> bool:
        """Wipe the domain when it holds more than the engine can (`FeedLimits`): the rest of
        the batch is not applied (its blocks would chain to wiped ones)."""
        domain, index = self.config.domain, self.index
        gpu = index.num_blocks(domain, GPU)
        if gpu_capacity is None or gpu <= gpu_capacity:
            total = gpu + index.num_blocks(domain, CPU) + index.num_blocks(domain, STORAGE)
            if total <= self.limits.max_blocks:
                return False
        self.stats.over_capacity += 1
        log.warning(
            "KV events of %s: more blocks than the engine holds (capacity %s GPU, %d in all); "
            "the domain is wiped",
            domain,
            gpu_capacity,
            self.limits.max_blocks,
        )
        self.wipe()
        return True

    def wipe(self) -> None:
        self.index.clear(self.config.domain)
        self.stats.last_wipe_s = self.clock()

    async def _replay(self, start: int, until: int) -> None:
        """Apply the engine's buffered batches [start, until) (bounded; see the docstring)."""
        assert self.config.replay_endpoint is not None
        start = max(start, until - self.max_replay_batches)
        self.stats.replays += 1
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
            self._dealer.connect(self.config.replay_endpoint)
        dealer = self._dealer
        await dealer.send_multipart((b"", start.to_bytes(8, "big")))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_DEADLINE_FACTOR * self.replay_timeout_s
        for _ in range(until - start + REPLAY_SLACK):
            wait_s = min(self.replay_timeout_s, deadline - loop.time())
            if wait_s <= 0 or not await dealer.poll(wait_s * 1000):
                log.warning("KV events replay from %s timed out", self.config.replay_endpoint)
                self._drop_dealer()
                return
            frames = await dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                self.stats.malformed += 1
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == END_SEQ:
                return
            if seq < (self.next_seq or 0) or not start <= seq < until:
                self.stats.duplicates += 1
                continue
            self.stats.replayed_batches += 1
            self._apply(seq, frames[1])
        self.stats.cut_replays += 1
        log.warning(
            "KV events replay from %s: more frames than %d batches; cut",
            self.config.replay_endpoint,
            until - start,
        )
        self._drop_dealer()

    def _drop_dealer(self) -> None:
        """An answer's rest must not be read as the next one's."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def close(self) -> None:
        self._closed = True
        self._stop_reading()  # before the socket (and its FD) goes
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)


class EventIntake:
    """The feeds of every replica the set knows, kept in step with it (discovery); shared, only
    of the domains this gateway owns (module docstring)."""

    def __init__(
        self,
        config: EventsConfig,
        index: EventSink,
        replicas: Callable[[], Iterable[str]],
        *,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        limits: FeedLimits | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self._replicas = replicas
        self._replay_timeout_s = replay_timeout_s
        self.limits = limits if limits is not None else FeedLimits()
        self._ctx = zmq.asyncio.Context()
        self._feeds: dict[str, Feed] = {}
        """domain -> its feed"""
        self._by_replica: dict[str, list[Feed]] = {}
        """replica -> its feeds, by rank: a request's candidates are looked up, not searched
        for among every feed (a scan per candidate was 8 ms a request at 256 replicas)"""
        self._poller = zmq.Poller()
        """Every feed's socket: `drain` asks which hold batches in one call"""
        self._polled: dict[zmq.Socket[bytes], Feed] = {}
        self._live: set[str] = set()
        """Replicas found live (a feed that applied a batch stays live while it is open)"""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background = BackgroundTasks("events")
        self.writer: EventWriter | None = None
        self.leases: Leases | None = None
        self.lease_s = 0.0
        self.gateways = 0
        """Live gateways of the shared index at the last ownership round (0: not counted)."""
        self.handed_over = 0
        """Domains this gateway released for balance."""
        self.frontiers: SharedFrontiers | None = None
        """Shared mode with a policy that reads frontiers: their rounds run with the intake."""
        self._renewed: dict[str, float] = {}

    def share(self, writer: EventWriter, leases: Leases, lease_s: float) -> None:
        """Index into Redis (before `start`): own domains by lease, write what they say."""
        self.writer, self.leases, self.lease_s = writer, leases, lease_s

    def feeds(self, replica: str | None = None) -> list[Feed]:
        if replica is None:
            return list(self._feeds.values())
        return list(self._by_replica.get(replica, ()))

    def restarted(self, replica: str) -> None:
        """The replica set saw the engine restart: whatever its seq says, its blocks are gone."""
        for feed in self.feeds(replica):
            feed.stats.restarts += 1
            feed.wipe()

    def drain(self) -> None:
        """Apply what the feeds' sockets already hold (`Feed.drain`): called right before a
        lookup. One poll of every socket (a C loop) finds the feeds with batches waiting, and
        each of those is read until its socket is empty, candidate of this request or not: a
        poll clears the FD signal its feed's reader waits for, so no polled socket is left
        holding a batch (a batch held for a replay wakes its feed's task). Shared: nothing (a
        shared feed commits from its own task)."""
        if self.writer is not None:
            return
        for socket, _ in self._poller.poll(0):
            self._polled[socket].drain()

    def live(self, replica: str) -> bool:
        """The replica's events are flowing: route on the index, not on the prediction."""
        if replica in self._live:
            return True
        if any(f.live for f in self._by_replica.get(replica, ())):
            self._live.add(replica)
            return True
        return False

    def live_among(self, replicas: Collection[str]) -> set[str]:
        """The replicas among these whose events flow (`live`): a set intersection once
        every one is known live."""
        found = self._live.intersection(replicas)
        if len(found) < len(replicas):
            found.update(r for r in replicas if r not in found and self.live(r))
        return found

    def _wanted(self) -> dict[str, FeedConfig]:
        return {c.domain: c for r in self._replicas() for c in self.config.feeds(r)}

    def _open(self, config: FeedConfig, next_seq: int | None = None) -> None:
        writer = self.writer
        feed = Feed(
            config,
            writer if writer is not None else self.index,
            self._ctx,
            replay_timeout_s=self._replay_timeout_s,
            next_seq=next_seq,
            commit=writer.commit if writer is not None else None,
            limits=self.limits,
        )
        self._feeds[config.domain] = feed
        self._by_replica.setdefault(config.replica, []).append(feed)
        self._poller.register(feed.socket, zmq.POLLIN)
        self._polled[feed.socket] = feed
        self._tasks[config.domain] = asyncio.get_running_loop().create_task(
            self._run(feed), name=f"events {config.domain}"
        )

    def _close(self, domain: str) -> None:
        self._tasks.pop(domain).cancel()
        feed = self._feeds.pop(domain)
        self._forget(feed)
        feed.close()

    def _forget(self, feed: Feed) -> None:
        feeds = self._by_replica[feed.config.replica]
        feeds.remove(feed)
        if not feeds:
            del self._by_replica[feed.config.replica]
            self._live.discard(feed.config.replica)
        self._poller.unregister(feed.socket)
        del self._polled[feed.socket]

    def refresh(self) -> None:
        """Open feeds for replicas that joined, close those of replicas that left (and drop
        what the index held for them). Shared: the ownership loop opens and closes them."""
        if self.writer is not None:
            return
        wanted = self._wanted()
        for domain in sorted(wanted.keys() - self._feeds.keys()):
            self._open(wanted[domain])
        for domain in sorted(self._feeds.keys() - wanted.keys()):
            self._close(domain)
            self.index.clear(domain)

    async def own(self) -> None:
        """One round of the shared mode's ownership: renew the leases held (a lost one closes
        its feed), give up domains that left, balance (`_balance`), take unowned ones up to
        the fair share (their state from Redis)."""
        wanted = self._wanted()
        await self._renew(wanted)
        room = await self._balance(len(wanted))
        if room > 0:
            await self._acquire(wanted, room)

    async def _renew(self, wanted: dict[str, FeedConfig]) -> None:
        assert self.leases is not None
        leases = self.leases
        loop = asyncio.get_running_loop()
        for domain in sorted(self._feeds):
            if domain not in wanted:
                await self._disown(domain, release=True)
                continue
            sent = loop.time()
            try:
                held: bool | None = await leases.renew(domain)
            except Exception as exc:  # Redis away: keep writing until the fence
                log.debug("KV events lease of %s not renewed: %s", domain, exc)
                held = None
            if held is False and await self._retake(domain):
                held = True
            if held:
                self._renewed[domain] = sent
            elif held is False or sent - self._renewed[domain] > FENCE_SHARE * self.lease_s:
                log.warning("KV events of %s: the lease is lost; another gateway owns them", domain)
                await self._disown(domain, release=False)

    async def _balance(self, num_domains: int) -> int:
        """Mark this gateway live with its count and even the counts out: with G live gateways
        none should own more than ceil(domains / G) (`fair`), nor 2 more than the least loaded.
        A gateway above that releases its surplus (the last of its domains in order; their
        leases are free at once) and takes nothing this round (it would take them back); one
        below `fair` that is among the least loaded may take free domains up to it. Returns
        how many it may take (Redis away: as many as are free, as without balancing)."""
        assert self.leases is not None
        mine = len(self._feeds)
        try:
            counts = await self.leases.heartbeat(mine)
        except Exception as exc:  # Redis away: no balancing this round
            log.debug("KV events: gateways not counted: %s", exc)
            return num_domains
        self.gateways = len(counts)
        fair = -(-num_domains // len(counts))
        surplus = max(mine - fair, 1 if mine >= min(counts) + 2 else 0)
        if not surplus:  # the least loaded take first (the others would take back what
            return fair - mine if mine <= min(counts) else 0  # was just released for them)
        for domain in sorted(self._feeds)[-surplus:]:
            log.info("KV events of %s: released for balance (%d gateways)", domain, len(counts))
            self.handed_over += 1
            await self._disown(domain, release=True)
        return 0

    async def _acquire(self, wanted: dict[str, FeedConfig], room: int) -> None:
        assert self.writer is not None and self.leases is not None
        writer, leases = self.writer, self.leases
        loop = asyncio.get_running_loop()
        for domain in sorted(wanted.keys() - self._feeds.keys()):
            if room <= 0:
                return
            sent = loop.time()
            try:
                if not await leases.acquire(domain):
                    continue
                next_seq = await writer.adopt(domain)
            except Exception as exc:  # Redis away: try again next round
                log.debug("KV events of %s not taken: %s", domain, exc)
                continue
            log.info("KV events of %s: owned here (from seq %s)", domain, next_seq)
            self._renewed[domain] = sent
            self._open(wanted[domain], next_seq)
            room -= 1

    async def _retake(self, domain: str) -> bool:
        """A lease found gone with nobody holding it: Redis lost its state (a restart without
        persistence) or the lease ran out unclaimed. Take it again and write the whole domain
        back from memory, so the index is whole again (an engine never re-announces what it
        still holds)."""
        assert self.writer is not None and self.leases is not None
        try:
            if await self.leases.holder(domain) is not None or not await self.leases.acquire(
                domain
            ):
                return False
        except Exception:
            return False
        try:
            blocks = await self.writer.retake(domain)
        except Exception:  # Redis away again: the next round retries
            return False
        log.warning(
            "KV events of %s: the lease was gone; retaken, %d blocks written back", domain, blocks
        )
        return True

    async def _disown(self, domain: str, *, release: bool) -> None:
        assert self.writer is not None and self.leases is not None
        self._close(domain)
        self._renewed.pop(domain, None)
        await self.writer.release(domain, flush=release)
        if release:
            with contextlib.suppress(Exception):
                await self.leases.release(domain)

    def owned(self) -> list[str]:
        return sorted(self._feeds) if self.writer is not None else []

    async def _run(self, feed: Feed) -> None:
        try:
            await feed.run()
        except zmq.ZMQError as exc:  # a closed socket at shutdown, or a bad endpoint
            log.warning("KV events feed %s stopped: %s", feed.config.domain, exc)

    async def start(self) -> None:
        if self.writer is not None:
            self._background.spawn(self._own_loop(), name="events ownership")
            if self.frontiers is not None:
                self._background.spawn(self.frontiers.run(), name="events frontiers")
            return
        self.refresh()
        self._background.spawn(self._refresh_loop(), name="events refresh")

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL_S)
            self.refresh()

    async def _own_loop(self) -> None:
        while True:
            await self.own()
            await asyncio.sleep(self.lease_s / RENEWALS_PER_LEASE)

    async def close(self) -> None:
        await self._background.close()
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for feed in self._feeds.values():
            self._forget(feed)
            feed.close()
        if self.writer is not None:  # a graceful stop hands the domains on at once
            for domain in list(self._feeds):
                await self.writer.release(domain)
                if self.leases is not None:
                    with contextlib.suppress(Exception):
                        await self.leases.release(domain)
            if self.leases is not None:
                with contextlib.suppress(Exception):
                    await self.leases.leave()
            if self.frontiers is not None:
                await self.frontiers.close()
            await self.writer.close()
        self._feeds.clear()
        self._tasks.clear()
        self._ctx.term()
