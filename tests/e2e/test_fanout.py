"""Fan-out held until the first write lands, and hot prefixes spread — through the gateway."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from gateway.pipeline.reconcile import Reconciler
from gateway.pipeline.record import Recorder
from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import director
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, engine_of, metrics_url
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

REAL_TIME = TimingModel(prefill_tokens_per_s=6_500, decode_s_per_token=0.001)
"""Real-time prefill, so siblings sent together overlap the leader's ~0.6 s write."""
SHARED_TOKENS = 4_000
SYSTEM = "You are a subagent." + words("fanout/system", SHARED_TOKENS // 2)
CONTEXT = "Shared context:" + words("fanout/context", SHARED_TOKENS // 2)


def sibling(i: int, tag: str = "") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": CONTEXT + f"\n\nSubtask {tag}{i}:" + words(f"task{tag}{i}", 100),
        },
    ]


async def send_all(gateway: Served, batches: list[tuple[str, list[dict[str, Any]]]]) -> list[Any]:
    clients = {
        key: openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
        for key in {k for k, _ in batches}
    }

    async def one(key: str, messages: list[dict[str, Any]]) -> Any:
        try:
            raw = await clients[key].chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=2
            )
            return raw.parse(), raw.headers["x-kvgate-replica"]
        except openai.APIStatusError as exc:
            return exc

    try:
        return await asyncio.gather(*(one(k, m) for k, m in batches))
    finally:
        for c in clients.values():
            await c.close()


def computed_tokens(engines: list[Served]) -> int:
    """Prompt tokens the engines prefilled (not read from their caches)."""
    total = 0
    for e in engines:
        counters = engine_of(e).core.counters
        total += counters.prompt_tokens - counters.cached_tokens
    return total


@pytest.mark.parametrize("hold", [True, False])
def test_sixteen_parallel_siblings_write_their_shared_prefix_once(
    hold: bool, start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(4, timing=REAL_TIME)
    gateway = start_gateway(engines, fanout_hold=hold, engine_prefill_tokens_per_s=6_500)
    results = asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(i)) for i in range(16)]))
    assert all(isinstance(r, tuple) for r in results), results
    cached = sorted(r[0].usage.engine_cached_tokens for r in results)
    computed = computed_tokens(engines)
    if hold:
        # one write, fifteen reads of the shared prefix: all on the leader's replica
        assert cached[0] == 0
        assert all(c >= SHARED_TOKENS - 32 for c in cached[1:]), cached
        assert len({r[1] for r in results}) == 1
        assert computed < SHARED_TOKENS + 16 * 200
        stats = director(gateway).placement.flights.stats  # type: ignore[union-attr]
        assert stats.holds == 15 and stats.released_landed == 15 and stats.timeouts == 0
    else:
        # without holding, siblings started before the first write landed each wrote it again
        assert sum(1 for c in cached if c < SHARED_TOKENS // 2) >= 2
        assert computed > 2 * SHARED_TOKENS


def test_a_failed_leader_releases_its_siblings_at_once(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, timing=REAL_TIME, fail_first_bytes=1)
    gateway = start_gateway(
        engines, max_attempts=1, engine_prefill_tokens_per_s=6_500, fanout_max_hold_s=30
    )
    results = asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(i)) for i in range(6)]))
    failed = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert len(failed) == 1 and failed[0].status_code == 502  # the leader
    stats = director(gateway).placement.flights.stats  # type: ignore[union-attr]
    assert stats.released_failed == 5 and stats.timeouts == 0
    assert max(stats.hold_seconds) < 1.0  # released by the failure, not by the 30-s bound
    assert all(isinstance(r, tuple) for r in results if r not in failed)


def test_siblings_of_different_tenants_are_never_held_for_each_other(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(4, timing=REAL_TIME)
    gateway = start_gateway(engines, engine_prefill_tokens_per_s=6_500)
    batch = [(TENANT_KEY, sibling(i)) for i in range(8)] + [
        (OTHER_KEY, sibling(i)) for i in range(8)
    ]
    results = asyncio.run(send_all(gateway, batch))
    assert all(isinstance(r, tuple) for r in results)
    cached = [r[0].usage.engine_cached_tokens for r in results]
    # one write per tenant: each tenant's first sibling paid, its seven others read
    assert sorted(cached[:8])[0] == 0 and min(sorted(cached[:8])[1:]) >= SHARED_TOKENS - 32
    assert sorted(cached[8:])[0] == 0 and min(sorted(cached[8:])[1:]) >= SHARED_TOKENS - 32
    stats = director(gateway).placement.flights.stats  # type: ignore[union-attr]
    assert stats.holds == 14


def test_a_hot_spine_spreads_over_more_replicas(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """...and a replica the spine is spread to is predicted by what it really holds (item 17:
    the spread's virtual overlap once reached reconciliation as an over-estimate of every
    spread request, and the pending prefill counted the spine as cached there)."""
    engines = start_engines(4)  # fast engines: no queue ever builds, the load bound never trips

    def run(**overrides: Any) -> tuple[set[str], Reconciler]:
        gateway = start_gateway(engines, **overrides)
        places: list[str] = []
        for i in range(40):
            results = asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(i, tag="hot"))]))
            places.append(results[0][1])
        recorder = director(gateway).recorder
        assert isinstance(recorder, Recorder)
        reconciler = next(o for o in recorder.observers if isinstance(o, Reconciler))
        return set(places[10:]), reconciler  # after the rate has built up

    assert len(run(overflow=False)[0]) == 1
    # a threshold of 10 requests per minute per replica: 40 requests in a few seconds is hot
    spread, reconciler = run(overflow=True, overflow_threshold_per_min=10, fanout_hold=False)
    assert len(spread) >= 3
    assert reconciler.stats.overestimates == 0  # was 3: one per request the spine spread to


def test_holds_and_overflow_are_exported(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, timing=REAL_TIME)
    gateway = start_gateway(engines, engine_prefill_tokens_per_s=6_500)
    asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(i)) for i in range(4)]))
    asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(5))]))  # matches the shared prefix
    text = httpx.get(metrics_url(gateway) + "/metrics").text
    assert "kvgate_fanout_holds_total 3.0" in text
    assert 'kvgate_fanout_releases_total{reason="landed"} 3.0' in text
    assert "kvgate_fanout_hold_seconds_count 3.0" in text
    assert "kvgate_hot_prefix_rate_per_min{prefix=" in text
    assert "kvgate_overflow_widenings_total" in text


# -- the leader's first token releases its siblings, whatever its client asked (issue 14) ------
DECODING = TimingModel(prefill_tokens_per_s=6_500, decode_s_per_token=0.01)
"""The leader's ~0.6 s prefill, then 2 s of decode for its 200 tokens."""


async def lead_then_siblings(gateway: Served, *, stream: bool) -> tuple[float, list[Any]]:
    """A leader of 200 tokens (streamed or not) and, once it leads, three siblings: (the
    leader's whole time, the siblings' results)."""
    flights = director(gateway).placement.flights
    assert flights is not None
    leader_client = openai.AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key=TENANT_KEY, max_retries=0
    )

    async def leader() -> float:
        started = time.monotonic()
        if stream:
            chunks = await leader_client.chat.completions.create(
                model=MODEL, messages=sibling(0), max_tokens=200, stream=True
            )
            async for _ in chunks:
                pass
        else:
            reply = await leader_client.chat.completions.create(
                model=MODEL, messages=sibling(0), max_tokens=200
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 200
        return time.monotonic() - started

    try:
        leading = asyncio.create_task(leader())
        await asyncio.to_thread(wait_until, lambda: len(flights) > 0, 10, "the leader")
        siblings = await send_all(gateway, [(TENANT_KEY, sibling(i)) for i in range(1, 4)])
        return await leading, siblings
    finally:
        await leader_client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed-leader", "streamed-leader"])
def test_a_leader_releases_its_siblings_at_its_first_token_not_its_last(
    stream: bool,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """Before: a leader whose client did not stream was read whole, so its siblings waited out
    its 2 s of decode — past their bound (2 × its ~0.6 s prefill), and wrote the prefix again."""
    engines = start_engines(4, timing=DECODING)
    gateway = start_gateway(engines, engine_prefill_tokens_per_s=6_500)
    leader_s, results = asyncio.run(lead_then_siblings(gateway, stream=stream))
    assert leader_s > 2.0  # the leader's answer takes its decode time
    assert all(isinstance(r, tuple) for r in results), results
    stats = director(gateway).placement.flights.stats  # type: ignore[union-attr]
    assert stats.holds == 3 and stats.released_landed == 3 and stats.timeouts == 0
    assert max(stats.hold_seconds) < 1.5  # released at the leader's first token
    cached = [r[0].usage.engine_cached_tokens for r in results]
    assert all(c >= SHARED_TOKENS - 32 for c in cached), cached  # each read the prefix
    assert computed_tokens(engines) < SHARED_TOKENS + 4 * 200


def test_a_leader_cancelled_mid_lead_releases_its_siblings_and_leaves_no_flight(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """Suspected: a leader cancelled before its first token leaks its flight, and later
    siblings hold on a dead flight. Disproved for a cancelled RPC (the director ends the flight
    in a `finally`): the held sibling is released at once, and nothing is left behind."""
    import grpc

    from gateway.api.grpc._pb import gateway_pb2 as pb
    from gateway.api.grpc._pb import gateway_pb2_grpc

    engines = start_engines(2, timing=TimingModel(prefill_tokens_per_s=2_000))
    gateway = start_gateway(engines, engine_prefill_tokens_per_s=2_000, grpc_port=0)
    flights = director(gateway).placement.flights
    assert flights is not None
    messages = [
        pb.Message(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text=SYSTEM)]),
        pb.Message(
            role=pb.ROLE_USER,
            content=[pb.ContentPart(text=CONTEXT + "\n\nSubtask 0:" + words("task0", 100))],
        ),
    ]
    request = pb.GenerateRequest(model=MODEL, messages=messages, sampling=pb.Sampling(max_tokens=2))
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.app.state.grpc_port}")
    try:
        call = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(
            request, metadata=(("authorization", f"Bearer {TENANT_KEY}"),), timeout=30
        )
        wait_until(lambda: len(flights) > 0, 10, "the leader")

        async def held_sibling() -> list[Any]:
            sending = asyncio.create_task(send_all(gateway, [(TENANT_KEY, sibling(1))]))
            await asyncio.to_thread(wait_until, lambda: flights.stats.holds == 1, 10, "held")
            call.cancel()  # the leader's client gives up during its ~2 s prefill
            return await sending

        (result,) = asyncio.run(held_sibling())
    finally:
        channel.close()
    assert isinstance(result, tuple), result
    assert flights.stats.released_failed == 1 and flights.stats.timeouts == 0
    assert max(flights.stats.hold_seconds) < 1.9  # released by the cancellation
    assert len(flights) == 0  # no flight left for a later sibling to hold on
    asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(2))]))
    assert flights.stats.holds == 1  # the prefix has landed: nothing to wait for


# -- a fan-out burst is not a hot prefix (issue 45, item 16) ------------------------------------
BURST_TIMING = TimingModel(prefill_tokens_per_s=4_000, decode_s_per_token=0.001, time_scale=10)
"""4,000 prefill tokens/s, ten times faster: the 15,000-token write takes 0.375 s, not 3.75."""
BURST_SHARED = 15_000
BURST_SYSTEM = "You are a subagent." + words("burst/system", BURST_SHARED // 2)
BURST_CONTEXT = "Shared context:" + words("burst/context", BURST_SHARED // 2)


def burst_sibling(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": BURST_SYSTEM},
        {"role": "user", "content": BURST_CONTEXT + f"\n\nSubtask {i}:" + words(f"bt{i}", 100)},
    ]


def test_a_fan_out_burst_is_one_write_and_fifteen_reads_with_overflow_on(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """16 parallel siblings sharing a 15,000-token prefix nobody holds, 4 engines at 4,000
    prefill tokens/s, overflow and holding on (precise mode: the leader's speculative entry
    makes every later sibling match the whole prefix on its replica at once). The siblings
    are one arrival of that prefix, and its holder has room: one write, fifteen reads. Before
    the fix the young rate of 16 requests in one instant widened the prefix and siblings were
    sent to replicas that wrote it again."""
    from tests.e2e.test_precise import join, precise_settings
    from tests.loadgen.test_kv_events import events_config, free_ports

    base = free_ports(4)
    engines = [
        start_engines(1, timing=BURST_TIMING, kv_events=events_config(base + i))[0]
        for i in range(4)
    ]
    settings = precise_settings(
        {e.url: base + i for i, e in enumerate(engines)},
        engine_prefill_tokens_per_s=4_000,
        overflow=True,
        fanout_hold=True,
    )
    gateway = start_gateway(engines, **settings)
    join([gateway], engines)
    results = asyncio.run(send_all(gateway, [(TENANT_KEY, burst_sibling(i)) for i in range(16)]))
    assert all(isinstance(r, tuple) for r in results), results
    cached = sorted(r[0].usage.engine_cached_tokens for r in results)
    assert cached[0] == 0 and cached[1] >= BURST_SHARED, cached  # exactly one write
    assert len({r[1] for r in results}) == 1  # all fifteen reads on the writer's replica
    stats = director(gateway).placement.stats
    assert stats.widenings == 0 and stats.spread_requests == 0
    assert stats.sibling_holds >= 1
    text = httpx.get(metrics_url(gateway) + "/metrics").text
    assert f"kvgate_overflow_sibling_holds_total {float(stats.sibling_holds)}" in text
