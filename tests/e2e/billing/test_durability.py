"""Durability: `kill -9` of a gateway under load loses no completed response's record and
doubles none; a Redis outage costs no client an error and no record."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml  # type: ignore[import-untyped]

from cachemap.redis.client import open_redis
from gateway.billing.store import RedisLedgerStore
from gateway.billing.wal import read_directory
from loadgen.chaos.billed import billed_request
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
    return billed_request(url, TENANT_KEY, i).record_id


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
        try:
            wait_until(lambda: len(completed) >= KILL_AFTER_COMPLETED, 60, "completed responses")
            gateway.popen.kill()  # SIGKILL, mid-load
            gateway.popen.wait(timeout=10)
        finally:  # a failure above ends the clients too (else they ran until the suite's timeout)
            stop.set()
            gateway.popen.kill()
    assert attempts > len(completed)  # requests were in flight, or refused, when it died
    assert len(set(completed)) == len(completed)
    # every response a client received complete has its record in the WAL, once
    in_wal = Counter(r["id"] for r in read_directory(tmp_path / "wal"))
    assert all(in_wal[i] == 1 for i in completed)

    # a restarted gateway replays its WAL into the store: exactly once
    restarted = processes.start_gateway(port, [e.url for e in engines], args)
    try:
        processes.wait_ready(restarted.url, "/readyz", restarted.popen, processes.STARTUP_TIMEOUT_S)
        # the first run's records, and the aborted record the restart wrote (before it was
        # ready) for each stream the kill cut mid-body (item 23; none if none was mid-body)
        after = list(read_directory(tmp_path / "wal"))
        new = [r for r in after if r["id"] not in in_wal]
        assert all(r["status"] == "aborted" for r in new)
        expected = set(in_wal) | {r["id"] for r in new}
        wait_until(lambda: set(completed) <= set(store_ids(aof_redis.url)), 30, "replay")
        wait_until(lambda: expected <= set(store_ids(aof_redis.url)), 30, "the whole WAL")
        ids = store_ids(aof_redis.url)
        # the raw store: one hash entry and one index entry per id, replays notwithstanding
        assert aof_redis.cli("HLEN", "{kvgate-billing}:records").strip() == str(len(ids))
        assert aof_redis.cli("ZCARD", "{kvgate-billing}:t:acme").strip() == str(len(ids))
        assert set(ids) == expected  # each once
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


def test_streams_cut_by_a_gateway_crash_are_billed_as_aborted_after_its_restart(
    start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    """kill -9 of a gateway with streams mid-body (issue 14, item 23). Before: those streams had
    no record at all, neither completed nor aborted, so their tokens went unbilled. Now the first
    token writes what is known (an open entry); the next start over the same WAL directory turns
    each unsettled one into its aborted record: the prompt, no output, billed once."""
    engines = start_engines(1, timing=TimingModel(decode_s_per_token=0.05))  # 200 tokens: 10 s
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tenants": [f"acme:{TENANT_KEY}"],
                "server_secret": "durability",
                "billing_wal_dir": str(tmp_path / "wal"),
                "billing_model_map": {MODEL: "gpt-5.6"},
            }
        )
    )
    port = processes.free_port()
    args = ["--config", str(config), "--log-level", "warning"]
    gateway = processes.start_gateway(port, [e.url for e in engines], args)
    processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
    finished = one_request(gateway.url, 1)  # a whole, unstreamed answer first: its own record
    assert finished is not None
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    streams = []
    with contextlib.ExitStack() as stack:
        for i in range(3):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": words(f"cut-{i}", 300)}],
                "max_tokens": 200,
                "stream": True,
            }
            r = stack.enter_context(
                httpx.stream(
                    "POST",
                    gateway.url + "/v1/chat/completions",
                    json=body,
                    headers=headers,
                    timeout=30,
                )
            )
            lines = r.iter_lines()
            while not (line := next(lines)).startswith('data: {"id'):
                pass
            assert '"content":"' in line or '"role"' in line
            streams.append(lines)
        for lines in streams:  # every stream has had tokens after its first
            assert next(line for line in lines if line.startswith("data: {"))
        gateway.popen.kill()  # SIGKILL, three streams mid-body
        gateway.popen.wait(timeout=10)
    before = list(read_directory(tmp_path / "wal"))
    assert [r["id"] for r in before] == [finished]  # the cut streams: no record yet

    restarted = processes.start_gateway(port, [e.url for e in engines], args)
    try:
        processes.wait_ready(restarted.url, "/readyz", restarted.popen, processes.STARTUP_TIMEOUT_S)
        records = list(read_directory(tmp_path / "wal"))
    finally:
        processes.stop([restarted])
    aborted = [r for r in records if r["status"] == "aborted"]
    assert len(aborted) == 3 and len(records) == 4  # each cut stream once, nothing else new
    assert all(r["prompt_tokens"] > 250 and r["output_tokens"] == 0 for r in aborted)
    assert all(r["first_token"] is not None and float(r["cost"]) > 0 for r in aborted)


def test_a_gateway_whose_disk_fills_serves_nothing_unbilled_and_fails_clearly(
    start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    """The WAL's disk fills under a live gateway (issue 14, item 16): its file-size limit
    (RLIMIT_FSIZE, SIGXFSZ ignored, inherited by the gateway process) stops the segment's
    writes part way, as a full disk does. Every answer served has its record, once; every
    other request gets a clear 503 `billing_unavailable`, never a 500 or an unbilled 200."""
    import resource
    import signal
    import subprocess
    import sys

    engines = start_engines(1)
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tenants": [f"acme:{TENANT_KEY}"],
                "server_secret": "durability",
                "billing_wal_dir": str(tmp_path / "wal"),
                "billing_model_map": {MODEL: "gpt-5.6"},
            }
        )
    )
    port = processes.free_port()

    def full_disk() -> None:  # in the child, before exec: ignored signals stay ignored
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, resource.RLIM_INFINITY))

    popen = subprocess.Popen(
        [sys.executable, "-m", "kvgate_cli", "serve", "--port", str(port), "--engine",
         engines[0].url, "--config", str(config), "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=full_disk,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        processes.wait_ready(url, "/readyz", popen, processes.STARTUP_TIMEOUT_S)
        served, refused = [], []
        headers = {"authorization": f"Bearer {TENANT_KEY}"}
        for i in range(16):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": words(f"full-{i}", 200)}],
                "max_tokens": 4,
            }
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
            if r.status_code == 200:
                served.append(r.json()["usage"]["kvgate_billing"]["id"])
            else:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "billing_unavailable"
                refused.append(i)
    finally:
        popen.terminate()
        popen.wait(timeout=10)
    assert served and refused  # the disk filled part way through
    in_wal = Counter(r["id"] for r in read_directory(tmp_path / "wal"))
    assert all(in_wal[i] == 1 for i in served)  # each answer served is billed, once
    assert sum(in_wal.values()) == len(served)  # no record of a refused one (no torn line either)
