"""A scale-down while the ledger store is away (issue 45, item 3): gateway A bills into its WAL
while the store cannot be reached, then A is gone (scaled down: its pod, and its name, never come
back). Before, nothing ever opened A's directory again, so its records never reached the store.
Now the survivor B, whose directory is beside A's on the shared volume, takes A's over (its lock
free, its lease expired) once the store answers, and ships it: every record billed once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachemap.redis.client import open_redis
from gateway.billing.store import RedisLedgerStore
from gateway.billing.takeover import wal_directories
from gateway.billing.wal import WalLocked, WriteAheadLog, read_directory, segment_paths
from gateway.server.app import create_app
from loadgen.chaos.billed import billed_request
from loadgen.harness.redis_servers import RedisServer, redis_server
from tests.billing.test_wal import AOF
from tests.conftest import MODEL, TENANT_KEY, gateway_settings
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

LEASE_S = 0.3
"""Short, so the test waits on a lease that expires quickly (the default is 30 s)."""


@pytest.fixture
def aof_redis() -> Iterator[RedisServer]:
    with redis_server(port=0, extra=AOF) as server:
        yield server


def store_records(url: str) -> list[dict[str, Any]]:
    async def query() -> list[dict[str, Any]]:
        client = await open_redis(url, cluster=False)
        try:
            return await RedisLedgerStore(client).query("acme", None, None)
        finally:
            await client.aclose()

    return asyncio.run(query())


def test_a_survivor_ships_the_wal_of_a_gateway_scaled_down_while_the_store_was_away(
    start_engines: Callable[..., list[Served]], aof_redis: RedisServer, tmp_path: Path
) -> None:
    engines = start_engines(1)
    root = tmp_path / "billing"  # the shared claim: one directory per pod

    def gateway(name: str) -> Served:
        settings = gateway_settings(
            [e.url for e in engines],
            billing_wal_dir=root / name,
            billing_redis_url=aof_redis.url,
            billing_model_map={MODEL: "gpt-5.6"},
            billing_wal_takeover=True,
            billing_wal_lease_s=LEASE_S,
        )
        return start_app(create_app(settings))

    a, b = gateway("kvgate-a"), gateway("kvgate-b")
    try:
        shipped = [billed_request(a.url, TENANT_KEY, i).record_id for i in range(3)]
        wait_until(
            lambda: {r["id"] for r in store_records(aof_redis.url)} >= set(shipped), 10, "shipping"
        )
        aof_redis.stop()  # the store is away
        during = [billed_request(a.url, TENANT_KEY, i).record_id for i in range(3, 11)]
        assert all(during)  # every client got its whole answer, billed in A's WAL
        a.stop()  # scaled down: A is gone, its directory stays on the claim
        held = {r["id"] for r in read_directory(root / "kvgate-a")}
        assert held >= set(during)  # unshipped, and nobody reopens it under A's name
        assert wal_directories(root, root / "kvgate-b") == [root / "kvgate-a"]

        aof_redis.start()  # from its append-only file
        wait_until(
            lambda: {r["id"] for r in store_records(aof_redis.url)} >= set(during),
            30,
            "the survivor shipping the gone gateway's directory",
        )
        records = store_records(aof_redis.url)
        assert sorted(r["id"] for r in records) == sorted(shipped + during)  # each once
        assert {r["status"] for r in records} == {"ok"}  # billed as they were served, none aborted
        takeover = b.app.state.billing.takeover
        # the survivor's loop counts the takeover just after it retires the directory, on its
        # own thread: wait for both rather than read the count the moment the files go
        wait_until(
            lambda: takeover.num_taken_over and not segment_paths(root / "kvgate-a"),
            10,
            "the directory retired",
        )
        assert takeover.num_taken_over == 1 and takeover.num_shipped >= len(during)
        assert segment_paths(root / "kvgate-b")  # the survivor's own log is its own
    finally:
        stop_all([a, b])


def test_a_directory_with_a_live_owner_is_never_taken_over(tmp_path: Path) -> None:
    """Its lock held: refused. Its lock free but its lease fresh (a filesystem whose locks are
    local to one node, or an owner restarting): refused too. Both gone: taken over."""
    owner = WriteAheadLog(tmp_path / "kvgate-a")
    owner.open()
    with pytest.raises(WalLocked, match="in use by another gateway"):
        WriteAheadLog(tmp_path / "kvgate-a").open(take_over_after_s=0.0)
    owner.close()  # the lock is free, the lease just renewed
    with pytest.raises(WalLocked, match="fresh lease"):
        WriteAheadLog(tmp_path / "kvgate-a").open(take_over_after_s=3600.0)
    taker = WriteAheadLog(tmp_path / "kvgate-a")
    taker.open(take_over_after_s=0.0)
    taker.close()


def test_the_siblings_are_every_gateways_and_every_workers_directory_but_ours(
    tmp_path: Path,
) -> None:
    """`<root>/<pod>` or, under `--workers`, `<root>/<pod>/worker-<i>`: ours is never a sibling
    (our own workers reopen their own directories), nor is anything without a LOCK."""
    for wal_dir in ("kvgate-a", "kvgate-b/worker-0", "kvgate-b/worker-1", "ours/worker-1"):
        (tmp_path / wal_dir).mkdir(parents=True)
        (tmp_path / wal_dir / "LOCK").touch()
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "notes.txt").touch()
    assert wal_directories(tmp_path, tmp_path / "ours") == [
        tmp_path / "kvgate-a",
        tmp_path / "kvgate-b" / "worker-0",
        tmp_path / "kvgate-b" / "worker-1",
    ]
    assert wal_directories(tmp_path / "absent", tmp_path / "ours") == []
