"""An owner of the shared event index in a process of its own, for the fencing test
(tests/integration/test_event_fencing_redis.py): it takes a domain's lease, writes a chain,
applies another, then stops itself (SIGSTOP) with that flush pending. Resumed (SIGCONT) long
after its lease ran out, it flushes and prints what became of the flush."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from cachemap.events import BlockStored
from cachemap.redis.client import open_redis
from cachemap.redis.events import EventWriter, Leases

SALT = "fenced"
FIRST = list(range(100, 100 + 16 * 4))
SECOND = list(range(700, 700 + 16 * 4))


async def main(url: str, domain: str, lease_s: float) -> None:
    redis = await open_redis(url, cluster=False)
    assert await Leases(redis, "old-owner", lease_s).acquire(domain)
    writer = EventWriter(redis, block_size=16)
    await writer.adopt(domain)
    writer.apply(domain, BlockStored([1, 2, 3, 4], None, FIRST, 16, cache_salt=SALT))
    await writer.flush()
    writer.apply(domain, BlockStored([11, 12, 13, 14], None, SECOND, 16, cache_salt=SALT))
    print("pending", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # the loop stalls with the flush pending
    try:
        await writer.flush()
    except Exception as exc:
        print(f"failed {exc!r}", flush=True)
    else:
        print(f"flushed owned={writer.owns(domain)} fenced={writer.fenced}", flush=True)
    await redis.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
