"""Precise mode end to end: real engines publishing KV events over ZMQ, a real gateway keying
requests with the model's tokenizer and routing on what the events say."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.events.intake import Feed
from gateway.server.app import Parts
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words
from tests.conftest import FAST, MODEL, TENANT_KEY, metrics_url
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, start_app, wait_until

pytestmark = pytest.mark.e2e
TOPIC = "kv"
AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


def parts_of(gateway: Served) -> Parts:
    parts: Parts = gateway.app.state.parts
    return parts


def precise_settings(ports: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {
        "tokenizer_dir": MODEL_DIR,
        "engine_block_size": 16,
        "kv_events_endpoints": {u: f"tcp://127.0.0.1:{p}" for u, p in ports.items()},
        "kv_events_topic": TOPIC,
        "overflow": False,
        "fanout_hold": False,
        **extra,
    }


def feeds(gateway: Served, url: str) -> list[Feed]:
    intake = parts_of(gateway).intake
    assert intake is not None
    return intake.feeds(url)


def join(gateways: list[Served], engines: list[Served]) -> None:
    """PUB drops what it sends before a SUB joined: reset each idle engine until every
    gateway's feeds of it have seen an AllBlocksCleared."""
    for engine in engines:

        def joined(engine: Served = engine) -> bool:
            assert httpx.post(engine.url + "/reset_prefix_cache").status_code == 200
            return all(f.stats.wipes > 0 for g in gateways for f in feeds(g, engine.url))

        wait_until(joined, what="the gateways' feeds to join")


def salt_of(gateway: Served) -> str:
    return parts_of(gateway).tenants.authenticate(TENANT_KEY).cache_salt


def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 1}


def direct(engine: Served, body: dict[str, Any], salt: str, **headers: str) -> dict[str, Any]:
    """A request sent to an engine without the gateway: only its events tell the gateway."""
    r = httpx.post(
        engine.url + "/v1/chat/completions", json={**body, "cache_salt": salt}, headers=headers
    )
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def via(gateway: Served, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r


def indexed(gateway: Served, url: str, min_blocks: int = 1) -> Callable[[], bool]:
    index = parts_of(gateway).keying
    assert index is not None and index.precise is not None
    precise = index.precise
    return lambda: precise.index.num_blocks(url) >= min_blocks


@pytest.fixture
def precise_fleet(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> Callable[..., tuple[list[Served], list[Served]]]:
    def make(
        n: int = 2,
        num_gateways: int = 1,
        admin_keys: list[str] | None = None,
        gateway_overrides: dict[str, Any] | None = None,
        **engine: Any,
    ) -> tuple[list[Served], list[Served]]:
        base = free_ports(n)
        engines = [
            start_engines(1, kv_events=events_config(base + i), **engine)[0] for i in range(n)
        ]
        ports = {e.url: base + i for i, e in enumerate(engines)}
        settings = precise_settings(ports, admin_keys=admin_keys or [], **(gateway_overrides or {}))
        gateways = [start_gateway(engines, **settings) for _ in range(num_gateways)]
        join(gateways, engines)
        return engines, gateways

    return make


CONVERSATION = [
    {"role": "system", "content": "You are terse." + words("precise-system", 60)},
    {"role": "user", "content": words("precise-user", 60)},
]


def test_an_event_moves_the_next_request_and_two_gateways_agree(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (_, y), gateways = precise_fleet(2, num_gateways=2)
    salt = salt_of(gateways[0])
    body = chat(CONVERSATION)
    direct(y, body, salt)  # only Y's events know it holds the conversation
    for g in gateways:
        wait_until(indexed(g, y.url), what="Y's blocks indexed")
    answers = [via(g, body) for g in gateways]
    assert [a.headers["x-kvgate-replica"] for a in answers] == [y.url, y.url]
    assert all(int(a.headers["x-kvgate-matched-blocks"]) >= 8 for a in answers)
    assert answers[0].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_the_blocks_a_gateway_placed_come_back_keyed_from_its_chain(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    """A conversation routed through the gateway: its engine's store of the prompt's blocks
    takes their own keys from the chain the gateway keyed (not hashed again: counted as
    `placed`), and they are the keys the next request of the conversation matches there."""
    _, [gateway] = precise_fleet(2)
    body = chat(CONVERSATION)
    replica = via(gateway, body).headers["x-kvgate-replica"]
    wait_until(indexed(gateway, replica, 8), what="the placed blocks indexed")
    keying = parts_of(gateway).keying
    assert keying is not None and keying.precise is not None
    assert keying.precise.index.stats.expected_blocks >= 8
    page = httpx.get(metrics_url(gateway) + "/metrics").text
    assert 'kvgate_events_stored_blocks_total{keys="placed"}' in page
    again = via(gateway, body)
    assert again.headers["x-kvgate-replica"] == replica
    assert int(again.headers["x-kvgate-matched-blocks"]) >= 8


def test_a_wipe_stops_routing_on_its_entries_before_the_next_request(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (x, _), (gateway,) = precise_fleet(2)
    salt = salt_of(gateway)
    body = chat(CONVERSATION)
    direct(x, body, salt)
    wait_until(indexed(gateway, x.url), what="X's blocks indexed")
    assert int(via(gateway, body).headers["x-kvgate-matched-blocks"]) > 0
    wipes = feeds(gateway, x.url)[0].stats.wipes
    assert httpx.post(x.url + "/reset_prefix_cache").status_code == 200
    wait_until(lambda: feeds(gateway, x.url)[0].stats.wipes > wipes, what="the wipe seen")
    after = via(gateway, body)
    assert after.headers["x-kvgate-matched-blocks"] == "0"
    assert after.headers["x-kvgate-decision"] == "no_match"


def test_the_start_up_line_names_precise_keying_and_its_event_feeds(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = free_ports(2)
    x, y = (start_engines(1, kv_events=events_config(base + i))[0] for i in range(2))
    with caplog.at_level(logging.INFO):
        start_gateway([x, y], **precise_settings({x.url: base, y.url: base + 1}))
    (line,) = [r.getMessage() for r in caplog.records if "serving on" in r.getMessage()]
    assert "keying precise (2 KV event feeds)" in line and "billing off" in line


def test_a_restarted_engine_seq_0_drops_its_entries(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    port = free_ports(1)
    (x,) = start_engines(1, kv_events=events_config(port))
    gateway = start_gateway([x], **precise_settings({x.url: port}))
    join([gateway], [x])
    salt = salt_of(gateway)
    direct(x, chat(CONVERSATION), salt)
    wait_until(indexed(gateway, x.url), what="X's blocks indexed")
    http_port = int(x.url.rsplit(":", 1)[1])
    feed = feeds(gateway, x.url)[0]
    # the old process's seq well ahead: the new one's batches come back lower even when the
    # SUB reconnects only after its first few (a PUB drops what it sends before that)
    for _ in range(30):
        assert httpx.post(x.url + "/reset_prefix_cache").status_code == 200
    wait_until(lambda: (feed.next_seq or 0) >= 30, what="the old engine's batches")
    direct(x, chat(CONVERSATION), salt)
    wait_until(indexed(gateway, x.url), what="X's blocks indexed again")
    x.stop()
    again = start_app(
        create_engine_app(EngineConfig(timing=FAST, kv_events=events_config(port))), port=http_port
    )
    try:

        def restarted() -> bool:  # a batch of the new process (seq < 30) once the SUB rejoined
            httpx.post(again.url + "/reset_prefix_cache")
            return feed.stats.restarts > 0

        wait_until(restarted, what="the restart seen")
        precise = parts_of(gateway).keying.precise  # type: ignore[union-attr]
        assert precise is not None and precise.index.num_blocks(x.url) == 0
    finally:
        again.stop()


def test_dp_ranks_are_cache_domains_routed_with_the_header(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    port = free_ports(2)
    (x,) = start_engines(1, kv_events=events_config(port), data_parallel_size=2)
    gateway = start_gateway([x], **precise_settings({x.url: port}, engine_dp_size=2))
    join([gateway], [x])
    salt = salt_of(gateway)
    body = chat(CONVERSATION)
    direct(x, body, salt, **{"X-data-parallel-rank": "1"})
    precise = parts_of(gateway).keying.precise  # type: ignore[union-attr]
    assert precise is not None
    wait_until(lambda: precise.index.num_blocks(x.url + "#1") > 0, what="rank 1's blocks")
    assert precise.index.num_blocks(x.url + "#0") == 0
    answer = via(gateway, body).json()
    # sent to rank 1 by the header: its cache had the prompt (rank 0's is empty)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_gateway_token_ids_equal_the_engines_and_the_check_agrees(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    _, (gateway,) = precise_fleet(2)
    answer = via(gateway, chat(CONVERSATION)).json()
    keying = parts_of(gateway).keying
    assert keying is not None and keying.precise is not None and keying.check is not None
    check = keying.check
    wait_until(lambda: check.stats.checks == 1, what="the first request's tokenizer check")
    assert check.stats.mismatches == 0
    ids = keying.precise.tokens.ids(chat(CONVERSATION), chat=True)
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_the_prediction_is_walked_only_for_replicas_whose_events_do_not_flow(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """In process, a request whose candidates' events all flow reads the events alone (the
    prediction would be used for none of them), and records no prediction for a replica whose
    events flow (it would never be read); one more candidate without events and the
    prediction is looked up again, for it, and recorded where it routed."""
    turns = [*CONVERSATION, {"role": "assistant", "content": words("precise-reply", 30)}]
    follow = [*turns, {"role": "user", "content": words("precise-user-2", 20)}]
    _, (gateway,) = precise_fleet(2)
    directory = parts_of(gateway).directory
    first = via(gateway, chat(CONVERSATION)).headers["x-kvgate-replica"]
    wait_until(indexed(gateway, first, 8), what="the first turn's blocks indexed")
    before = directory.local.index.num_entries(first)
    second = via(gateway, chat(follow))
    assert second.headers["x-kvgate-replica"] == first
    assert int(second.headers["x-kvgate-matched-blocks"]) >= 8
    assert directory.stats.lookups == 0
    timed = parts_of(gateway).director.stats.lookup_seconds.children
    assert {k: h.count for k, h in timed.items()} == {("events",): 2}
    assert directory.local.index.num_entries(first) == before  # not recorded again

    (silent,) = start_engines(1)  # publishes no events
    port = free_ports(1)
    (loud,) = start_engines(1, kv_events=events_config(port))
    mixed = start_gateway([loud, silent], **precise_settings({loud.url: port}))
    join([mixed], [loud])
    placed = via(mixed, chat(CONVERSATION)).headers["x-kvgate-replica"]
    assert parts_of(mixed).directory.stats.lookups == 1
    recorded = parts_of(mixed).directory.local.index.num_entries(placed)
    assert (recorded > 0) == (placed == silent.url)  # the prediction is kept where it is read
    timed = parts_of(mixed).director.stats.lookup_seconds.children
    assert {k: h.count for k, h in timed.items()} == {("local",): 1}


def test_a_request_that_waited_for_room_is_placed_on_the_events_of_its_dispatch(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    """A request keyed while X held its prompt waits in flow control's queue (every replica
    busy: leases the test holds); meanwhile X drops it and Y stores it. It is placed on Y:
    the events are read again when it leaves the queue. Before, it went to X on the events of
    its arrival (on the bench's agent sessions 44% of precise requests waited, 18.7 s on
    average, while the engines' caches turned over)."""
    (x, y), (gateway,) = precise_fleet(2)
    salt, body = salt_of(gateway), chat(CONVERSATION)
    direct(x, body, salt)
    wait_until(indexed(gateway, x.url, 8), what="X's blocks indexed")
    director = parts_of(gateway).director
    flow = director.flow
    assert flow is not None
    states = director.replicas.states
    holds = gateway.on_loop(lambda: [states[e.url].lease(10**9) for e in (x, y)])

    def move() -> None:  # X drops the prompt, Y stores it: the gateway sees both
        wipes = feeds(gateway, x.url)[0].stats.wipes
        assert httpx.post(x.url + "/reset_prefix_cache").status_code == 200
        direct(y, body, salt)
        wait_until(
            lambda: feeds(gateway, x.url)[0].stats.wipes > wipes and indexed(gateway, y.url, 8)(),
            what="X's wipe and Y's blocks seen",
        )

    async def waits_then_placed() -> httpx.Response:
        asked = asyncio.create_task(asyncio.to_thread(via, gateway, body))
        await asyncio.to_thread(
            wait_until, lambda: gateway.on_loop(lambda: len(flow.queue)) == 1, 10.0, "queued"
        )
        await asyncio.to_thread(move)
        gateway.on_loop(lambda: [hold.release() for hold in holds])  # both, then the queue
        return await asked

    answer = asyncio.run(waits_then_placed())
    assert answer.headers["x-kvgate-replica"] == y.url
    assert int(answer.headers["x-kvgate-matched-blocks"]) >= 8
    assert director.stats.refreshed_after_wait == 1


def test_a_second_turn_on_a_claim_longer_than_the_engines_kv_is_counted_as_the_engine_runs_it(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    """The Director's leases count a placement's prefill capped at the engine's KV
    (`router.capacity`, wired in `Director._capped`): a request placed while an identical one is
    in flight on a replica whose engine holds 16 blocks (256 tokens) matches the first one's
    speculative claim over its whole prompt, but the engine can keep at most 256 of its tokens,
    so its lease counts the rest as prefill. Uncapped it counted ~0, and a loaded home looked
    idle to the load bound and to flow control (issue 40's live TTFT gap)."""
    (engine,), (gateway,) = precise_fleet(
        1, capacity_blocks=16, hang_first_bytes=2, gateway_overrides={"first_byte_timeout_s": 3}
    )
    director = parts_of(gateway).director
    state = director.replicas.states[engine.url]
    wait_until(
        lambda: gateway.on_loop(state.kv_capacity_tokens) == 256, what="the engine's KV scraped"
    )
    body = chat([{"role": "user", "content": words("capped-claim", 600)}])

    def asked() -> None:  # the engine never answers: the gateway gives up after 3 s
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
        assert r.status_code >= 500

    def counted() -> tuple[int, float]:
        return gateway.on_loop(lambda: (state.num_prefilling, state.pending_prefill_tokens))

    async def both() -> tuple[float, float]:
        first = asyncio.create_task(asyncio.to_thread(asked))
        await asyncio.to_thread(wait_until, lambda: counted()[0] == 1, 5.0, "the first leased")
        alone = counted()[1]
        second = asyncio.create_task(asyncio.to_thread(asked))
        await asyncio.to_thread(wait_until, lambda: counted()[0] == 2, 5.0, "the second leased")
        together = counted()[1]
        await asyncio.gather(first, second)
        return alone, together

    alone, together = asyncio.run(both())
    prompt_tokens = alone  # the first found nothing cached: its whole prompt is its prefill
    assert prompt_tokens > 600
    assert together - alone == pytest.approx(prompt_tokens - 256, abs=16)
