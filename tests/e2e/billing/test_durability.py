"""Durability: `kill -9` of a gateway under load loses no completed response's record and
doubles none; a Redis outage costs no client an error and no record."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import yaml  # type: ignore[import-untyped]

from cachemap.redis.client import open_redis
from gateway.billing.store import RedisLedgerStore
from gateway.billing.wal import read_directory
from loadgen.engine.timing import TimingModel
from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisServer, redis_server
from loadgen.text import words
from tests.billing.test_wal import AOF
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

NUM_CLIENTS = 8
KILL_AFTER_COMPLETED = 40
"""Enough completed responses before the kill that the WAL has several group commits."""


@pytest.fixture
def aof_redis() -> Iterator[RedisServer]:
    with redis_server(port=0, extra=AOF) as server:
        yield server


def store_ids(url: str, tenant: str = "acme") -> list[str]:
    async def query() -> list[str]:
        client = await open_redis(url, cluster=False)
        try:
            return [r["id"] for r in await RedisLedgerStore(client).query(tenant, None, None)]
        finally:
            await client.aclose()

    return asyncio.run(query())


def one_request(url: str, i: int) -> str | None:
    """The record id of a response received complete, else None."""
    stream = i % 2 == 0
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": words("durable", 1500)},
            {"role": "user", "content": f"request {i}"},
        ],
        "max_tokens": 16,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    try:
        if not stream:
            response = httpx.post(
                url + "/v1/chat/completions", json=body, headers=headers, timeout=10
            )
            if response.status_code != 200:
                return None
            return str(response.json()["usage"]["kvgate_billing"]["id"])
        record_id, done = None, False
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=10
        ) as r:
            if r.status_code != 200:
                return None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if chunk.get("usage"):
                        record_id = chunk["usage"]["kvgate_billing"]["id"]
        return record_id if done else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def test_kill_9_under_load_keeps_exactly_one_record_per_completed_response(
    start_engines: Callable[..., list[Served]], aof_redis: RedisServer, tmp_path: Path
) -> None:
    engines = start_engines(2, timing=TimingModel(time_scale=20.0))
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tenants": [f"acme:{TENANT_KEY}"],
                "server_secret": "durability",
                "billing_wal_dir": str(tmp_path / "wal"),
                "billing_redis_url": aof_redis.url,
                "billing_model_map": {MODEL: "gpt-5.6"},
            }
        )
    )
    port = processes.free_port()
    args = ["--config", str(config), "--log-level", "warning"]
    gateway = processes.start_gateway(port, [e.url for e in engines], args)
    processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
    completed: list[str] = []
    attempts = 0
    lock = threading.Lock()
    stop = threading.Event()

    def client(worker: int) -> None:
        nonlocal attempts
        i = worker
        while not stop.is_set():
            record_id = one_request(gateway.url, i)
            with lock:
                attempts += 1
                if record_id is not None:
                    completed.append(record_id)
            i += NUM_CLIENTS

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        for worker in range(NUM_CLIENTS):
            pool.submit(client, worker)
        wait_until(lambda: len(completed) >= KILL_AFTER_COMPLETED, 60, "completed responses")
        gateway.popen.kill()  # SIGKILL, mid-load
        gateway.popen.wait(timeout=10)
        stop.set()
    assert attempts > len(completed)  # requests were in flight, or refused, when it died
    assert len(set(completed)) == len(completed)
    # every response a client received complete has its record in the WAL, once
    in_wal = Counter(r["id"] for r in read_directory(tmp_path / "wal"))
    assert all(in_wal[i] == 1 for i in completed)

    # a restarted gateway replays its WAL into the store: exactly once
    restarted = processes.start_gateway(port, [e.url for e in engines], args)
    try:
        processes.wait_ready(restarted.url, "/readyz", restarted.popen, processes.STARTUP_TIMEOUT_S)
        wait_until(lambda: set(completed) <= set(store_ids(aof_redis.url)), 30, "replay")
        wait_until(lambda: set(in_wal) <= set(store_ids(aof_redis.url)), 30, "the whole WAL")
        ids = store_ids(aof_redis.url)
        # the raw store: one hash entry and one index entry per id, replays notwithstanding
        assert aof_redis.cli("HLEN", "{kvgate-billing}:records").strip() == str(len(ids))
        assert aof_redis.cli("ZCARD", "{kvgate-billing}:t:acme").strip() == str(len(ids))
        assert set(ids) == set(in_wal)  # the first run's records, each once
    finally:
        processes.stop([restarted])


def test_a_redis_outage_costs_no_client_an_error_and_no_record(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    aof_redis: RedisServer,
    tmp_path: Path,
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(
        engines,
        billing_wal_dir=tmp_path / "wal",
        billing_redis_url=aof_redis.url,
        billing_model_map={MODEL: "gpt-5.6"},
    )
    shipper = gateway.app.state.billing.shipper
    ids = [one_request(gateway.url, i) for i in range(6)]
    wait_until(lambda: set(ids) <= set(store_ids(aof_redis.url)), 10, "shipping")
    aof_redis.stop()
    during = [one_request(gateway.url, i) for i in range(6, 16)]
    assert all(during)  # every client got its whole response
    wait_until(lambda: shipper.failures > 0, 10, "a failed shipment")
    aof_redis.start()
    shipper.wake()
    wait_until(lambda: set(during) <= set(store_ids(aof_redis.url)), 30, "catching up")
    stored = store_ids(aof_redis.url)
    assert sorted(stored) == sorted(ids + during)  # each exactly once
