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
import select
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

LAG_GRACE_S = 0.25
"""How long past its deadline a lookup whose reply bytes are waiting, unread, may wait for the
loop to read them: far above the loop lag seen under the bench's load (tens of ms), and still a
bound if something unforeseen kept bytes arriving without ever answering this lookup."""
RECHECK_S = 0.001
"""How often a lookup given grace re-checks: a loop iteration or so at the lag that gave it."""


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
        self._conn: AbstractConnection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._waiting: list[_Call] = []
        """Calls flushed while the connection was opening, written once it is open."""
        self._pending: deque[_Call] = deque()
        """Calls written, in the order of their replies."""
        self._reading: asyncio.Task[None] | None = None
        self._closed_conns: list[AbstractConnection] = []
        """Connections found closed at a send (not by the lane), to give back to the pool."""
        self._closed = False
        self.stats = LaneStats() if stats is None else stats
        self.on_round_trip: Callable[[float], None] | None = None
        """Called with each reply's round trip in seconds (written to parsed)."""

    @property
    def in_flight(self) -> int:
        """Lookups written and not yet answered (or given up and not yet read)."""
        return len(self._pending)

    def send(
        self, calls: Sequence[tuple[list[bytes], list[Any], float | None, asyncio.Future[Any]]]
    ) -> None:
        """Write the calls (keys, args, deadline, the future their caller awaits) in one go.
        The reader answers each future itself: a caller resumes one loop iteration after its
        reply is parsed."""
        self._send(
            [
                _Call(("EVALSHA", self._sha, len(keys), *keys, *args), future, d, self._source)
                for keys, args, d, future in calls
            ]
        )

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

    def _send(self, batch: list[_Call]) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for call in batch:
            call.started = now
        if self._closed:
            _fail(batch, LaneClosed("the lookup lane is closed"))
            return
        conn = self._conn
        if conn is not None and _open(conn):
            self._write(conn, batch)
        else:
            if conn is not None:  # closed under us (the pool disconnected): given back below
                self._closed_conns.append(conn)
            self._conn = None
            self._waiting.extend(batch)
            if self._connecting is None:
                self._connecting = asyncio.create_task(self._open(), name="lookup lane connect")
        for call in batch:
            if call.deadline_s is not None:
                loop.call_at(now + call.deadline_s, self._expire, call)

    async def warm(self) -> None:
        """Open the connection now (at start), so the first lookups do not wait for it. A
        failure is not raised: the next lookup tries again."""
        if self._conn is None and not self._closed:
            if self._connecting is None:
                self._connecting = asyncio.create_task(self._open(), name="lookup lane connect")
            await asyncio.shield(self._connecting)

    def _write(self, conn: AbstractConnection, calls: list[_Call]) -> None:
        live = [call for call in calls if not call.future.done()]
        if not live:
            return
        writer = conn._writer
        assert writer is not None
        writer.writelines(conn.pack_commands([call.command for call in live]))
        for call in live:
            call.sent = True
        self._pending.extend(live)
        if self._reading is None:
            self._reading = asyncio.create_task(self._read(conn), name="lookup lane reader")

    async def _open(self) -> None:
        pool = self._client.connection_pool
        closed, self._closed_conns = self._closed_conns, []
        for old in closed:
            await self._drop(old)
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
        if self._closed:
            await self._drop(conn)
            return
        self._conn = conn
        waiting, self._waiting = self._waiting, []
        self._write(conn, waiting)

    async def _read(self, conn: AbstractConnection) -> None:
        """Take the replies in order until none is outstanding; a lookup that gave up still
        has its reply read (and dropped), so the next reply is the next caller's."""
        try:
            while self._pending:
                try:
                    reply: Any = await conn.read_response()
                except ResponseError as exc:
                    reply = exc
                call = self._pending.popleft()
                if self.on_round_trip is not None:
                    self.on_round_trip(asyncio.get_running_loop().time() - call.started)
                if isinstance(reply, NoScriptError) and call.source and not call.retried:
                    await self._client.script_load(call.source)  # Redis lost its scripts
                    call.retried = True
                    if not call.future.done() and conn is self._conn and _open(conn):
                        self._write_again(conn, call)
                        continue
                if call.future.done():
                    continue
                if isinstance(reply, Exception):
                    call.future.set_exception(reply)
                else:
                    call.future.set_result(reply)
        except BaseException as exc:
            # the connection is out of step or gone: every call on it hears the error
            pending, self._pending = list(self._pending), deque()
            _fail(pending, exc if isinstance(exc, Exception) else LaneClosed(repr(exc)))
            if self._conn is conn:
                self._conn = None
            await self._drop(conn)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._reading is asyncio.current_task():
                self._reading = None

    def _write_again(self, conn: AbstractConnection, call: _Call) -> None:
        writer = conn._writer
        assert writer is not None
        writer.writelines(conn.pack_commands([call.command]))
        # Redis answered the first write (NOSCRIPT) and loaded the script: the deadline runs
        # again from this write, so a script's first call after a restart is not a failure
        call.started = asyncio.get_running_loop().time()
        self._pending.append(call)

    def _expire(self, call: _Call) -> None:
        """The call's deadline: fail it unless its reply may be waiting on our side."""
        if call.future.done():
            return
        loop = asyncio.get_running_loop()
        assert call.deadline_s is not None
        if loop.time() < call.started + call.deadline_s:  # written again since (`_write_again`)
            loop.call_at(call.started + call.deadline_s, self._expire, call)
            return
        conn = self._conn
        unread = call.sent and conn is not None and _unread(conn)
        if unread and loop.time() < call.started + call.deadline_s + LAG_GRACE_S:
            loop.call_later(RECHECK_S, self._expire, call)
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
        """Drop the connection (after an outage: it is dead); the next lookup opens another."""
        conn, self._conn = self._conn, None
        reading = self._reading
        if reading is not None:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
        if conn is not None:
            await self._drop(conn)

    async def _drop(self, conn: AbstractConnection) -> None:
        """Close a connection of the lane's and hand it back to the pool (which opens it again
        when a command of the client's takes it)."""
        with contextlib.suppress(Exception):
            await conn.disconnect(nowait=True)
        with contextlib.suppress(Exception):
            await self._client.connection_pool.release(conn)

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
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


def _fail(calls: Sequence[_Call], exc: Exception) -> None:
    for call in calls:
        if not call.future.done():
            call.future.set_exception(exc)
