"""The pod's admin port under `--workers 2` (real processes, a real redis-server, real engines):
`POST /reset_prefix_cache` reaches every worker with its key (issue 45 item 14: it answered
405, the reset state being each worker's), and `admin_port_auth` guards the pod's own routes
as a lone gateway's (item 13)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.conftest import TENANT_KEY
from tests.e2e.test_workers import CHAT, HEADERS
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

ADMIN_KEY = "sk-admin-pod"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
WORKERS = 2


@contextlib.contextmanager
def guarded_pod(redis_url: str, urls: list[str], tmp_path: Path) -> Iterator[processes.Proc]:
    """Two workers whose admin port takes `ADMIN_KEY` on every route."""
    args = ["--workers", str(WORKERS), "--redis-url", redis_url, "--debug-headers"]
    args += ["--tenant", f"acme:{TENANT_KEY}", "--log-level", "warning"]
    env = {
        "KVGATE_ADMIN_KEYS": orjson.dumps([ADMIN_KEY]).decode(),
        "KVGATE_ADMIN_PORT_AUTH": "true",
        "KVGATE_BILLING_WAL_DIR": str(tmp_path / "wal"),
    }
    gateway = processes.start_gateway(processes.free_port(), urls, args, env=env)
    try:
        processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
        wait_until(lambda: workers_answer(gateway), 30, "both workers' admin pages")
        yield gateway
    finally:
        processes.stop([gateway])


def worker_ports(gateway: processes.Proc) -> list[int]:
    assert gateway.metrics_url is not None
    try:
        pod = httpx.get(gateway.metrics_url + "/pod", headers=ADMIN, timeout=5)
    except httpx.HTTPError:
        return []
    return [w["admin_port"] for w in pod.json()["workers"]] if pod.status_code == 200 else []


def workers_answer(gateway: processes.Proc) -> bool:
    """Every worker listed and serving its own admin page (the pod's /metrics needs them all)."""
    ports = worker_ports(gateway)
    try:
        pages = [
            httpx.get(f"http://127.0.0.1:{p}/metrics", headers=ADMIN, timeout=5) for p in ports
        ]
    except httpx.HTTPError:
        return False
    return len(ports) == WORKERS and all(page.status_code == 200 for page in pages)


def resets_of(page: str) -> float:
    for family in text_string_to_metric_families(page):
        if family.name == "kvgate_prefix_cache_resets":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no kvgate_prefix_cache_resets on the page")


def turn(gateway: processes.Proc, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "kvgate-sim-8b", "messages": messages, "max_tokens": 4}
    r = httpx.post(gateway.url + CHAT, json=body, headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_a_reset_reaches_every_worker_with_its_key_and_every_worker_forgets(
    fresh_redis: RedisServer, start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    engines = start_engines(3)
    with guarded_pod(fresh_redis.url, [e.url for e in engines], tmp_path) as pod:
        assert pod.metrics_url is not None
        admin = pod.metrics_url
        # the pod's own routes take the key too (item 13)
        for path in ("/metrics", "/pod", "/openapi.json", "/docs"):
            assert httpx.get(admin + path, timeout=5).status_code == 401, path
            assert httpx.get(admin + path, headers=ADMIN, timeout=5).status_code == 200, path
        ports = worker_ports(pod)
        for port in ports:  # and each worker's own port, which the pod asks with the key
            assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 401
        # a conversation whose prefix the directory holds
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent." + words("pod/sys", 600)},
            {"role": "user", "content": words("pod/task", 50)},
        ]
        turn(pod, messages)
        messages.append({"role": "user", "content": "and then?"})
        assert int(turn(pod, messages).headers["x-kvgate-matched-blocks"]) > 0
        # the reset: no key, a tenant's key, then the admin key
        url = admin + "/reset_prefix_cache"
        assert httpx.post(url, timeout=30).status_code == 401
        tenant = {"authorization": f"Bearer {TENANT_KEY}"}
        assert httpx.post(url, headers=tenant, timeout=30).status_code == 401
        r = httpx.post(url, headers=ADMIN, timeout=30)
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json() == {e.url: 200 for e in engines}
        # every worker reset (each keeps its own wipe state and event index) ...
        pages = [
            httpx.get(f"http://127.0.0.1:{p}/metrics", headers=ADMIN, timeout=5).text for p in ports
        ]
        assert [resets_of(page) for page in pages] == [len(engines)] * WORKERS
        # ... and the next turn matches nothing the engines held before
        messages.append({"role": "user", "content": "after the reset"})
        assert int(turn(pod, messages).headers["x-kvgate-matched-blocks"]) == 0
        # one replica: forwarded with the query, to every worker
        r = httpx.post(url, params={"replica": engines[0].url}, headers=ADMIN, timeout=30)
        assert r.status_code == 200 and r.json() == {engines[0].url: 200}
        pages = [
            httpx.get(f"http://127.0.0.1:{p}/metrics", headers=ADMIN, timeout=5).text for p in ports
        ]
        assert [resets_of(page) for page in pages] == [len(engines) + 1] * WORKERS
        r = httpx.post(url, params={"replica": "http://nowhere"}, headers=ADMIN, timeout=30)
        assert r.status_code == 404
