"""A Redis Cluster's lookups: one `LookupLane` per master, so a cluster's deadline counts
Redis's time too (not a wall-clock `wait_for` around redis-py's cluster pipeline, which counted
this process's loop lag against Redis).

    lookup ──keyslot(first key)──▶ its master's lane ──one write per loop turn──▶ that master

A lookup's keys share one slot (the chain's tag), so it is one script call on one node; the
lookups of one loop turn for one node share one write, each still its own command and reply.
A node's lane runs on one of the cluster client's own connections to that node (its settings:
host, port, TLS, password, protocol), taken from the node by name when the lane (re)opens:
closing the cluster client closes it, so a lane its owner never closed leaves nothing open.
A reply that says the slot moved (`MOVED`, `ASK`) or a node that went away fails that lookup
(the caller falls back) and reloads the slot map, at most once per `SLOTS_REFRESH_S`; lanes of
nodes that are no longer masters are closed.

A rider (`LookupLane.rider`) goes down its own key's master's lane, beside the lookups it
rides with (`ride`): on a cluster its key is in another slot, so its reply may come after a
lookup's, and that lookup's decision uses the rider's previous answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import AskError, MovedError
from redis.exceptions import ConnectionError as RedisConnectionError

from cachemap.redis.lookups import LaneClosed, LaneStats, LookupLane, Rider

log = logging.getLogger(__name__)

SLOTS_REFRESH_S = 1.0
"""At most one reload of the slot map per second after a moved slot or a lost node: a
failover takes seconds, and every lookup in between falls back to the local index anyway."""

Call = tuple[list[bytes], list[Any], float | None, asyncio.Future[Any]]


class NodeLanes:
    """One lookup lane per cluster master, chosen by the lookup's slot (module docstring).
    The lanes share one `LaneStats`; `on_round_trip` is every lane's."""

    def __init__(self, client: RedisCluster, source: str, sha: str) -> None:
        self._client = client
        self._source = source
        self._sha = sha
        self._lanes: dict[str, LookupLane] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -SLOTS_REFRESH_S
        self._closed = False
        self.stats = LaneStats()
        self._on_round_trip: Callable[[float], None] | None = None
        self.rider: Rider | None = None
        """A read sent with each batch of lookups, on its key's master (`ride`)."""

    @property
    def on_round_trip(self) -> Callable[[float], None] | None:
        return self._on_round_trip

    @on_round_trip.setter
    def on_round_trip(self, hook: Callable[[float], None] | None) -> None:
        self._on_round_trip = hook
        for lane in self._lanes.values():
            lane.on_round_trip = hook

    @property
    def in_flight(self) -> int:
        return sum(lane.in_flight for lane in self._lanes.values())

    def send(self, calls: Sequence[Call]) -> None:
        """Each call to its slot's master, one write per master."""
        by_node: dict[str, list[Call]] = {}
        nodes: dict[str, ClusterNode] = {}
        for call in calls:
            if self._closed:
                call[3].set_exception(LaneClosed("the lookup lanes are closed"))
                continue
            try:
                node = self._client.get_node_from_key(call[0][0])  # type: ignore[arg-type]  # bytes work
            except Exception as exc:  # the slot is not covered (a cluster mid-failover)
                self._stale()
                call[3].set_exception(exc)
                continue
            assert node is not None
            nodes[node.name] = node
            by_node.setdefault(node.name, []).append(call)
            call[3].add_done_callback(self._check)
        for name, batch in by_node.items():
            self._lane(nodes[name]).send(batch)
        if by_node:
            self.ride()

    def ride(self) -> asyncio.Future[Any] | None:
        """The rider's read, when it wants one, down its key's master's lane (in parallel
        with the lookups on theirs: no round trip added to theirs). Returns its answer
        (None: no read sent)."""
        rider = self.rider
        wanted = rider.ride() if rider is not None and not self._closed else None
        if rider is None or wanted is None:
            return None
        command, done = wanted
        future = self.command(rider.key, command, "", rider.deadline_s)
        future.add_done_callback(done)
        return future

    def command(
        self,
        key: bytes,
        command: tuple[Any, ...],
        source: str = "",
        deadline_s: float | None = None,
    ) -> asyncio.Future[Any]:
        """Any other command down the lane of `key`'s master (`LookupLane.command`)."""
        if self._closed:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_exception(LaneClosed("the lookup lanes are closed"))
            return future
        try:
            node = self._client.get_node_from_key(key)  # type: ignore[arg-type]  # bytes work
        except Exception as exc:  # the slot is not covered (a cluster mid-failover)
            self._stale()
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
            return future
        assert node is not None
        future = self._lane(node).command(key, command, source, deadline_s)
        future.add_done_callback(self._check)
        return future

    def _lane(self, node: ClusterNode) -> LookupLane:
        lane = self._lanes.get(node.name)
        if lane is None:
            client = _NodeClient(self._client, node.name)
            lane = LookupLane(client, self._source, self._sha, self.stats)
            lane.on_round_trip = self._on_round_trip
            self._lanes[node.name] = lane
        return lane

    def _check(self, future: asyncio.Future[Any]) -> None:
        """A slot that moved, or a node that went away: reload the slot map."""
        if future.cancelled():
            return
        exc = future.exception()
        if isinstance(exc, MovedError | AskError) or (
            isinstance(exc, RedisConnectionError) and not isinstance(exc, LaneClosed)
        ):
            self._stale()

    def _stale(self) -> None:
        now = time.monotonic()
        if self._closed or self._refreshing is not None:
            return
        if now - self._refreshed_at < SLOTS_REFRESH_S:
            return
        self._refreshed_at = now
        self._refreshing = asyncio.create_task(self._refresh(), name="cluster slots refresh")

    async def _refresh(self) -> None:
        try:
            await self._client.nodes_manager.initialize()
        except Exception as exc:  # the next failure tries again
            log.debug("cluster slot map reload failed: %r", exc)
        else:
            masters = {node.name for node in self._client.get_primaries()}
            for name in [name for name in self._lanes if name not in masters]:
                await self._close_lane(name)
        finally:
            self._refreshing = None

    async def warm(self) -> None:
        """Open a lane to every master now (at start); failures are not raised."""
        with contextlib.suppress(Exception):
            await asyncio.gather(*(self._lane(n).warm() for n in self._client.get_primaries()))

    async def disconnect(self) -> None:
        """Drop every lane's connection and reload the slot map (after an outage: a master may
        have failed over); the next lookups open new ones."""
        for lane in self._lanes.values():
            await lane.disconnect()
        self._refreshed_at = time.monotonic()
        with contextlib.suppress(Exception):
            await self._client.nodes_manager.initialize()

    async def _close_lane(self, name: str) -> None:
        await self._lanes.pop(name).close()

    async def close(self) -> None:
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(BaseException):
                await self._refreshing
        for name in list(self._lanes):
            await self._close_lane(name)


class _NodePool:
    """The cluster client's connections to one node, lent to a lane as a pool would: the node
    is looked up by name at each take (a reloaded slot map makes new node objects), and a
    connection goes back to the node that lent it."""

    def __init__(self, cluster: RedisCluster, name: str) -> None:
        self._cluster = cluster
        self._name = name
        self._lent: dict[int, ClusterNode] = {}

    async def get_connection(self) -> Connection:
        node = self._cluster.get_node(node_name=self._name)
        if node is None:
            raise RedisConnectionError(f"{self._name} is no longer a node of the cluster")
        conn = node.acquire_connection()
        try:
            if not conn.is_connected:
                await conn.connect()  # type: ignore[no-untyped-call]
        except BaseException:
            node.release(conn)
            raise
        self._lent[id(conn)] = node
        return conn

    async def release(self, conn: Connection) -> None:
        node = self._lent.pop(id(conn), None)
        if node is not None:
            node.release(conn)


class _NodeClient:
    """What a `LookupLane` needs of a client, on one node of a cluster."""

    def __init__(self, cluster: RedisCluster, name: str) -> None:
        self._cluster = cluster
        self._name = name
        self.connection_pool = _NodePool(cluster, name)

    async def script_load(self, source: str) -> Any:
        node = self._cluster.get_node(node_name=self._name)
        if node is None:
            raise RedisConnectionError(f"{self._name} is no longer a node of the cluster")
        return await self._cluster.execute_command("SCRIPT LOAD", source, target_nodes=node)
