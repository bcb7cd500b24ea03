"""A Redis Cluster's lookups: one `LookupLane` per master, so a cluster's deadline counts
Redis's time too (not a wall-clock `wait_for` around redis-py's cluster pipeline, which counted
this process's loop lag against Redis).

    lookup ──keyslot(first key)──▶ its master's lane ──one write per loop turn──▶ that master

A lookup's keys share one slot (the chain's tag), so it is one script call on one node; the
lookups of one loop turn for one node share one write, each still its own command and reply.
A node's lane runs on a client of its own, built from the cluster client's own settings for
that node (host, port, TLS, password, protocol). A reply that says the slot moved (`MOVED`,
`ASK`) or a node that went away fails that lookup (the caller falls back) and reloads the slot
map, at most once per `SLOTS_REFRESH_S`; lanes of nodes that are no longer masters are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import ConnectionPool
from redis.exceptions import AskError, MovedError
from redis.exceptions import ConnectionError as RedisConnectionError

from cachemap.redis.lookups import LaneClosed, LaneStats, LookupLane

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
        self._lanes: dict[str, tuple[aioredis.Redis, LookupLane]] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -SLOTS_REFRESH_S
        self._closed = False
        self.stats = LaneStats()
        self._on_round_trip: Callable[[float], None] | None = None

    @property
    def on_round_trip(self) -> Callable[[float], None] | None:
        return self._on_round_trip

    @on_round_trip.setter
    def on_round_trip(self, hook: Callable[[float], None] | None) -> None:
        self._on_round_trip = hook
        for _, lane in self._lanes.values():
            lane.on_round_trip = hook

    @property
    def in_flight(self) -> int:
        return sum(lane.in_flight for _, lane in self._lanes.values())

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

    def _lane(self, node: ClusterNode) -> LookupLane:
        held = self._lanes.get(node.name)
        if held is None:
            pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            client = aioredis.Redis(connection_pool=pool)
            lane = LookupLane(client, self._source, self._sha, self.stats)
            lane.on_round_trip = self._on_round_trip
            held = self._lanes[node.name] = (client, lane)
        return held[1]

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
        for _, lane in self._lanes.values():
            await lane.disconnect()
        self._refreshed_at = time.monotonic()
        with contextlib.suppress(Exception):
            await self._client.nodes_manager.initialize()

    async def _close_lane(self, name: str) -> None:
        client, lane = self._lanes.pop(name)
        await lane.close()
        with contextlib.suppress(Exception):
            await client.connection_pool.disconnect()
        with contextlib.suppress(Exception):
            await client.aclose()

    async def close(self) -> None:
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(BaseException):
                await self._refreshing
        for name in list(self._lanes):
            await self._close_lane(name)
