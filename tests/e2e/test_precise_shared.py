"""The event index in Redis (`kv_events_shared`): real engines publishing KV events over ZMQ,
real gateways sharing a real redis-server (or Redis Cluster). One gateway owns each engine's
events and writes them; every gateway routes on them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from cachemap.redis.events import EventWriter
from gateway.events.intake import EventIntake
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness.processes import Proc, free_port, start_gateway, stop, wait_ready
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.e2e.test_precise import (
    CONVERSATION,
    chat,
    direct,
    parts_of,
    precise_settings,
    salt_of,
    via,
)
from tests.e2e.test_precise_processes import sample
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
LEASE_S = 2.0
"""Long enough that a loaded machine (in-process gateways share the GIL) never loses a lease
by a late renewal; the takeover test waits for one to run out."""


def intake_of(gateway: Served) -> EventIntake:
    intake = parts_of(gateway).intake
    assert intake is not None and intake.writer is not None
    return intake


def writer_of(gateway: Served) -> EventWriter:
    writer = intake_of(gateway).writer
    assert writer is not None
    return writer


def shared_settings(ports: dict[str, int], redis_url: str, **extra: Any) -> dict[str, Any]:
    return precise_settings(
        ports,
        redis_url=redis_url,
        redis_deadline_s=0.5,
        kv_events_shared=True,
        kv_events_lease_s=LEASE_S,
        **extra,
    )


def owner_of(gateways: list[Served], url: str) -> Served:
    owners = [g for g in gateways if url in intake_of(g).owned()]
    assert len(owners) == 1, f"{url} owned by {len(owners)} gateways"
    return owners[0]


def balanced(gateways: list[Served], engines: list[Served]) -> bool:
    """Owners balanced: each gateway counts them all and owns no more than its fair share."""
    fair = -(-len(engines) // len(gateways))
    return all(
        intake_of(g).gateways == len(gateways) and len(intake_of(g).owned()) <= fair
        for g in gateways
    )


def join(gateways: list[Served], engines: list[Served]) -> None:
    """Owners balanced, every engine owned by one gateway, whose feed has seen a batch (a PUB
    drops what it sends before the SUB joined: reset the idle engine until the owner's feed saw
    a wipe)."""
    wait_until(lambda: balanced(gateways, engines), what="the owners balanced")
    for engine in engines:

        def joined(engine: Served = engine) -> bool:
            assert httpx.post(engine.url + "/reset_prefix_cache").status_code == 200
            owners = [g for g in gateways if engine.url in intake_of(g).owned()]
            return len(owners) == 1 and any(
                f.stats.wipes > 0 for f in intake_of(owners[0]).feeds(engine.url)
            )

        wait_until(joined, what="each engine owned and its feed joined")


def owned_there(metrics_url: str, name: str = "kvgate_events_owned_domains") -> float:
    """A gateway process's `kvgate_events_owned_domains` (or another metric without labels)."""
    for line in httpx.get(metrics_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def matched(gateway: Served, body: dict[str, Any]) -> int:
    return int(via(gateway, body).headers["x-kvgate-matched-blocks"])


@pytest.fixture
def shared_fleet(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    fresh_redis: RedisServer,
) -> Callable[..., tuple[list[Served], list[Served]]]:
    def make(redis_url: str | None = None, **extra: Any) -> tuple[list[Served], list[Served]]:
        base = free_ports(2)
        engines = [start_engines(1, kv_events=events_config(base + i))[0] for i in range(2)]
        ports = {e.url: base + i for i, e in enumerate(engines)}
        url = redis_url or fresh_redis.url
        gateways = [start_gateway(engines, **shared_settings(ports, url, **extra)) for _ in "ab"]
        join(gateways, engines)
        return engines, gateways

    return make


@pytest.mark.parametrize("store", ["redis", "cluster"])
def test_two_gateways_agree_on_a_placement_only_one_ingests(
    shared_fleet: Callable[..., tuple[list[Served], list[Served]]],
    redis_cluster_url: str,
    store: str,
) -> None:
    extra = {"redis_cluster": True} if store == "cluster" else {}
    (_, y), gateways = shared_fleet(redis_cluster_url if store == "cluster" else None, **extra)
    owner = owner_of(gateways, y.url)
    other = next(g for g in gateways if g is not owner)
    assert y.url not in intake_of(other).owned() and intake_of(other).feeds(y.url) == []
    body = chat(CONVERSATION)
    direct(y, body, salt_of(owner))  # only Y's events know it holds the conversation
    wait_until(lambda: writer_of(owner).num_blocks(y.url) >= 8, what="Y's blocks written")
    answers = [via(g, body) for g in gateways]
    assert [a.headers["x-kvgate-replica"] for a in answers] == [y.url, y.url]
    assert all(int(a.headers["x-kvgate-matched-blocks"]) >= 8 for a in answers)
    assert answers[0].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    precise = parts_of(other).keying.precise  # type: ignore[union-attr]
    assert precise is not None and precise.index.num_blocks(y.url) == 0  # nothing in process


def test_a_wipe_is_out_of_redis_before_the_next_routing_decision(
    shared_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (x, _), gateways = shared_fleet()
    owner = owner_of(gateways, x.url)
    other = next(g for g in gateways if g is not owner)
    body = chat(CONVERSATION)
    direct(x, body, salt_of(owner))
    wait_until(lambda: writer_of(owner).num_blocks(x.url) >= 8, what="X's blocks written")
    wait_until(lambda: matched(other, body) >= 8, what="the other gateway to see them")
    epoch = writer_of(owner).committed_epochs[x.url]
    assert httpx.post(x.url + "/reset_prefix_cache").status_code == 200
    wait_until(lambda: writer_of(owner).committed_epochs[x.url] > epoch, what="the wipe written")
    after = via(other, body)  # the gateway that never saw the event
    assert after.headers["x-kvgate-matched-blocks"] == "0"
    assert after.headers["x-kvgate-decision"] == "no_match"


@pytest.fixture
def process_gateway(fresh_redis: RedisServer) -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(engines: list[Served], ports: dict[str, int]) -> Proc:
        endpoints = {u: f"tcp://127.0.0.1:{p}" for u, p in ports.items()}
        env = {
            "KVGATE_TENANTS": orjson.dumps(["acme:sk-test-acme", "globex:sk-test-globex"]).decode(),
            "KVGATE_SERVER_SECRET": "test-secret",
            "KVGATE_DEBUG_HEADERS": "true",
            "KVGATE_KV_EVENTS_ENDPOINTS": orjson.dumps(endpoints).decode(),
            "KVGATE_KV_EVENTS_TOPIC": "kv",
            "KVGATE_KV_EVENTS_SHARED": "true",
            "KVGATE_KV_EVENTS_LEASE_S": str(LEASE_S),
            "KVGATE_REDIS_URL": fresh_redis.url,
            "KVGATE_OVERFLOW": "false",
            "KVGATE_FANOUT_HOLD": "false",
        }
        args = ["--tokenizer-dir", str(MODEL_DIR)]
        proc = start_gateway(free_port(), [e.url for e in engines], args, env)
        started.append(proc)
        wait_ready(proc.url, "/readyz", proc.popen, 60)
        return proc

    yield start
    stop(started)


def test_a_dead_owners_engines_are_taken_over_and_nothing_is_lost(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    process_gateway: Callable[..., Proc],
    fresh_redis: RedisServer,
) -> None:
    base = free_ports(2)
    engines = [start_engines(1, kv_events=events_config(base + i))[0] for i in range(2)]
    x, y = engines
    ports = {e.url: base + i for i, e in enumerate(engines)}
    first = process_gateway(engines, ports)  # starts alone: it owns both engines
    assert first.metrics_url is not None
    metrics = first.metrics_url
    wait_until(lambda: owned_there(metrics) == 2, what="both owned")
    for engine in engines:

        def joined(url: str = engine.url) -> bool:
            httpx.post(url + "/reset_prefix_cache")
            return sample(metrics, "kvgate_events_total", domain=url, kind="wipes") > 0

        wait_until(joined, what="the first gateway's feeds to join")
    second = start_gateway(engines, **shared_settings(ports, fresh_redis.url))
    # the owners balance: the first hands one engine to the second
    wait_until(
        lambda: len(intake_of(second).owned()) == 1 and owned_there(metrics) == 1,
        what="one engine each",
    )
    [theirs] = [e for e in engines if e.url not in intake_of(second).owned()]
    salt = salt_of(second)
    body = chat(CONVERSATION)
    direct(theirs, body, salt)  # written by the first gateway, read by the second
    wait_until(lambda: matched(second, body) >= 8, what="its blocks via the first gateway")
    first.popen.kill()  # no release: its leases run out
    first.popen.wait(timeout=10)
    wait_until(
        lambda: intake_of(second).owned() == sorted([x.url, y.url]),
        timeout_s=10 * LEASE_S,
        what="the second gateway to take both engines over",
    )
    # what the dead owner wrote is still there
    assert matched(second, body) >= 8
    # and the new owner indexes from here on: X's own traffic moves the next request there
    other = chat([{"role": "user", "content": words("taken-over", 80)}])

    def indexed_after_takeover() -> bool:
        direct(theirs, other, salt)  # the SUB may join after the first publish: send until seen
        return writer_of(second).num_blocks(theirs.url) >= 4

    wait_until(indexed_after_takeover, what="its new blocks written by the new owner")
    routed = via(second, other)
    assert routed.headers["x-kvgate-replica"] == theirs.url
    assert int(routed.headers["x-kvgate-matched-blocks"]) >= 4


def test_owners_balance_over_three_gateways_and_a_dead_ones_engines_spread(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    process_gateway: Callable[..., Proc],
    fresh_redis: RedisServer,
) -> None:
    base = free_ports(4)
    engines = [start_engines(1, kv_events=events_config(base + i))[0] for i in range(4)]
    ports = {e.url: base + i for i, e in enumerate(engines)}
    first = process_gateway(engines, ports)  # starts alone: it takes every engine
    assert first.metrics_url is not None
    metrics = first.metrics_url
    wait_until(lambda: owned_there(metrics) == 4, what="all four owned by the first")
    others = [start_gateway(engines, **shared_settings(ports, fresh_redis.url)) for _ in "ab"]

    def spread() -> bool:  # ceil(4 / 3) = 2 at most each, every engine owned once
        mine = [len(intake_of(g).owned()) for g in others]
        return (
            owned_there(metrics) <= 2
            and all(1 <= n <= 2 for n in mine)
            and (owned_there(metrics) + sum(mine) == 4)
        )

    wait_until(spread, timeout_s=10 * LEASE_S, what="ownership spread over three gateways")
    owned = sorted(u for g in others for u in intake_of(g).owned())
    assert len(set(owned)) == len(owned)  # no engine owned twice
    assert owned_there(metrics, "kvgate_events_handovers_total") >= 2  # 4 -> 2 at most
    assert owned_there(metrics, "kvgate_events_shared_gateways") == 3
    first.popen.kill()  # no release: its leases and its mark run out
    first.popen.wait(timeout=10)
    # within the lease (its leases and its mark expire) plus two ownership rounds, the
    # survivors own every engine, two each
    wait_until(
        lambda: sorted(len(intake_of(g).owned()) for g in others) == [2, 2],
        timeout_s=LEASE_S + 2 * LEASE_S / 3 + 2.0,
        what="the dead gateway's engines taken over, spread",
    )
    assert sorted(u for g in others for u in intake_of(g).owned()) == sorted(ports)
    # a taken-over engine is indexed by its new owner
    salt = salt_of(others[0])
    body = chat([{"role": "user", "content": words("balanced", 80)}])
    target = engines[0]
    owner = owner_of(others, target.url)

    def indexed() -> bool:
        direct(target, body, salt)  # the SUB may join after the first publish: send until seen
        return writer_of(owner).num_blocks(target.url) >= 4

    wait_until(indexed, what="its blocks written by its owner")
    for gateway in others:
        assert via(gateway, body).headers["x-kvgate-replica"] == target.url
