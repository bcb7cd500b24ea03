"""The requests looked up ahead across a rolling upgrade (`gateway.fleet.ahead`): a gateway of
the commit before (no registration; a plain `HSET` of its figures) and one of this code share
one Redis and a burst of requests. Every request is answered at both; the new one registers its
requests once it sees its peer, and its publishes leave nothing in the list."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

BEFORE_COMMIT = "fca0b33403c25751b96a1d5f5b0b9f9c45096af9"
"""main before the requests ahead were registered (their gateway half's first commit's parent)."""
REPO = Path(__file__).resolve().parents[2]
ORDER, COUNTER = "kvg:{kvg-load}:ahead", "kvg:{kvg-load}:ahead:n"


@pytest.fixture(scope="module")
def before_tree() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvgate-before-ahead-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", BEFORE_COMMIT],
            capture_output=True,
            check=False,
        )
        assert archive.returncode == 0, archive.stderr.decode().strip()
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        tree = Path(tmp)
        assert not (tree / "gateway" / "fleet" / "ahead.py").exists()  # really the old code
        yield tree


def _start(engines: list[Served], redis: RedisServer, tree: Path) -> processes.Proc:
    env = {
        "KVGATE_TENANTS": orjson.dumps([f"acme:{TENANT_KEY}"]).decode(),
        "KVGATE_SERVER_SECRET": "fleet",
        "KVGATE_REDIS_URL": redis.url,
        "KVGATE_REDIS_DEADLINE_S": "0.5",
        "KVGATE_DEBUG_HEADERS": "true",
        "PYTHONPATH": str(tree),
        "KVGATE_PLACE_AHEAD": "true",  # the commit before has no such setting: ignored there
    }
    proc = processes.start_gateway(
        processes.free_port(), [e.url for e in engines], env=env, cwd=str(tree)
    )
    processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
    return proc


def _ask(proc: processes.Proc, n: int) -> str:
    response = httpx.post(
        proc.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": words(f"ahead-upgrade/{n}", 300)}],
            "max_tokens": 4,
        },
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-kvgate-replica"]


def test_a_gateway_of_the_commit_before_beside_one_that_registers(
    before_tree: Path, fresh_redis: RedisServer, start_engines: Callable[..., list[Served]]
) -> None:
    engines = start_engines(3)
    procs: list[processes.Proc] = []
    try:
        procs += [_start(engines, fresh_redis, before_tree), _start(engines, fresh_redis, REPO)]
        wait_until(  # both on the load hash: each one's peer
            lambda: int(fresh_redis.cli("hlen", "kvg:{kvg-load}:gateways").strip()) == 2,
            timeout_s=10,
            what="both gateways' load entries",
        )
        asked = 0
        with ThreadPoolExecutor(8) as pool:
            for _ in range(20):  # bounded: bursts until the new one has registered some
                burst = [procs[i % 2] for i in range(asked, asked + 8)]
                assert all(pool.map(_ask, burst, range(asked, asked + 8)))
                asked += 8
                if int(fresh_redis.cli("get", COUNTER).strip() or 0) >= 4:
                    break
        assert int(fresh_redis.cli("get", COUNTER).strip() or 0) >= 4
        wait_until(  # every registered request published (or expired): nothing left
            lambda: int(fresh_redis.cli("zcard", ORDER).strip()) == 0,
            timeout_s=5,
            what="the list emptied by the new gateway's publishes",
        )
    finally:
        processes.stop(procs)
