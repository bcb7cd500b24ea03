"""What a shared speculative entry costs (docs/benchmarks-archive.md, "Precise mode's edges,
round 3").

    PYTHONPATH=. python -m tools.shared_speculative_cost [ROUNDS] [--base DIR]

One real redis-server on a unix socket. Per round, alternating arms in one process:

- `speculate`: 2,000 placements, each `EventReader.speculate` of a 32-block tail of a 64-block
  chain (a request whose first half the index already holds), awaited in batches of 50; the
  gateway's CPU (this process: the task, the script call's encoding and reply) and the
  redis-server's CPU per placement;
- `lookup`: 1,000 lookups of a 64-block chain whose 64 blocks the index holds (`:e`), with no
  speculative entry and with one on the last 32 blocks: the median wall time (one round trip:
  epochs + LOOKUP) and the redis-server's CPU per lookup;
- with `--base DIR` (a tree of main, `git archive main | tar -x -C DIR`): the same lookups
  with DIR's LOOKUP script (no `:s` read), for the before/after ratio.

Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from cachemap.events import precise_keys
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.event_scripts import DOMAINS_KEY
from cachemap.redis.events import EventReader
from cachemap.redis.schema import block_keys, chain_call, replica_id
from loadgen.harness.processes import cpu_seconds
from loadgen.harness.redis_servers import RedisServer

PLACEMENTS = 2000
LOOKUPS = 1000
BLOCKS = 64


def base_lookup(base: Path) -> str:
    spec = importlib.util.spec_from_file_location(
        "base_event_scripts", base / "cachemap/redis/event_scripts.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.LOOKUP
    return text


async def seed(client: AnyRedis, domain: str, keys: list[Any]) -> None:
    """The domain's events flow (epoch 0) and it holds every block of `keys` on the GPU (the
    fields an `EventWriter` writes: "<epoch>:<mask>")."""
    rid = replica_id(domain)
    await client.hset(DOMAINS_KEY, rid, f"0|{domain}")
    pipe = client.pipeline(False)
    for key in block_keys(keys):
        pipe.hset(key + b":e", rid, "0:1")
    await pipe.execute()


async def speculate_arm(
    reader: EventReader, domain: str, server: RedisServer
) -> tuple[float, float]:
    pid = server.proc.pid if server.proc is not None else 0
    chains = [precise_keys(list(range(i * 7, i * 7 + 16 * BLOCKS)), "s", 16) for i in range(50)]
    cpu, redis_cpu = time.process_time(), cpu_seconds(pid)
    for _ in range(0, PLACEMENTS, 50):
        for keys in chains:
            reader.speculate(domain, keys[BLOCKS // 2 :], 2.0)
        await reader.close()
    return (
        (time.process_time() - cpu) / PLACEMENTS * 1e6,
        (cpu_seconds(pid) - redis_cpu) / PLACEMENTS * 1e6,
    )


async def lookup_arm(
    client: AnyRedis, sha: bytes | str, keys: list[Any], arg: bytes, server: RedisServer
) -> tuple[float, float]:
    pid = server.proc.pid if server.proc is not None else 0
    slot, head = chain_call(keys)
    redis_cpu = cpu_seconds(pid)
    times = []
    for _ in range(LOOKUPS):
        started = time.perf_counter()
        pipe = client.pipeline(False)
        pipe.hgetall(DOMAINS_KEY)
        pipe.execute_command("EVALSHA", sha, 1, slot[0], *head, arg)
        await pipe.execute()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6, (cpu_seconds(pid) - redis_cpu) / LOOKUPS * 1e6


async def run(rounds: int, base: Path | None) -> None:
    from cachemap.redis.event_scripts import LOOKUP

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            client = await open_redis(server.url, cluster=False)
            domain = f"http://bench-{uuid.uuid4().hex[:6]}:8000"
            held = precise_keys(list(range(100_000, 100_000 + 16 * BLOCKS)), "s", 16)
            spec_chain = precise_keys(list(range(200_000, 200_000 + 16 * BLOCKS)), "s", 16)
            await seed(client, domain, held)
            reader = EventReader(client)
            await reader.refresh()
            # a chain whose first half is held and second half speculated (ttl long enough)
            await seed(client, domain, spec_chain[: BLOCKS // 2])
            reader.speculate(domain, spec_chain[BLOCKS // 2 :], 3600.0)
            await reader.close()
            arg = f"{replica_id(domain)},0;".encode()
            new_sha = await client.script_load(LOOKUP)
            old_sha = await client.script_load(base_lookup(base)) if base else None
            rows: dict[str, list[tuple[float, float]]] = {}
            for _ in range(rounds):
                rows.setdefault("speculate", []).append(await speculate_arm(reader, domain, server))
                if old_sha is not None:
                    rows.setdefault("lookup, base LOOKUP", []).append(
                        await lookup_arm(client, old_sha, held, arg, server)
                    )
                rows.setdefault("lookup, new LOOKUP, no :s", []).append(
                    await lookup_arm(client, new_sha, held, arg, server)
                )
                rows.setdefault("lookup, new LOOKUP, 32 of 64 speculative", []).append(
                    await lookup_arm(client, new_sha, spec_chain, arg, server)
                )
            await client.aclose()
        finally:
            server.stop()
    print(f"{rounds} rounds, medians over rounds (64-block chains, one redis-server, unix socket)")
    for name, values in rows.items():
        a = statistics.median(v[0] for v in values)
        b = statistics.median(v[1] for v in values)
        what = "gateway CPU us/placement" if name == "speculate" else "wall us median"
        print(f"{name:45s} {what}: {a:8.1f}   redis-server CPU us each: {b:6.1f}")


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv and argv[0].isdigit() else 5
    base = Path(argv[argv.index("--base") + 1]) if "--base" in argv else None
    asyncio.run(run(rounds, base))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
