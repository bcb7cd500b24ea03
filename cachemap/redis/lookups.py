"""The lookups' own connection: pipelined, with a deadline that counts Redis's time only.

A lookup's deadline protects a request from a Redis that does not answer. Measured as wall
time around an `await` (`asyncio.wait_for`), it also counted the gateway's own event-loop lag:
the reply may be in the socket for milliseconds while other requests' CPU runs, the loop's
timers fire before it polls the socket (uvloop), and the caller resumes three or more loop
iterations after the reply arrived (the sender's task, the caller's, `wait_for`'s own). Under
load that made most lookups miss a 5 ms deadline although Redis answered in ~0.2 ms (issue 17).

Here the deadline runs from when the lookup was written to when its reply was *received*: when
the timer fires and the lookup is unanswered, it fails only if nothing is waiting on our side
of the connection — no bytes in the kernel's socket buffer, none in the stream's buffer that
the reader has not parsed yet. Bytes waiting there are replies Redis has sent (ours, or the
ones before it on this connection, in order): the loop, not Redis, is late, and a fallback
would not be faster (it needs the loop too), so the lookup waits on, re-checked every
`RECHECK_S`, for at most `LAG_GRACE_S` beyond its deadline (past that it fails as `LoopLag`:
this process's fault, which a breaker must not count against Redis). A Redis that stops
answering sends nothing: its lookups fail at the deadline (`LookupTimeout`), as before. A
lookup still waiting for the connection to open is Redis's time too (the handshake's round
trips): it fails at the deadline.

One connection, pipelined: every lookup is written as it is flushed (a tick's batch in one
write), and one reader takes the replies in order, answering each caller as its reply is
parsed. A lookup that gave up keeps its place: its reply is read and dropped, so the
connection stays in step and is not reconnected after every missed deadline. A connection
error fails every lookup in flight, and the next lookup opens a new connection. Every reply
read, a given-up lookup's too, reports its round trip (written to parsed) to `on_round_trip`:
what a deadline that follows Redis's recent latency learns from.

A connection, the calls written on it and its reader are one `_Wire`: a reader answers only
its own wire's calls, and a wire leaves (a disconnect, a connection the pool closed, an error)
in one step — its unanswered calls fail at once, its reader is stopped and waited for (at most
`STOP_READER_S`), and only then is the connection given back to the client's pool, once. A
reader cancelled before its first step never runs its own clean-up, and redis-py's connections
are reused objects: a connection given back while a reader may still read it, or given back
twice, would be read or closed under the pool's next user.

A `Rider` (`LookupLane.rider`) is a read that goes down the lane with the lookups: each
pipelined batch of lookups is written behind one command of the rider's (when it wants one),
in the same write, so its reply is read, and its callback run, before the lookups' callers
resume — the gateways' load figures read in the lookup's own round trip
(`gateway.fleet.shared_load`).

A Redis Cluster gets one lane per master (`cachemap.redis.node_lanes`): a lookup's keys share
one slot, so each lookup is one script call on one node, and a loop turn's lookups for a node
go down that node's lane in one write.

It reads redis-py's connection internals (`_reader`, `_writer`: the stream pair) to write
without an await and to see unread bytes; redis-py is pinned to one major (8), and the tests
that run lookups through here fail if they move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

log = logging.getLogger(__name__)

LAG_GRACE_S = 0.25
"""How long past its deadline a lookup whose reply bytes are waiting, unread, may wait for the
loop to read them: far above the loop lag seen under the bench's load (tens of ms), and still a
bound if something unforeseen kept bytes arriving without ever answering this lookup."""
RECHECK_S = 0.001
"""How often a lookup given grace re-checks: a loop iteration or so at the lag that gave it."""
STOP_READER_S = 5.0
"""How long a leaving wire waits for its reader to stop. A cancelled read stops at once; a
script load after NOSCRIPT may finish its call first (CPython 3.11's `asyncio.wait_for` in
redis-py's send can drop a cancellation, gh-86296), bounded by the client's socket timeout.
Past it the connection is not given back (a reader may still use it): logged, never lent."""


class LaneClient(Protocol):
    """What a lane takes its connection from: a `redis.asyncio.Redis`, or one node of a
    cluster (`cachemap.redis.node_lanes`)."""

    connection_pool: Any

    def script_load(self, source: str) -> Awaitable[Any]: ...


class CommandLane(Protocol):
    """What the request path's other calls go down (`LookupLane`, or a cluster's `NodeLanes`)."""

    def command(
        self,
        key: bytes,
        command: tuple[Any, ...],
        source: str = "",
        deadline_s: float | None = None,
    ) -> asyncio.Future[Any]: ...


class Rider(Protocol):
    """A read sent with the lookups (module docstring)."""

    key: bytes
    """Its key (what a cluster's lanes route it by)."""
    deadline_s: float

    def ride(self) -> tuple[tuple[Any, ...], Callable[[asyncio.Future[Any]], None]] | None:
        """The command to send with the next batch of lookups and the callback its answer
        (or failure) goes to; None when no read is wanted now."""
        ...


class LookupTimeout(TimeoutError):
    """Redis did not answer the lookup within its deadline (nothing was received)."""


class LoopLag(TimeoutError):
    """The lookup's reply was waiting, unread, for `LAG_GRACE_S` past its deadline: this
    process's loop was late, not Redis."""


class LaneClosed(RedisConnectionError):
    """The lane was closed or disconnected by its owner while the lookup was in flight."""


@dataclass(eq=False)
class _Call:
    command: tuple[Any, ...]
    future: asyncio.Future[Any]
    deadline_s: float | None
    source: str = ""
    """The script the command runs (loaded again if Redis lost it); "" for a plain command."""
    started: float = 0.0
    """`loop.time()` when the call was flushed (its deadline runs from here)."""
    sent: bool = False
    retried: bool = False
    graced: bool = False
    """Its deadline passed with its reply possibly waiting unread (counted once)."""
    wire: _Wire | None = None
    """The connection it was written on."""
    timer: asyncio.TimerHandle | None = None
    """Its deadline's timer, cancelled when its reply is read (else it would wake the loop
    once for nothing: a 1-s deadline fires long after the reply)."""


@dataclass(eq=False)
class _Wire:
    """One connection of the lane's, the calls written on it (in the order of their replies)
    and the reader taking those replies (module docstring)."""

    conn: AbstractConnection
    pending: deque[_Call] = field(default_factory=deque)
    reading: asyncio.Task[None] | None = None
    live: bool = True
    """False once it left the lane: nothing more is written on it."""
    given_back: bool = False


@dataclass
class LaneStats:
    late_answers: int = 0
    """Lookups given grace at their deadline: bytes were waiting unread on our side."""
    timeouts: int = 0
    """Lookups failed at their deadline: nothing received."""
    lagged: int = 0
    """Lookups failed because their reply waited unread past the grace (this loop's lag)."""
    connects: int = 0


class LookupLane:
    """Pipelined EVALSHA calls of one script on a connection of their own (module docstring)."""

    def __init__(
        self, client: LaneClient, source: str, sha: str, stats: LaneStats | None = None
    ) -> None:
        self._client = client
        self._source = source
        self._sha = sha
        self._wire: _Wire | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._waiting: list[_Call] = []
        """Calls flushed while the connection was opening, written once it is open."""
        self._leaving: set[asyncio.Task[None]] = set()
        """Wires leaving in the background (found closed at a send): reader stopped, then the
        connection given back."""
        self._closed = False
        self.stats = LaneStats() if stats is None else stats
        self.on_round_trip: Callable[[float], None] | None = None
        """Called with each reply's round trip in seconds (written to parsed)."""
        self.rider: Rider | None = None
        """A read written ahead of each batch of lookups (`send`), when it wants one."""

    @property
    def in_flight(self) -> int:
        """Lookups written and not yet answered (or given up and not yet read)."""
        return 0 if self._wire is None else len(self._wire.pending)

    def send(
        self, calls: Sequence[tuple[list[bytes], list[Any], float | None, asyncio.Future[Any]]]
    ) -> None:
        """Write the calls (keys, args, deadline, the future their caller awaits) in one go.
        The reader answers each future itself: a caller resumes one loop iteration after its
        reply is parsed."""
        batch = [
            _Call(("EVALSHA", self._sha, len(keys), *keys, *args), future, d, self._source)
            for keys, args, d, future in calls
        ]
        ride = self._ride()
        if ride is not None:  # ahead of the lookups: answered before their callers resume
            batch.insert(0, ride)
        self._send(batch)

    def _ride(self) -> _Call | None:
        rider = self.rider
        wanted = rider.ride() if rider is not None else None
        if rider is None or wanted is None:
            return None
        command, done = wanted
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.add_done_callback(done)
        return _Call(command, future, rider.deadline_s)

    def command(
        self,
        key: bytes,
        command: tuple[Any, ...],
        source: str = "",
        deadline_s: float | None = None,
    ) -> asyncio.Future[Any]:
        """Any other command down this lane, on the same deadline (Redis's time): another
        script's `EVALSHA` (`source`: its text, loaded again if Redis lost it) or a plain read.
        `key` is the command's first key (what a cluster's lanes route by; unused here).
        The request path's other calls — fan-out markers, a conversation's home — so the
        caller's loop lag is not counted against Redis (issue 39 item 1)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send([_Call(command, future, deadline_s, source)])
        return future

    def commands(
        self,
        commands: Sequence[tuple[Any, ...]],
        deadline_s: float | None = None,
        sources: Sequence[str] = (),
    ) -> list[asyncio.Future[Any]]:
        """Commands down this lane in one write, on one deadline (Redis's time): a round's
        pipeline without the pool's machinery (a connection taken and given back, the retry
        wrapper, the send's `wait_for`). `sources`: each command's script ("" for a plain
        command), loaded again if Redis lost it; none: all plain. Their answers, in order."""
        loop = asyncio.get_running_loop()
        scripts = sources or [""] * len(commands)
        batch = [
            _Call(command, loop.create_future(), deadline_s, source)
            for command, source in zip(commands, scripts, strict=True)
        ]
        self._send(batch)
        return [call.future for call in batch]

    def _send(self, batch: list[_Call]) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for call in batch:
            call.started = now
        if self._closed:
            _fail(batch, LaneClosed("the lookup lane is closed"))
            return
        wire = self._wire
        if wire is not None and _open(wire.conn):
            self._write(wire, batch)
        else:
            if wire is not None:  # closed under us (the pool disconnected it)
                self._wire = None
                task = asyncio.create_task(
                    self._leave(wire, LaneClosed("the lane's connection was closed")),
                    name="lookup lane leave",
                )
                self._leaving.add(task)
                task.add_done_callback(self._leaving.discard)
            self._waiting.extend(batch)
            if self._connecting is None:
                self._connecting = asyncio.create_task(self._open(), name="lookup lane connect")
        for call in batch:
            if call.deadline_s is not None:
                call.timer = loop.call_at(now + call.deadline_s, self._expire, call)

    async def warm(self) -> None:
        """Open the connection now (at start), so the first lookups do not wait for it. A
        failure is not raised: the next lookup tries again."""
        if self._wire is None and not self._closed:
            if self._connecting is None:
                self._connecting = asyncio.create_task(self._open(), name="lookup lane connect")
            await asyncio.shield(self._connecting)

    def _write(self, wire: _Wire, calls: list[_Call]) -> None:
        live = [call for call in calls if not call.future.done()]
        if not live:
            return
        writer = wire.conn._writer
        assert writer is not None
        writer.writelines(wire.conn.pack_commands([call.command for call in live]))
        for call in live:
            call.sent = True
            call.wire = wire
        wire.pending.extend(live)
        if wire.reading is None:
            wire.reading = asyncio.create_task(self._read(wire), name="lookup lane reader")

    async def _open(self) -> None:
        pool = self._client.connection_pool
        try:
            # taken from the client's pool and never given back: closing the client closes it
            conn: AbstractConnection = await pool.get_connection()
        except Exception as exc:
            waiting, self._waiting = self._waiting, []
            _fail(waiting, exc)
            return
        finally:
            self._connecting = None
        self.stats.connects += 1
        wire = _Wire(conn)
        if self._closed:
            await self._give_back(wire)
            return
        self._wire = wire
        waiting, self._waiting = self._waiting, []
        self._write(wire, waiting)

    async def _read(self, wire: _Wire) -> None:
        """Take the wire's replies in order until none is outstanding; a lookup that gave up
        still has its reply read (and dropped), so the next reply is the next caller's."""
        conn = wire.conn
        try:
            while wire.pending:
                try:
                    reply: Any = await conn.read_response()
                except ResponseError as exc:
                    reply = exc
                if not wire.pending:  # the wire left while this read ran (its calls failed)
                    return
                call = wire.pending.popleft()
                if self.on_round_trip is not None:
                    self.on_round_trip(asyncio.get_running_loop().time() - call.started)
                if isinstance(reply, NoScriptError) and call.source and not call.retried:
                    call.retried = True
                    try:
                        await self._client.script_load(call.source)  # Redis lost its scripts
                    except ResponseError as exc:  # it will not load it: the caller hears why
                        reply = exc
                    except BaseException as exc:  # off the wire's queue: `_retire` misses it
                        _fail([call], exc if isinstance(exc, Exception) else LaneClosed(repr(exc)))
                        raise
                    else:
                        if not call.future.done() and wire.live and _open(conn):
                            self._write_again(wire, call)
                            continue
                _answer(call, reply)
        except BaseException as exc:
            # the connection is out of step or gone: every call on it hears the error
            self._retire(wire, exc if isinstance(exc, Exception) else LaneClosed(repr(exc)))
            if isinstance(exc, asyncio.CancelledError):
                raise  # stopped by `_leave`, which gives the connection back
            wire.reading = None  # done with it: a `_leave` now need not stop this task
            await self._give_back(wire)
        finally:
            if wire.reading is asyncio.current_task():
                wire.reading = None

    def _write_again(self, wire: _Wire, call: _Call) -> None:
        writer = wire.conn._writer
        assert writer is not None
        writer.writelines(wire.conn.pack_commands([call.command]))
        # Redis answered the first write (NOSCRIPT) and loaded the script: the deadline runs
        # again from this write, so a script's first call after a restart is not a failure
        call.started = asyncio.get_running_loop().time()
        wire.pending.append(call)

    def _retire(self, wire: _Wire, exc: Exception) -> None:
        """The wire leaves the lane: nothing more is written on it, and its unanswered calls
        fail now (their replies, if any come, are not read)."""
        wire.live = False
        if self._wire is wire:
            self._wire = None
        pending = list(wire.pending)
        wire.pending.clear()
        _fail(pending, exc)

    async def _leave(self, wire: _Wire, exc: Exception) -> None:
        """Retire the wire, stop its reader (bounded), then give its connection back."""
        self._retire(wire, exc)
        reading = wire.reading
        if reading is not None and reading is not asyncio.current_task():
            reading.cancel()
            done, _ = await asyncio.wait({reading}, timeout=STOP_READER_S)
            if not done:
                log.warning(
                    "a lookup lane's reader did not stop within %.1f s: its connection is "
                    "not given back to the pool",
                    STOP_READER_S,
                )
                return
        await self._give_back(wire)

    def _expire(self, call: _Call) -> None:
        """The call's deadline: fail it unless its reply may be waiting on our side."""
        if call.future.done():
            return
        loop = asyncio.get_running_loop()
        assert call.deadline_s is not None
        if loop.time() < call.started + call.deadline_s:  # written again since (`_write_again`)
            call.timer = loop.call_at(call.started + call.deadline_s, self._expire, call)
            return
        wire = call.wire
        unread = call.sent and wire is not None and wire.live and _unread(wire.conn)
        if unread and loop.time() < call.started + call.deadline_s + LAG_GRACE_S:
            call.timer = loop.call_later(RECHECK_S, self._expire, call)
            if not call.graced:
                call.graced = True
                self.stats.late_answers += 1
            return
        if unread:  # replies have been waiting for the whole grace: this loop is late
            self.stats.lagged += 1
            call.future.set_exception(
                LoopLag(f"the reply waited unread {LAG_GRACE_S * 1000:.0f} ms past the deadline")
            )
            return
        self.stats.timeouts += 1
        call.future.set_exception(
            LookupTimeout(f"no reply from Redis within {call.deadline_s * 1000:.1f} ms")
        )

    async def disconnect(self) -> None:
        """Drop the connection (after an outage: it is dead); the next lookup opens another.
        The calls in flight on it fail at once (`LaneClosed`)."""
        wire = self._wire
        if wire is not None:
            await self._leave(wire, LaneClosed("the lookup lane was disconnected"))
        if self._leaving:  # connections found closed, on their way back to the pool
            await asyncio.wait(set(self._leaving))

    async def _give_back(self, wire: _Wire) -> None:
        """Close the wire's connection and hand it back to the pool (which opens it again when
        a command of the client's takes it) — once: the pool may lend it on at once."""
        if wire.given_back:
            return
        wire.given_back = True
        with contextlib.suppress(Exception):
            await wire.conn.disconnect(nowait=True)
        with contextlib.suppress(Exception):
            await self._client.connection_pool.release(wire.conn)

    async def close(self) -> None:
        self._closed = True
        connecting = self._connecting
        if connecting is not None:  # bounded: a connect's send may drop the cancellation
            connecting.cancel()
            await asyncio.wait({connecting}, timeout=STOP_READER_S)
        waiting, self._waiting = self._waiting, []
        _fail(waiting, LaneClosed("the lookup lane is closed"))
        await self.disconnect()


def _open(conn: AbstractConnection) -> bool:
    writer = conn._writer
    return writer is not None and not writer.is_closing()


def _unread(conn: AbstractConnection) -> bool:
    """Bytes Redis sent that this process has not parsed: in the stream's buffer (read from
    the socket, the reader not resumed yet), or in the kernel's (the loop has not polled)."""
    reader, writer = conn._reader, conn._writer
    if reader is None or writer is None:
        return False
    if len(reader._buffer):  # type: ignore[attr-defined]
        return True
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _answer(call: _Call, reply: Any) -> None:
    """The call's reply to its caller (unless it gave up), its deadline's timer cancelled."""
    if call.future.done():
        return
    if call.timer is not None:
        call.timer.cancel()
    if isinstance(reply, Exception):
        call.future.set_exception(reply)
    else:
        call.future.set_result(reply)


def _fail(calls: Sequence[_Call], exc: Exception) -> None:
    for call in calls:
        if not call.future.done():
            call.future.set_exception(exc)
