"""Fair flow control through a real gateway and real engines (issue 43): the noisy neighbour.

Tenant A (acme) floods two engines with closed-loop clients of distinct long prompts; tenant B
(globex) sends a short prompt at a time. Without flow control B's request joins the engines'
FIFO queues behind A's backlog; with it A's backlog waits in the gateway, in A's own sub-queue,
and B's request overtakes it. The test counts A's requests answered while each of B's waited (a
count, not a latency: it holds on a loaded machine)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, metrics_url
from tests.servers import Served

pytestmark = pytest.mark.e2e

PREFILL_TOKENS_PER_S = 40_000
TIMING = TimingModel(prefill_tokens_per_s=PREFILL_TOKENS_PER_S, decode_s_per_token=0.0005)
"""A's prompt (~2,000 tokens) prefills in ~50 ms: 32 of them are a backlog of ~0.8 s per engine."""
A_CLIENTS = 32
B_REQUESTS = 3


async def _noisy_neighbour(gateway: Served) -> tuple[list[int], list[int]]:
    """(A's answers during each of B's requests, every status seen)."""
    answered: list[float] = []
    statuses: list[int] = []
    stop = asyncio.Event()
    saturated = asyncio.Event()

    async def post(client: httpx.AsyncClient, key: str, content: str) -> int:
        r = await client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 1,
            },
        )
        statuses.append(r.status_code)
        return r.status_code

    async def flooder(client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not stop.is_set():  # bounded: the B side sets it
            await post(client, TENANT_KEY, f"A{i}-{n} " + words(f"flood{i}-{n}", 1_500))
            answered.append(time.monotonic())
            if len(answered) >= A_CLIENTS:  # every client has had one answer: the flood is on
                saturated.set()
            n += 1

    during: list[int] = []
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0, limits=limits) as client:
        flood = [asyncio.create_task(flooder(client, i)) for i in range(A_CLIENTS)]
        try:
            await asyncio.wait_for(saturated.wait(), 30.0)
            for k in range(B_REQUESTS):
                started = time.monotonic()
                assert await post(client, OTHER_KEY, f"B{k} " + words(f"light{k}", 100)) == 200
                ended = time.monotonic()
                during.append(sum(1 for t in answered if started < t < ended))
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*flood), 30.0)
    return during, statuses


def test_a_light_tenant_overtakes_a_flooding_tenants_backlog(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, timing=TIMING)
    common: dict[str, Any] = {
        "engine_prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "flow_max_pending_prefill_s": 0.04,
    }
    off = start_gateway(engines, flow_control=False, **common)
    during_off, statuses_off = asyncio.run(_noisy_neighbour(off))
    off.stop()
    on = start_gateway(engines, **common)
    during_on, statuses_on = asyncio.run(_noisy_neighbour(on))
    assert set(statuses_on) == {200} and set(statuses_off) == {200}
    # off: B waits behind the engines' FIFO backlog of A's requests (~32 over two engines);
    # on: behind what is already at the engines (about one prefill each), not A's queue
    median_off, median_on = (sorted(d)[B_REQUESTS // 2] for d in (during_off, during_on))
    assert median_off >= 12 and median_on <= median_off / 2, (during_off, during_on)
    metrics = httpx.get(metrics_url(on) + "/metrics").text
    assert 'kvgate_flow_dispatched_total{band="0",how="queued"}' in metrics
    assert "kvgate_flow_queue_seconds_bucket" in metrics and "kvgate_replica_room_tokens" in metrics
    tenant_port = httpx.get(on.url + "/metrics", headers={"authorization": f"Bearer {TENANT_KEY}"})
    assert "kvgate_flow" not in tenant_port.text
