"""Precise mode across real processes: `kvgate engine` publishing KV events, `kvgate serve
--tokenizer-dir` ingesting them; an engine's own traffic moves the gateway's routing, and its
wipe stops routing on the wiped entries."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.tenancy.registry import TenantRegistry
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness.processes import (
    STARTUP_TIMEOUT_S,
    Proc,
    free_port,
    gateway,
    start_engine,
    stop,
    wait_ready,
)
from loadgen.text import words
from tests.conftest import MODEL
from tests.loadgen.test_kv_events import free_ports
from tests.servers import wait_until

pytestmark = pytest.mark.e2e
KEY, SECRET = "sk-proc", "proc-secret"


def sample(metrics_url: str, name: str, **labels: str) -> float:
    """The gateway's sample of `name` with `labels` (0 before it exists)."""
    text = httpx.get(metrics_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def fleet() -> Iterator[tuple[list[Proc], Proc, list[int]]]:
    base = free_ports(2)
    args_of = [
        [
            "--kv-events-config",
            orjson.dumps(
                {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base + i}"}
            ).decode(),
            "--time-scale",
            "1000",
        ]
        for i in range(2)
    ]
    procs = [start_engine(free_port(), a) for a in args_of]
    try:
        for p in procs:
            wait_ready(p.url, "/health", p.popen, STARTUP_TIMEOUT_S)
        endpoints = {p.url: f"tcp://127.0.0.1:{base + i}" for i, p in enumerate(procs)}
        env = {
            "KVGATE_TENANTS": orjson.dumps([f"acme:{KEY}"]).decode(),
            "KVGATE_SERVER_SECRET": SECRET,
            "KVGATE_DEBUG_HEADERS": "true",
            "KVGATE_KV_EVENTS_ENDPOINTS": orjson.dumps(endpoints).decode(),
            "KVGATE_OVERFLOW": "false",
            "KVGATE_FANOUT_HOLD": "false",
        }
        with gateway([p.url for p in procs], ["--tokenizer-dir", str(MODEL_DIR)], env=env) as g:
            yield procs, g, [base, base + 1]
    finally:
        stop(procs)


def test_engine_events_route_and_a_wipe_stops_it(fleet: tuple[list[Proc], Proc, list[int]]) -> None:
    (x, y), g, _ = fleet
    assert g.metrics_url is not None
    metrics = g.metrics_url
    for engine in (x, y):  # join: reset each engine until the gateway saw it

        def joined(url: str = engine.url) -> bool:
            httpx.post(url + "/reset_prefix_cache")
            return sample(metrics, "kvgate_events_total", domain=url, kind="wipes") > 0

        wait_until(joined, what="the gateway's feeds to join")
    salt = TenantRegistry.from_pairs(SECRET.encode(), [f"acme:{KEY}"]).authenticate(KEY).cache_salt
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": words("proc-precise", 200)}],
    }
    r = httpx.post(y.url + "/v1/chat/completions", json={**body, "cache_salt": salt})
    assert r.status_code == 200
    wait_until(
        lambda: sample(metrics, "kvgate_events_indexed_blocks", domain=y.url, tier="gpu") > 0,
        what="Y's blocks indexed",
    )
    headers = {"Authorization": f"Bearer {KEY}"}
    routed = httpx.post(g.url + "/v1/chat/completions", json=body, headers=headers)
    assert routed.status_code == 200 and routed.headers["x-kvgate-replica"] == y.url
    assert routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
    wipes = sample(metrics, "kvgate_events_total", domain=y.url, kind="wipes")
    assert httpx.post(y.url + "/reset_prefix_cache").status_code == 200
    wait_until(
        lambda: sample(metrics, "kvgate_events_total", domain=y.url, kind="wipes") > wipes,
        what="the wipe seen",
    )
    again = httpx.post(g.url + "/v1/chat/completions", json=body, headers=headers)
    assert again.status_code == 200 and again.headers["x-kvgate-matched-blocks"] == "0"
    assert sample(metrics, "kvgate_precise_tokenizer_checks_total", result="mismatch") == 0
    assert sample(metrics, "kvgate_precise_tokenizer_checks_total", result="match") == 1
