"""Item 26: a rolling upgrade — and a rollback — loses nothing. Gateways of the commit before
layouts were versioned (layout 1, run as subprocesses from a `git archive` of that commit under
/tmp) and of this code (layout 2) share one Redis directory and one billing store side by side,
and each takes over the other's WAL directory, as a pod replaced on its volume does."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from cachemap.redis.client import open_redis
from gateway.billing.store import RedisLedgerStore
from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served, wait_until
from tests.trees import REPO, unpacked

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

LAYOUT_1_COMMIT = "05df12f987d70e568f516184d8b983536be43e01"
"""main before this round: the directory, the WAL and the store without layout versions."""


@pytest.fixture(scope="module")
def layout_1_tree() -> Iterator[Path]:
    """The layout-1 code, unpacked once under /tmp (a checkout's history must hold it)."""
    with unpacked(LAYOUT_1_COMMIT) as tree:
        assert not (tree / "cachemap" / "redis" / "meta.py").exists()  # really the old code
        yield tree


class Fleet:
    """Gateway processes of either layout over one Redis, one store and given WAL dirs."""

    def __init__(self, engines: list[Served], redis: RedisServer, old_tree: Path) -> None:
        self.engines = engines
        self.redis = redis
        self.old_tree = old_tree
        self.procs: list[processes.Proc] = []
        self.answered = 0

    def start(self, layout: int, wal: Path) -> processes.Proc:
        env = {
            "KVGATE_TENANTS": orjson.dumps([f"acme:{TENANT_KEY}"]).decode(),
            "KVGATE_SERVER_SECRET": "fleet",
            "KVGATE_REDIS_URL": self.redis.url,
            "KVGATE_REDIS_DEADLINE_S": "0.5",
            "KVGATE_BILLING_WAL_DIR": str(wal),
            "KVGATE_BILLING_REDIS_URL": self.redis.url,
            # the session's Redis runs without an AOF: durability is not what this test is about
            "KVGATE_BILLING_REDIS_ALLOW_UNSAFE_FSYNC": "true",
            "KVGATE_DEBUG_HEADERS": "true",
            "KVGATE_HEALTH_INTERVAL_S": "0.2",
            "PYTHONPATH": str(self.old_tree) if layout == 1 else str(REPO),
        }
        cwd = str(self.old_tree) if layout == 1 else str(REPO)
        proc = processes.start_gateway(
            processes.free_port(), [e.url for e in self.engines], env=env, cwd=cwd
        )
        processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
        self.procs.append(proc)
        return proc

    def stop(self, proc: processes.Proc) -> None:
        processes.stop([proc])  # SIGTERM: the lifespan ships what it can
        self.procs.remove(proc)

    def ask(self, proc: processes.Proc, messages: list[dict[str, Any]]) -> tuple[str, int, str]:
        response = httpx.post(
            proc.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 8},
            headers={"authorization": f"Bearer {TENANT_KEY}"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        self.answered += 1
        reply = response.json()
        return (
            response.headers["x-kvgate-replica"],
            int(response.headers["x-kvgate-matched-blocks"]),
            reply["choices"][0]["message"]["content"],
        )


def test_old_and_new_gateways_side_by_side_lose_nothing(
    layout_1_tree: Path,
    fresh_redis: RedisServer,
    start_engines: Callable[..., list[Served]],
    tmp_path: Path,
) -> None:
    engines = start_engines(3)
    fleet = Fleet(engines, fresh_redis, layout_1_tree)
    wal_old, wal_new = tmp_path / "wal-a", tmp_path / "wal-b"
    try:
        old, new = fleet.start(1, wal_old), fleet.start(2, wal_new)
        assert len(set(_alternating(fleet, fresh_redis, old, new))) == 1
        # the old gateway's pod is replaced: the new code takes over its WAL directory ...
        fleet.stop(old)
        upgraded = fleet.start(2, wal_old)
        fleet.ask(upgraded, [{"role": "user", "content": "after the upgrade"}])
        # ... and the new gateway is rolled back: the old code takes over a layout-2 WAL
        fleet.stop(new)
        rolled_back = fleet.start(1, wal_new)
        fleet.ask(rolled_back, [{"role": "user", "content": "after the rollback"}])
        fleet.stop(upgraded)
        fleet.stop(rolled_back)
        # every answered request is in the store exactly once, whichever layout wrote it
        records = asyncio.run(_records(fresh_redis.url))
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)) == fleet.answered
        assert fresh_redis.cli("hget", "kvg:{kvg-meta}:layout", "version").strip() == "2"
        assert fresh_redis.cli("hget", "{kvgate-billing}:layout", "version").strip() == "2"
    finally:
        processes.stop(fleet.procs)


def _alternating(
    fleet: Fleet, redis: RedisServer, old: processes.Proc, new: processes.Proc
) -> list[str]:
    """One conversation, its turns alternating between the two gateways: the replica of each
    turn (one placement: every turn after the first matches the turns before)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words(f"upgrade/{uuid.uuid4().hex}", 500)},
        {"role": "user", "content": words("upgrade/task", 100)},
    ]
    places = []
    for turn in range(6):
        gateway = (old, new)[turn % 2]
        before = _entries(redis)
        replica, matched, content = fleet.ask(gateway, messages)
        places.append(replica)
        assert turn == 0 or matched > 0, f"turn {turn} at {('old', 'new')[turn % 2]}: no match"
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": words(f"upgrade/turn{turn}", 60)},
        ]
        wait_until(  # the turn's record reached Redis before the other gateway looks
            lambda before=before: _entries(redis) > before,
            timeout_s=10,
            what="the turn's entries in Redis",
        )
    return places


BEFORE_DISTINCT_COMMIT = "fca0b33403c25751b96a1d5f5b0b9f9c45096af9"
"""main before the directory's distinct generations: two generations of 3/4 of the capacity,
no `live` hash (still layout 2)."""


@pytest.fixture(scope="module")
def before_distinct_tree() -> Iterator[Path]:
    with unpacked(BEFORE_DISTINCT_COMMIT) as tree:
        assert "LIVE_KEY" not in (tree / "cachemap" / "redis" / "schema.py").read_text()
        yield tree


def test_a_gateway_of_the_commit_before_distinct_generations_shares_a_conversation(
    before_distinct_tree: Path,
    fresh_redis: RedisServer,
    start_engines: Callable[..., list[Served]],
    tmp_path: Path,
) -> None:
    """A rolling upgrade to the distinct generations: a gateway of the commit before (two
    generations, its own count) and one of this code route one conversation's turns to one
    replica, each matching what the other recorded; the new gateway kept its live counts."""
    fleet = Fleet(start_engines(3), fresh_redis, before_distinct_tree)
    try:
        old, new = fleet.start(1, tmp_path / "wal-a"), fleet.start(2, tmp_path / "wal-b")
        assert len(set(_alternating(fleet, fresh_redis, old, new))) == 1
        assert int(fresh_redis.cli("hlen", "kvg:{kvg-meta}:live").strip()) >= 1
    finally:
        processes.stop(fleet.procs)


def _entries(redis: RedisServer) -> int:
    """Directory block keys in Redis (each turn of the conversation adds its new blocks)."""
    script = "return #redis.call('KEYS', 'kvg:{*')"
    return int(redis.cli("eval", script, "0").strip())


async def _records(url: str) -> list[dict[str, Any]]:
    client = await open_redis(url, cluster=False)
    try:
        return await RedisLedgerStore(client).query(None, None, None)
    finally:
        await client.aclose()
