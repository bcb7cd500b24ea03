"""The shared directory end to end: gateways sharing one Redis (and one Redis Cluster), engine
restarts, reconciliation, and Redis killed in the middle of a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.pipeline.reconcile import Reconciler
from gateway.pipeline.record import Recorder
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import FAST, MODEL, metrics_url
from tests.servers import Served, serve, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SHARED = {
    "redis_deadline_s": 0.5,
    "redis_write_deadline_s": 5.0,
    "server_secret": "one-secret-for-the-fleet",
}
"""Generous deadlines: on a busy 2-core machine a 5 ms budget could silently turn a sharing
test into a local one, and a record that misses its write deadline is dropped (by design), so
the next turn at the other gateway would find nothing. The tests also assert zero fallbacks."""


def ask(gateway: Served, messages: list[dict[str, Any]]) -> tuple[Any, str, int]:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8
    )
    return raw.parse(), raw.headers["x-kvgate-replica"], int(raw.headers["x-kvgate-matched-blocks"])


def conversation(name: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent." + words(f"{name}/sys", 600)},
        {"role": "user", "content": words(f"{name}/task", 200)},
    ]


@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_two_gateways_send_the_next_turn_where_the_last_one_went(
    backend: str,
    redis_url: str,
    redis_cluster_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    url = redis_url if backend == "redis" else redis_cluster_url
    engines = start_engines(4)
    gateways = [start_gateway(engines, redis_url=url, **SHARED) for _ in range(2)]
    for g in gateways:
        assert director(g).directory.shared is not None
    messages = conversation(f"two-gateways-{backend}")
    placements = []
    for turn in range(6):
        gateway = gateways[turn % 2]  # alternate: every turn comes through the other gateway
        reply, where, matched = ask(gateway, messages)
        placements.append(where)
        if turn:
            assert matched > 0, f"turn {turn} saw no shared prefix"
            assert reply.usage.engine_cached_tokens > 0
        wait_until(lambda g=gateway: director(g).directory.idle, what="record reached Redis")
        messages = [
            *messages,
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": words(f"turn{turn}", 100)},
        ]
    assert len(set(placements)) == 1
    for g in gateways:
        stats = director(g).directory.stats
        assert stats.fallbacks == 0 and stats.shared_lookups > 0
        page = httpx.get(metrics_url(g) + "/metrics", timeout=10).text
        assert "kvgate_directory_lookup_timeouts_total 0.0" in page
        assert "kvgate_directory_lookup_lagged_total 0.0" in page
        deadline = next(
            float(line.split()[-1])
            for line in page.splitlines()
            if line.startswith("kvgate_directory_lookup_deadline_seconds ")
        )  # the base here (0.5 s, above the cap) plus one block's allowance
        assert deadline == pytest.approx(0.5 + 20e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_an_engine_restart_is_a_new_epoch(
    shared: bool,
    redis_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    engines = start_engines(2)
    extra = {"redis_url": redis_url, **SHARED} if shared else {}
    gateway = start_gateway(engines, **extra)
    d = director(gateway)
    messages = conversation(f"restart-{shared}")
    _, home, _ = ask(gateway, messages)
    _, again, matched = ask(gateway, messages)
    assert again == home and matched > 0
    holder = next(e for e in engines if e.url == home)
    old_start = d.replicas.get(home).metrics.start_time_s  # type: ignore[union-attr]
    holder.stop()
    # the same port, a new engine process: empty cache, a new start time
    with serve(create_engine_app(EngineConfig(timing=FAST)), holder.port):
        wait_until(
            lambda: (
                (m := d.replicas.get(home).metrics) is not None
                and m.start_time_s != old_start
                and d.replicas.get(home).healthy
            ),
            what="the new start time seen",
        )
        if shared:
            wait_until(lambda: d.directory.idle)
        _, _, matched_after = ask(gateway, messages)
        assert matched_after == 0  # its entries stopped matching at once


def test_reconciliation_expires_what_the_engine_evicted(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, capacity_blocks=150)  # 2,400 tokens: two prompts at most
    # the directory not capped at the engine's KV (as in front of an engine with an offload
    # tier its gauge does not count): reconciliation is what corrects it
    gateway = start_gateway(engines, directory_size_from_engines=False)
    d = director(gateway)
    oldest, old = conversation("oldest"), conversation("old")
    ask(gateway, oldest)
    ask(gateway, old)
    for i in range(3):  # fill the engine: it evicts `oldest` and `old`
        ask(gateway, conversation(f"filler{i}"))
    assert isinstance(d.recorder, Recorder)
    reconciler = next(o for o in d.recorder.observers if isinstance(o, Reconciler))
    assert reconciler.stats.overestimates == 0
    reply, _, matched = ask(gateway, old)
    assert matched > 0  # the directory still believed it
    assert reply.usage.engine_cached_tokens < 100
    assert reconciler.stats.overestimates == 1
    # LRU: what was used before `old` is gone too; the directory no longer predicts it
    _, _, matched_oldest = ask(gateway, oldest)
    assert matched_oldest == 0


def test_redis_killed_and_restarted_mid_run_costs_no_request(
    fresh_redis: RedisServer,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    engines = start_engines(2)
    # a deadline a loaded machine keeps (at 50 ms one lookup in ten fell back at a load
    # average of ~20): a stopped Redis refuses the connection at once, whatever the deadline
    gateway = start_gateway(
        engines, redis_url=fresh_redis.url, redis_deadline_s=0.5, server_secret="s"
    )
    d = director(gateway)
    c = client(gateway)
    failures = 0

    def run(n: int, tag: str) -> None:
        nonlocal failures
        for i in range(n):
            messages = [*conversation(f"kill-{i % 3}"), {"role": "user", "content": f"{tag} {i}"}]
            try:
                c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            except openai.APIError:
                failures += 1

    run(10, "before")
    assert d.directory.stats.shared_lookups >= 10 and d.directory.stats.fallbacks == 0
    fresh_redis.stop()
    run(15, "during")
    assert d.directory.degraded
    assert d.directory.stats.fallbacks > 0
    fresh_redis.start()
    wait_until(lambda: not d.directory.degraded, timeout_s=20, what="back to Redis")
    shared_before = d.directory.stats.shared_lookups
    run(10, "after")
    assert d.directory.stats.shared_lookups == shared_before + 10
    assert failures == 0
    assert d.directory.breaker.state.state_changes == 2


def test_redis_back_empty_costs_a_real_gateway_its_conversations_nothing() -> None:
    """Item 21, end to end (`kvgate bench-redis-reset` at a small size): a gateway process,
    Redis SIGKILLed mid-run and restarted empty; no request fails and no conversation moves."""
    import argparse

    from loadgen.bench.redis_reset import add_bench_redis_reset_arguments, run_arm

    parser = argparse.ArgumentParser()
    add_bench_redis_reset_arguments(parser)
    # once the gateway routes on the empty Redis again (the commit before the fix: 7 of 8
    # conversations moved, hit ratio 0.53 in the rounds after; now 0 and 0.90)
    options = "--engines 4 --conversations 8 --rounds-before 1 --rounds-after 2 --wait-back"
    figures = run_arm(parser.parse_args(options.split()), None)
    assert sum(figures[p]["failed"] for p in ("cold", "before", "outage", "after")) == 0
    assert figures["conversations"] == 8 and figures["moved"] == 0
    assert figures["window"]["hit_ratio"] > 0.8


def test_a_turns_record_writes_only_what_its_replica_did_not_hold(
    fresh_redis: RedisServer,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """Issue 39's tier CPU: the next turn's record, at its first token, leaves the prefix its
    lookup found fresh in Redis (the turn before's, seconds ago) and writes its new blocks:
    Redis's HGETs (one per block a record writes, and its count's two) fall to a few, where
    the whole chain was read and written again every turn."""
    engines = start_engines(2)
    gateway = start_gateway(engines, redis_url=fresh_redis.url, **SHARED)
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        messages = conversation("delta-record")
        reads = []
        for turn in range(3):
            wait_until(lambda: director(gateway).directory.idle, what="writes reached Redis")
            sync.config_resetstat()
            reply, _, matched = ask(gateway, messages)
            assert matched > 0 or turn == 0
            wait_until(lambda: director(gateway).directory.idle, what="record reached Redis")
            reads.append(int(sync.info("commandstats").get("cmdstat_hget", {}).get("calls", 0)))
            messages = [
                *messages,
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": words(f"delta turn {turn}", 40)},
            ]
        assert reads[0] > 15, reads  # the first turn: its whole chain
        assert reads[1] < reads[0] / 2 and reads[2] < reads[0] / 2, reads
        page = httpx.get(metrics_url(gateway) + "/metrics", timeout=10).text
        counted = {
            part: float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            for part in ("written", "kept")
            if line.startswith(f'kvgate_directory_record_blocks_total{{part="{part}"}}')
        }
        assert counted["kept"] >= reads[0] - 1 and counted["written"] >= reads[0] - 1, counted
    finally:
        sync.close()
