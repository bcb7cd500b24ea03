"""What the lookup script reads beside the directory's entries: hot prefixes' k (written when a
prefix's spread changes) and fan-out leaders' markers (written while a leader prefills).

    kvg:{TAG}:<block>:r   HASH    a matched prefix's request times and its k (`RateStore`)
    kvg:{TAG}:<block>:w   STRING  a fan-out leader's marker and its flight's blocks, on the
                                  flight's first block, set if absent (`MarkerStore`)
    kvg:{TAG}:<block>:h   STRING  a conversation's home: the replica its request ending at
                                  this block went to, PX = the affinity TTL (`HomeStore`)

All sit in their chain's slot, so one script call reads or writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachemap.affinity import MAX_WALK_BLOCKS, Home
from cachemap.keys import BlockHash
from cachemap.redis import scripts
from cachemap.redis.client import AnyRedis
from cachemap.redis.lookups import CommandLane
from cachemap.redis.schema import LAND_CHANNEL, block_keys, chain_call, text


class RateStore:
    def __init__(self, client: AnyRedis) -> None:
        self._set_k = client.register_script(scripts.SET_K)
        self._uncount = client.register_script(scripts.UNCOUNT)

    async def uncount(self, prefix: BlockHash) -> None:
        """Take back one request of the prefix's count (a later sibling of a fan-out flight)."""
        await self._uncount(keys=[block_keys([prefix])[0] + b":r"], args=[])

    def set_k_command(self, prefix: BlockHash, k: int) -> tuple[tuple[Any, ...], str]:
        """`set_k` as a command to pipeline and its script (`RedisDirectory.record_many`)."""
        return ("EVALSHA", self._set_k.sha, 1, block_keys([prefix])[0] + b":r", k), scripts.SET_K

    def uncount_command(self, prefix: BlockHash) -> tuple[tuple[Any, ...], str]:
        """`uncount` as a command to pipeline and its script (`RedisDirectory.record_many`)."""
        return ("EVALSHA", self._uncount.sha, 1, block_keys([prefix])[0] + b":r"), scripts.UNCOUNT


class MarkerStore:
    """With a `lane` (the lookups' own: `cachemap.redis.lookups`), a call given a deadline goes
    down it, the deadline on Redis's time (issue 39 item 1); without one, through the client."""

    def __init__(self, client: AnyRedis, lane: CommandLane | None = None) -> None:
        self.client = client
        self.lane = lane
        self._lead = client.register_script(scripts.LEAD)
        self._lead_place = client.register_script(scripts.LEAD_PLACE)
        self._land = client.register_script(scripts.LAND)

    async def lead(
        self,
        blocks: Sequence[BlockHash],
        marker: str,
        ttl_s: float,
        deadline_s: float | None = None,
        place: Sequence[Any] = (),
    ) -> int:
        """Mark the flight writing `blocks` (set if absent): one key, one SET, whatever the
        flight's length; 1 when this marker now holds it. `place`: the same blocks' placement
        in flight, `PLACE`'s arguments after the chain (`RedisDirectory.place_args`), written
        in the same call (`LEAD_PLACE`)."""
        if not blocks:
            return 0
        keys, head = chain_call(blocks)
        args: list[Any] = [*head, marker, int(ttl_s * 1000), *place]
        script, source = (
            (self._lead_place, scripts.LEAD_PLACE) if place else (self._lead, scripts.LEAD)
        )
        if deadline_s is not None and self.lane is not None:
            command = ("EVALSHA", script.sha, len(keys), *keys, *args)
            return int(await self.lane.command(keys[0], command, source, deadline_s))
        return int(await script(keys=keys, args=args))

    async def land(
        self, blocks: Sequence[BlockHash], marker: str, landed: str, ttl_s: float
    ) -> None:
        """The leader's write landed (or failed): its marker says so for `ttl_s`, and every
        gateway hears it on `LAND_CHANNEL`."""
        if not blocks:
            return
        keys, head = chain_call(blocks)
        await self._land(keys=keys, args=[*head, marker, landed, int(ttl_s * 1000), LAND_CHANNEL])

    def land_command(
        self, blocks: Sequence[BlockHash], marker: str, landed: str, ttl_s: float
    ) -> tuple[Any, ...]:
        """`land` as a command to pipeline (`RedisDirectory.record_many`; script `LAND`)."""
        keys, head = chain_call(blocks)
        args = [*head, marker, landed, int(ttl_s * 1000), LAND_CHANNEL]
        return ("EVALSHA", self._land.sha, len(keys), *keys, *args)

    async def read_marker(self, first: BlockHash, deadline_s: float | None = None) -> str | None:
        """The marker of the flight whose first block is `first` (the lookup's `writer_from`)."""
        key = block_keys([first])[0] + b":w"
        if deadline_s is not None and self.lane is not None:
            value = await self.lane.command(key, ("GET", key), "", deadline_s)
        else:
            value = await self.client.get(key)
        if value is None:
            return None
        raw = value if isinstance(value, bytes) else value.encode()
        return text(raw.split(b"\n", 1)[0])  # the flight's blocks after it are binary


class HomeStore:
    """Conversations' homes shared by every gateway (`cachemap.affinity.ConversationAffinity`'s
    lookup and record, one script call each; Redis expires them, so the TTL bounds them)."""

    def __init__(self, client: AnyRedis, lane: CommandLane | None = None) -> None:
        self.lane = lane
        """As `MarkerStore.lane`."""
        self._home = client.register_script(scripts.HOME)
        self._set_home = client.register_script(scripts.SET_HOME)

    async def lookup(
        self, hashes: Sequence[BlockHash], deadline_s: float | None = None
    ) -> Home | None:
        if not hashes:
            return None
        keys, head = chain_call(hashes)
        args: list[Any] = [*head, MAX_WALK_BLOCKS]
        if deadline_s is not None and self.lane is not None:
            command = ("EVALSHA", self._home.sha, len(keys), *keys, *args)
            found = await self.lane.command(keys[0], command, scripts.HOME, deadline_s)
        else:
            found = await self._home(keys=keys, args=args)
        if not found:
            return None
        depth, replica = int(found[0]), text(found[1])
        return Home(replica, depth, hashes[depth - 1])

    async def record(
        self, hashes: Sequence[BlockHash], replica: str, home: Home | None, ttl_s: float
    ) -> None:
        if not hashes:
            return
        superseded = [home.key] if home is not None and home.key != hashes[-1] else []
        keys = [key + b":h" for key in block_keys([hashes[-1], *superseded])]
        await self._set_home(keys=keys, args=[replica, max(int(ttl_s * 1000), 1)])

    def record_command(
        self, hashes: Sequence[BlockHash], replica: str, home: Home | None, ttl_s: float
    ) -> tuple[Any, ...]:
        """`record` as a command to pipeline (`RedisDirectory.record_many`; script
        `SET_HOME`)."""
        superseded = [home.key] if home is not None and home.key != hashes[-1] else []
        keys = [key + b":h" for key in block_keys([hashes[-1], *superseded])]
        return ("EVALSHA", self._set_home.sha, len(keys), *keys, replica, max(int(ttl_s * 1000), 1))
