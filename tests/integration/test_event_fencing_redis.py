"""Issue 45, item 10: the shared event index's fencing. An owner whose process stalls (a real
SIGSTOP) past its lease, while another gateway adopted its domain and wiped it, must not land
its late flush: before, it wrote the domain's epoch back to the older one, and every reader
counted its pre-wipe blocks again."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cachemap.events import AllBlocksCleared, BlockStored, precise_keys
from cachemap.redis.client import open_redis
from cachemap.redis.event_scripts import DOMAINS_KEY, feed_key, lease_key, map_key
from cachemap.redis.events import EventReader, EventWriter, Leases
from cachemap.redis.schema import replica_id
from tests.integration.fenced_owner import FIRST, SALT, SECOND

pytestmark = pytest.mark.redis
LEASE_S = 0.3
DEADLINE_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


def stopped(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state in ("T", "t")


async def wait_for(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll a condition (bounded): the owner's state, the lease."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not await predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_stalled_owners_late_flush_is_refused(redis_url: str) -> None:
    domain = f"http://{uuid.uuid4().hex[:8]}:8000"
    rid = replica_id(domain)
    redis = await open_redis(redis_url, cluster=False)
    owner = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tests.integration.fenced_owner", redis_url, domain),
        str(LEASE_S),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )

    async def owner_stopped() -> bool:
        return stopped(owner.pid)

    async def lease_gone() -> bool:  # it runs out while the owner is stopped
        return not await redis.exists(lease_key(rid))

    try:
        assert owner.stdout is not None
        assert (await owner.stdout.readline()).strip() == b"pending"
        await wait_for(owner_stopped, "the owner to stop")
        await wait_for(lease_gone, "the lease to run out")
        # another gateway takes the domain over; the engine restarted: a wipe
        assert await Leases(redis, "new-owner", 5.0).acquire(domain)
        writer = EventWriter(redis, block_size=16)
        await writer.adopt(domain)
        old_epoch = writer.committed_epochs[domain]
        writer.apply(domain, AllBlocksCleared())
        await writer.commit(domain, 1, wiped=True)
        assert writer.committed_epochs[domain] == old_epoch + 1
        owner.send_signal(signal.SIGCONT)  # it resumes and flushes what it had pending
        out = (await asyncio.wait_for(owner.communicate(), DEADLINE_S))[0].decode()
        epoch = int((await redis.hget(DOMAINS_KEY, rid)).split(b"|", 1)[0])
        reader = EventReader(redis)
        late = await reader.lookup(precise_keys(SECOND, SALT, 16))
        assert (epoch, domain in late) == (old_epoch + 1, False), out
        assert out.strip() == "flushed owned=False fenced=1"
        # the new owner goes on writing
        writer.apply(domain, AllBlocksCleared())
        await writer.commit(domain, 2, wiped=True)
        assert writer.committed_epochs[domain] == old_epoch + 2 and writer.fenced == 0
        await writer.close()
    finally:
        if owner.returncode is None:
            owner.kill()
            await owner.wait()
        await redis.aclose()


async def test_on_a_cluster_a_superseded_owner_neither_moves_the_epoch_back_nor_the_map(
    redis_cluster_url: str,
) -> None:
    """The same race in one process, on a 3-master cluster: there the block writes sit in
    other slots than the owners hash, so they are fenced by the epoch alone; the domain's
    entry, the map and the seq are refused by the token."""
    domain = f"http://{uuid.uuid4().hex[:8]}:8000"
    rid = replica_id(domain)
    redis = await open_redis(redis_cluster_url, cluster=True)
    old, new = EventWriter(redis, block_size=16), EventWriter(redis, block_size=16)
    try:
        await old.adopt(domain)
        old.apply(domain, BlockStored([1, 2, 3, 4], None, FIRST, 16, cache_salt=SALT))
        await old.commit(domain, 1, wiped=False)
        await old.flush()
        await new.adopt(domain)  # the old owner stalled past its lease
        new.apply(domain, AllBlocksCleared())
        await new.commit(domain, 2, wiped=True)
        epoch = new.committed_epochs[domain]
        old.apply(domain, BlockStored([11, 12, 13, 14], None, SECOND, 16, cache_salt=SALT))
        await old.commit(domain, 7, wiped=False)
        await old.flush()
        assert old.fenced == 1 and not old.owns(domain)
        stored = await redis.hget(DOMAINS_KEY, rid)
        assert stored is not None and int(stored.split(b"|", 1)[0]) == epoch
        assert await redis.hget(feed_key(rid), "next_seq") == b"2"
        assert await redis.hlen(map_key(rid)) == 0
        reader = EventReader(redis)
        assert domain not in await reader.lookup(precise_keys(SECOND, SALT, 16))
    finally:
        await old.close()
        await new.close()
        await redis.aclose()
