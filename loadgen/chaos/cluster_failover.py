"""A Redis Cluster master SIGKILLed mid-run; its replica is promoted (node timeout 2 s).

Three masters with one replica each; one gateway shares its directory there; conversations
take turns throughout. Just before the kill, the directory's keys on every master are listed;
after the promotion, each is looked up again. Goals: no request fails (counted by the client),
no directory entry present before the kill is missing after the promotion (replication is
asynchronous: an entry written in the last moments before the kill may be lost by design, so
the snapshot is what was there, not what was in flight). Figures: the failover's duration, the
hit ratio before and after, whether the gateway routes on Redis again.
"""

from __future__ import annotations

import asyncio
import threading
import time

import redis

from loadgen.bench.redis_reset import (
    KEY,
    Turn,
    hit_ratio,
    open_conversations,
    play_round,
    wait_back,
)
from loadgen.chaos.outcome import Outcome, Size, ratio, wait_for
from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisCluster, RedisServer, redis_cluster

META = b"kvg:{kvg-meta}"
FAILOVER_TIMEOUT_S = 30.0
MAX_ROUNDS = 30


def _placement(field: bytes | str) -> bool:
    return (field.encode() if isinstance(field, str) else field).endswith(b"+")


def directory_keys(nodes: list[RedisServer], entries_only: bool = False) -> set[bytes]:
    """The directory's keys on `nodes`; `entries_only`: those holding at least one entry (a key
    holding only placements in flight, "<rid>+" fields, lives 10 s unless its request's first
    token records it, so one whose request ended in the failover expires by design)."""
    keys: set[bytes] = set()
    for node in nodes:
        client = redis.Redis(host=node.host, port=node.port)
        try:
            for k in client.scan_iter(match="kvg:*", count=1000):
                if k.startswith(META):
                    continue
                placements_only = (
                    entries_only
                    and client.type(k) == b"hash"
                    and all(_placement(f) for f in client.hkeys(k))
                )
                if placements_only:
                    continue
                keys.add(k)
        finally:
            client.close()
    return keys


def missing(cluster: RedisCluster, keys: set[bytes]) -> int:
    masters = cluster.masters()
    return len(keys - directory_keys(masters))


def run(size: Size) -> Outcome:
    conversations = open_conversations(size.pick(6, 20), 400, "failover")
    engine_args = ["--time-scale", "10", "--max-batch", "256"]
    env = {"KVGATE_REDIS_DEADLINE_S": "0.05", "KVGATE_DEBUG_HEADERS": "true"}
    turns: list[Turn] = []
    with redis_cluster(3, replicas=1) as cluster, processes.engines(3, engine_args) as engines:
        gateway = processes.start_gateway(
            processes.free_port(), [e.url for e in engines],
            ["--tenant", f"bench:{KEY}", "--log-level", "error", "--redis-url", cluster.url],
            env=env,
        )  # fmt: skip
        try:
            processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
            for n in range(size.pick(2, 3)):
                turns += asyncio.run(play_round(gateway.url, conversations, "before", n, 4))
            stop, during = threading.Event(), []

            def load() -> None:
                for n in range(10, 10 + MAX_ROUNDS):
                    if stop.is_set():
                        return
                    during.extend(
                        asyncio.run(play_round(gateway.url, conversations, "during", n, 4))
                    )

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            victim = next(m for m in cluster.masters() if m is not cluster.nodes[0])
            before = directory_keys(cluster.masters(), entries_only=True)
            victim.stop()  # SIGKILL, mid-run
            killed = time.monotonic()
            wait_for(lambda: len(cluster.masters()) == 3 and cluster.healthy(),
                     FAILOVER_TIMEOUT_S, "the replica promoted")  # fmt: skip
            failover_s = time.monotonic() - killed
            stop.set()
            loader.join(timeout=120)
            lost = missing(cluster, before)
            try:
                wait_back(gateway.metrics_url or gateway.url)
                back = f"yes, {time.monotonic() - killed:.1f} s after the kill"
            except TimeoutError:
                back = "NO"
            after = asyncio.run(play_round(gateway.url, conversations, "after", 99, 4))
        finally:
            processes.stop([gateway])
    every = [*turns, *during, *after]
    out = Outcome("cluster-failover")
    failed = sum(1 for t in every if not t.ok)
    out.goal("failed requests", failed == 0, f"{failed} of {len(every)}")
    out.goal("directory entries lost", lost == 0, f"{lost} of {len(before)} present at the kill")
    out.figures["failover (kill to promoted, cluster ok) s"] = f"{failover_s:.1f}"
    out.figures["hit ratio before / during / after"] = " / ".join(
        ratio(hit_ratio(ts)) for ts in (turns[len(conversations) :], during, after)
    )
    out.figures["gateway back on Redis"] = back
    return out
