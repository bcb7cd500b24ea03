"""Billing on, precise mode: a fan-out leader's entry is visible from its replica's BlockStored
(docs/billing.md#common-model, vector 14), so its held siblings are released then and billed
reads. Real engines publishing KV events over real ZMQ, real gateways, the real openai SDK; the
engines' first completion chunk comes ~0.5 s after the prefill, so the event lands first."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from gateway.billing.pricing.money import parse_instant
from gateway.billing.wal import read_directory
from loadgen.engine.timing import TimingModel
from loadgen.harness.redis_servers import RedisServer
from tests.clients import director
from tests.conftest import MODEL, TENANT_KEY
from tests.e2e.test_fanout_events import (
    GATEWAY_PREFILL_ESTIMATE,
    SHARED_PROMPT,
    SLOW_FIRST_CHUNK,
    SLOW_LEADER,
    SLOW_LEADER_ESTIMATE,
)
from tests.e2e.test_precise import join, precise_settings
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

ANTHROPIC = {"cache_control": {"type": "ephemeral"}}
"""Anthropic's automatic breakpoint (top level): the whole completion prompt is one entry."""
HELD_LEADER = {
    **SLOW_FIRST_CHUNK,
    "timing": TimingModel(prefill_tokens_per_s=2_000, decode_s_per_token=0.02),
}
"""Engines for siblings at the leader's own gateway: the leader prefills ~2 s, so the two
siblings sent once its flight shows reach the lookup and hold before it lands, and its first
chunk comes ~1 s after its BlockStored (under pytest-xdist on a loaded machine, at 6,500
tokens/s and 0.5 s, the siblings once came too late to hold)."""


def event_engines(
    start_engines: Callable[..., list[Served]], **extra: Any
) -> tuple[list[Served], dict[str, int]]:
    """Two engines publishing KV events; their events ports by URL."""
    base = free_ports(2)
    engines = [
        start_engines(1, kv_events=events_config(base + i), **{**SLOW_FIRST_CHUNK, **extra})[0]
        for i in range(2)
    ]
    return engines, {e.url: base + i for i, e in enumerate(engines)}


def events_billing(ports: dict[str, int], wal: Path, **extra: Any) -> dict[str, Any]:
    return {
        **precise_settings(ports),
        "fanout_hold": True,
        "engine_prefill_tokens_per_s": GATEWAY_PREFILL_ESTIMATE,
        "billing_wal_dir": wal,
        "billing_model_map": {MODEL: "sonnet-5", f"openai:{MODEL}": "gpt-5.6"},
        "billing_profiles": {"acme": "anthropic"},
        **extra,
    }


def ask(gateway: Served, max_tokens: int, extra_body: dict[str, Any] | None = None) -> Any:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=TENANT_KEY, max_retries=0) as c:
        stream = c.completions.create(
            model=MODEL,
            prompt=SHARED_PROMPT,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        return [chunk.usage for chunk in stream if chunk.usage is not None][-1]


def records(*wals: Path) -> list[dict[str, Any]]:
    return sorted((r for w in wals for r in read_directory(w)), key=lambda r: r["start_unix"])


def test_held_siblings_released_at_the_leaders_block_stored_are_billed_reads(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    """One gateway (its speculative entries last 1 ms, so the siblings find the leader in
    flight and hold, as at another gateway): the leader writes, its two identical siblings are
    released by its BlockStored — ~1 s before its first token — and read, and the engine's own
    cached tokens agree. Before, with billing on, the leader landed at its first byte."""
    engines, ports = event_engines(start_engines, **HELD_LEADER)
    settings = events_billing(
        ports,
        tmp_path / "wal",
        speculative_ttl_s=0.001,
        engine_prefill_tokens_per_s=SLOW_LEADER_ESTIMATE,
    )
    gateway = start_gateway(engines, **settings)
    join([gateway], engines)
    flights = director(gateway).placement.flights
    assert flights is not None
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        leader = pool.submit(ask, gateway, 100, ANTHROPIC)
        wait_until(lambda: len(flights) > 0, what="the leader's flight")
        siblings = [pool.submit(ask, gateway, 2, ANTHROPIC) for _ in range(2)]
        usages = [leader.result(timeout=30)] + [s.result(timeout=30) for s in siblings]
    assert flights.stats.landed_on_events == 1  # its BlockStored, ~1 s before its first chunk
    assert flights.stats.holds == 2 and flights.stats.released_landed == 2
    assert flights.stats.timeouts == 0
    n = usages[0].prompt_tokens
    lead, *sibs = usages
    assert lead.cache_creation_input_tokens == n and lead.cache_read_input_tokens == 0
    assert lead.engine_cached_tokens == 0
    for usage in sibs:
        assert usage.cache_read_input_tokens == n and usage.cache_creation_input_tokens == 0
        assert usage.prompt_tokens_details.cached_tokens == n  # the contract's R
        # the engine held all of it but the last partial block: the read is a physical hit
        assert n - 16 <= usage.engine_cached_tokens < n
    first, *rest = records(tmp_path / "wal")
    assert first["written_tokens"] == n and [r["read_tokens"] for r in rest] == [n, n]
    leader_first_token = parse_instant(first["first_token"])
    assert all(Decimal(r["start_unix"]) < leader_first_token for r in rest)  # released earlier
    iet = sum(Decimal(r["iet"]) for r in records(tmp_path / "wal"))
    assert iet == Decimal("1.25") * n + 2 * Decimal("0.1") * n  # vector 14: one write, reads


@pytest.mark.redis
def test_a_sibling_at_another_gateway_reads_the_entry_its_leader_made_visible_at_block_stored(
    fresh_redis: RedisServer,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    """Two gateways, one Redis for the directory and the billing store (openai profile): the
    sibling at B holds on A's leader marker and is released by the leader's BlockStored at A;
    A wrote the entry, visible from that instant, to the store before announcing the landing,
    so B bills a read. The stored visibility is before the leader's first token."""
    engines, ports = event_engines(start_engines, **SLOW_LEADER)  # the sibling before the landing
    common = {
        "engine_prefill_tokens_per_s": SLOW_LEADER_ESTIMATE,
        "redis_url": fresh_redis.url,
        "redis_deadline_s": 0.5,
        "server_secret": "fleet",
        "billing_redis_url": fresh_redis.url,
        "billing_redis_allow_unsafe_fsync": True,  # a Redis without an AOF: not the point here
        "billing_profiles": {"acme": "openai"},
    }
    a = start_gateway(engines, **events_billing(ports, tmp_path / "a", **common))
    b = start_gateway(engines, **events_billing(ports, tmp_path / "b", **common))
    join([a, b], engines)
    store = redis.Redis.from_url(fresh_redis.url)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leader = pool.submit(ask, a, 100)
        wait_until(lambda: any(True for _ in store.scan_iter(match="kvg:*:w")), what="markers")
        sibling = ask(b, 2)
        lead = leader.result(timeout=30)
    entries = [v.decode() for v in store.mget(list(store.scan_iter(match="{kvgate-billing}:e:*")))]
    store.close()
    n = lead.prompt_tokens
    lead_details, sibling_details = lead.prompt_tokens_details, sibling.prompt_tokens_details
    assert lead_details.cached_tokens == 0 and lead_details.cache_write_tokens == n
    assert sibling_details.cached_tokens == n and sibling_details.cache_write_tokens == 0
    assert n - 16 <= sibling.engine_cached_tokens < n  # the engine's hit agrees
    stats_a = director(a).placement.flights.stats  # type: ignore[union-attr]
    stats_b = director(b).placement.flights.stats  # type: ignore[union-attr]
    assert stats_a.landed_on_events == 1
    assert stats_b.holds == 1 and stats_b.released_landed == 1 and stats_b.timeouts == 0
    (leader_record,) = records(tmp_path / "a")
    (sibling_record,) = records(tmp_path / "b")
    visible_at = {Decimal(e.split("|")[0]) for e in entries}
    assert len(visible_at) == 1
    assert visible_at.pop() < parse_instant(leader_record["first_token"])
    assert Decimal(sibling_record["start_unix"]) < parse_instant(leader_record["first_token"])
    iet = Decimal(leader_record["iet"]) + Decimal(sibling_record["iet"])
    assert iet == Decimal("1.25") * n + Decimal("0.1") * n


def test_a_leader_admitted_at_block_stored_that_never_sends_a_token_is_billed_as_aborted(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    """Engines that prefill (and publish BlockStored) and never send a token: the leader's
    entry became visible at its BlockStored, so when it fails (its first-byte bound, on both
    replicas) it is billed once, as an aborted exchange, and its open entry is settled."""
    # a ~0.1-s prefill well inside the 1.5-s first-byte bound: its BlockStored comes first even
    # on a loaded machine (at 0.6 s against 0.8 s the margin was a fifth of a second)
    fast_prefill = TimingModel(prefill_tokens_per_s=40_000, decode_s_per_token=0.01)
    engines, ports = event_engines(start_engines, stall_after_tokens=0, timing=fast_prefill)
    settings = events_billing(ports, tmp_path / "wal", first_byte_timeout_s=1.5)
    gateway = start_gateway(engines, **settings)
    join([gateway], engines)
    with pytest.raises(openai.APIError):
        ask(gateway, 4, ANTHROPIC)
    flights = director(gateway).placement.flights
    assert flights is not None and flights.stats.landed_on_events == 1
    wal = gateway.app.state.billing.meter.wal
    wait_until(lambda: wal.num_open == 0, what="the open entry settled")
    (record,) = records(tmp_path / "wal")
    assert record["status"] == "aborted" and record["written_tokens"] > 0
    assert record["output_tokens"] == 0
