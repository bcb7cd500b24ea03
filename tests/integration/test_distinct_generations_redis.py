"""Issue 39: the Redis directory's capacity in distinct generations (`DISTINCT_GENERATIONS`).

Two generations of 3/4 of the capacity held between 0.75x and 1.5x of it in distinct blocks
where prefixes were used again across generations (a conversation's next turn): the shared
directory forgot prefixes the engine held, or listed ones it evicted. Redis now counts a
replica's entries at each live generation, and what matches stays within half a generation of
the capacity, as the in-process store's exact LRU; on one Redis and on a Cluster (which records,
then counts in the meta slot), across a restart epoch, and beside a gateway of the commit before
(which counts and advances by its own rule)."""

from __future__ import annotations

import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.directory import RedisDirectory, blocks_per_generation
from cachemap.redis.schema import LIVE_KEY, block_keys, replica_id, text
from loadgen.harness.redis_servers import RedisServer
from tests.trees import unpacked

pytestmark = [pytest.mark.redis]

CAPACITY = 320
"""Entries per replica: 20 a generation."""
BEFORE_COMMIT = "fca0b33403c25751b96a1d5f5b0b9f9c45096af9"
"""main before the distinct generations: two generations of 3/4 of the capacity."""


def conversations(seed: int, count: int = 24, turns: int = 8) -> list[list[BlockHash]]:
    """Chains in the order they are recorded: conversations of 12-40 blocks of shared prefix,
    each turn the previous turn's chain and 3-9 blocks more, turns interleaved at random."""
    rng = random.Random(seed)
    chains: list[list[list[BlockHash]]] = []
    for c in range(count):
        full = chain_hashes(uuid.uuid4().bytes * 1200, root_hash(b"t", f"conv{c}"), 256)
        length = rng.randrange(12, 40)
        turns_of = []
        for _ in range(turns):
            turns_of.append(list(full[:length]))
            length += rng.randrange(3, 10)
        chains.append(turns_of)
    order = [c for c in range(count) for _ in range(turns)]
    rng.shuffle(order)
    at = [0] * count
    out = []
    for c in order:
        out.append(chains[c][at[c]])
        at[c] += 1
    return out


def matching(sync: redis.Redis, rid: str, blocks: set[BlockHash], oldest: int) -> int:
    """How many of `blocks` Redis holds for `rid` at a generation a lookup matches."""
    live = 0
    for block in blocks:
        value = sync.hget(block_keys([block])[0], rid)
        if value is not None and int(text(value).split(":")[0]) >= oldest:
            live += 1
    return live


def live_counts(sync: redis.Redis, rid: str) -> dict[int, int]:
    """Redis's count of a replica's entries at each live generation."""
    value = sync.hget(LIVE_KEY, rid)
    assert value is not None
    counts = text(value).split(";")[1:]
    return {int(g): int(n) for g, n in (p.split(":") for p in counts if p)}


async def live_within_half_a_generation(client: AnyRedis, sync: redis.Redis, seed: int) -> None:
    d = RedisDirectory(client, capacity_blocks=CAPACITY)
    await d.refresh_generations()
    d.register(["r1"])
    rid = replica_id("r1")
    recorded: set[BlockHash] = set()
    per_gen = blocks_per_generation(CAPACITY)
    worst, biggest = 0.0, per_gen
    try:
        for i, chain in enumerate(conversations(seed)):
            await d.record("r1", chain)
            recorded.update(chain)
            # the most recent chain always matches whole
            assert (await d.lookup(chain)).get("r1") == len(chain), i
            biggest = max(biggest, *live_counts(sync, rid).values())
            if len(recorded) < 2 * CAPACITY or i % 8:
                continue
            live = matching(sync, rid, recorded, d.oldest_live("r1"))
            counted = live_counts(sync, rid)
            assert sum(counted.values()) == live, (i, counted, live)  # Redis counts exactly
            worst = max(worst, abs(live - CAPACITY) / CAPACITY)
            # within half a generation of the capacity (0.75x-1.5x before); a generation is
            # `per_gen` entries, or more where one record's new blocks crossed it at once (the
            # one dropped last is gone: the largest seen)
            assert abs(live - CAPACITY) <= biggest / 2, (i, live, counted)
        assert worst < 0.2  # two generations of 3/4: up to 0.5
    finally:
        await d.close()


async def test_the_live_entries_stay_within_half_a_generation_of_the_capacity(
    fresh_redis: RedisServer,
) -> None:
    client = await open_redis(fresh_redis.url)
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        await live_within_half_a_generation(client, sync, seed=1)
    finally:
        sync.close()


async def test_a_cluster_records_then_counts_alike(redis_cluster_url: str) -> None:
    client = await open_redis(redis_cluster_url)
    sync = redis.RedisCluster.from_url(redis_cluster_url)
    try:
        await live_within_half_a_generation(client, sync, seed=2)  # type: ignore[arg-type]
    finally:
        sync.close()


async def test_a_restart_epoch_leaves_nothing_older_live(fresh_redis: RedisServer) -> None:
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client, capacity_blocks=CAPACITY)
    await d.refresh_generations()
    d.register(["r1"])
    chains = conversations(3, count=6, turns=6)
    try:
        for chain in chains:
            await d.record("r1", chain)
        assert d.oldest_live("r1") < d.meta.gen(replica_id("r1")) - 1  # many generations live
        await d.forget("r1")
        gen = d.meta.gen(replica_id("r1"))
        assert d.oldest_live("r1") == gen
        assert [await d.lookup(c) for c in chains] == [{}] * len(chains)
        await d.record("r1", chains[-1])
        assert await d.lookup(chains[-1]) == {"r1": len(chains[-1])}
        # a second gateway learns it from Redis alone
        other = RedisDirectory(await open_redis(fresh_redis.url), capacity_blocks=CAPACITY)
        await other.refresh_generations()
        other.register(["r1"])
        try:
            assert other.oldest_live("r1") == gen
            others = [c for c in chains if c[0] != chains[-1][0]]  # other conversations
            assert others and [await other.lookup(c) for c in others] == [{}] * len(others)
        finally:
            await other.close()
    finally:
        await d.close()


@pytest.fixture(scope="module")
def before_tree() -> Iterator[Path]:
    """The commit before, unpacked once under /tmp, with this checkout's native module."""
    with unpacked(BEFORE_COMMIT, native=True) as tree:
        yield tree


OLD_GATEWAY = """
import asyncio, sys
from cachemap.keys import chain_hashes, root_hash
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory

async def main(url, seed, n):
    d = RedisDirectory(await open_redis(url), capacity_blocks=int(sys.argv[4]))
    await d.refresh_generations()
    d.register(["r1"])
    if n == 0:
        await d.forget("r1")
    for c in range(n):
        full = chain_hashes(bytes([seed, c]) * 9000, root_hash(b"t", f"old{seed}/{c}"), 256)
        await d.record("r1", full[:30])
        assert (await d.lookup(full[:30])).get("r1") == 30
    await d.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def test_beside_a_gateway_of_the_commit_before(
    fresh_redis: RedisServer, before_tree: Path
) -> None:
    """A gateway of the commit before advances the generation by its own count (3/4 of the
    capacity in blocks new to it) and passes its generation less one to its lookups: this
    code then trusts no live counts of another generation and matches from the generation
    before, as it does: a record of either is matched by both, and a restart epoch the old
    gateway reports leaves nothing older live here."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client, capacity_blocks=CAPACITY)
    await d.refresh_generations()
    d.register(["r1"])
    rid = replica_id("r1")

    def old_gateway(seed: int, n: int) -> None:
        run = subprocess.run(
            [sys.executable, "-c", OLD_GATEWAY, fresh_redis.url, str(seed), str(n), str(CAPACITY)],
            cwd=before_tree,
            env={"PYTHONPATH": str(before_tree)},
            capture_output=True,
            check=False,
        )
        assert run.returncode == 0, run.stderr.decode()

    try:
        for chain in conversations(4, count=8, turns=4):
            await d.record("r1", chain)
        assert d.oldest_live("r1") < d.meta.gen(rid) - 1
        mine = conversations(5, count=1, turns=1)[0]
        await d.record("r1", mine)
        old_gateway(1, 20)  # 600 new blocks: it advances the generation by its count
        await d.refresh_generations()
        gen = d.meta.gen(rid)
        assert gen > 0 and d.oldest_live("r1") == gen - 1  # the rule both agree on
        old_chain = chain_hashes(bytes([1, 19]) * 9000, root_hash(b"t", "old1/19"), 256)[:30]
        assert await d.lookup(old_chain) == {"r1": 30}  # its record matches here
        await d.record("r1", mine)  # and this code counts on from the generation before
        assert await d.lookup(mine) == {"r1": len(mine)}
        for chain in conversations(6, count=8, turns=4):
            await d.record("r1", chain)
        assert d.oldest_live("r1") <= d.meta.gen(rid) - 1
        assert await d.lookup(chain) == {"r1": len(chain)}
        old_gateway(2, 0)  # it reports a restart: its BUMP knows nothing of the live counts
        await d.refresh_generations()
        assert d.oldest_live("r1") == d.meta.gen(rid) - 1
        assert not await d.lookup(chain)
    finally:
        await d.close()
