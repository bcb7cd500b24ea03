"""The contract's cache entries shared by gateways through the billing store: a conversation
billed as one whichever gateway served each turn (real redis-server, two real gateways, the
real openai SDK)."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from cachemap.redis.client import open_redis
from gateway.billing.pricing.model import Entry
from gateway.billing.shared import SharedEntries, join, scope_id
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY
from tests.e2e.billing.test_gateway_billing import billed_gateway, cached
from tests.servers import Served, wait_until

D = Decimal


def last_uses(url: str) -> set[Decimal]:
    """Every stored entry's last use."""
    client = redis.Redis.from_url(url)
    try:
        keys = client.keys("{kvgate-billing}:e:*")
        return {Decimal(v.split(b"|")[1].decode()) for v in client.mget(keys)} if keys else set()
    finally:
        client.close()


@pytest.mark.redis
@pytest.mark.parametrize(
    ("stored", "new"),
    [
        (Entry(D(100), D(100), D(300)), Entry(D(250), D(250), D(300))),  # overlapping: joined
        (Entry(D(100), D(120), D(3600)), Entry(D(90), D(110), D(300))),  # a parallel writer
        (Entry(D(100), D(100), D(300)), Entry(D(900), D(900), D(300))),  # disjoint: the later
        (Entry(D(900), D(900), D(300)), Entry(D(100), D(100), D(300))),  # ... whichever comes
        (Entry(D("1.5"), D("2.25"), D(300)), Entry(D("1.5"), D("2.25"), D(300))),  # the same
    ],
)
async def test_redis_joins_entries_as_the_rules_do(
    fresh_redis: RedisServer, stored: Entry, new: Entry
) -> None:
    client = await open_redis(fresh_redis.url, cluster=False)
    shared = SharedEntries(client, read_deadline_s=1.0)
    scope = scope_id("anthropic", "acme", "sonnet-5")
    try:
        shared.store(scope, {b"block": stored})
        await shared.drain()
        shared.store(scope, {b"block": new})
        await shared.drain()
        got = await shared.fetch(scope, [b"block", b"absent"])
        assert got == {b"block": join(stored, new)}
        other = await shared.fetch(scope_id("anthropic", "globex", "sonnet-5"), [b"block"])
        assert other == {}  # another tenant's scope sees nothing
    finally:
        await client.aclose()


async def test_a_store_that_does_not_answer_is_no_error(fresh_redis: RedisServer) -> None:
    client = await open_redis(fresh_redis.url, cluster=False)
    shared = SharedEntries(client, read_deadline_s=0.5)
    fresh_redis.stop()
    try:
        assert await shared.fetch("s", [b"block"]) is None
        shared.store("s", {b"block": Entry(D(1), D(1), D(300))})
        await shared.drain()
        assert shared.failures == 2 and not shared.available
    finally:
        await client.aclose()


def turn(gateway: Served, key: str, messages: list[dict[str, Any]]) -> Any:
    c = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    try:
        return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage
    finally:
        c.close()


@pytest.mark.e2e
@pytest.mark.redis
def test_two_gateways_bill_one_conversation_from_one_ledger(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    fresh_redis: RedisServer,
    tmp_path: Path,
) -> None:
    shared: dict[str, Any] = {
        "billing_profiles": {"acme": "anthropic", "globex": "anthropic"},
        "billing_redis_allow_unsafe_fsync": True,  # a Redis without an AOF: not the point here
    }
    a, clock_a = billed_gateway(
        start_engines, start_gateway, tmp_path / "a", billing_redis_url=fresh_redis.url, **shared
    )
    b, clock_b = billed_gateway(
        start_engines, start_gateway, tmp_path / "b", billing_redis_url=fresh_redis.url, **shared
    )
    alone, clock_alone = billed_gateway(start_engines, start_gateway, tmp_path / "c", **shared)
    messages = [{"role": "user", "content": [cached(words("two gateways", 3000))]}]

    first = turn(a, TENANT_KEY, messages)  # gateway A writes the entry
    n = first.prompt_tokens
    assert first.cache_creation_input_tokens == n and first.cache_read_input_tokens == 0
    wait_until(lambda: last_uses(fresh_redis.url) == {1_000_000}, 10, "A's entry in the store")

    for clock in (clock_a, clock_b, clock_alone):
        clock.set(1_000_000 + 120)
    second = turn(b, TENANT_KEY, messages)  # gateway B reads what A wrote
    assert second.cache_read_input_tokens == n and second.cache_creation_input_tokens == 0
    assert Decimal(second.cost) < Decimal(first.cost) / 5

    # without the store a gateway knows only its own traffic: the same turn is a write again
    unshared = turn(alone, TENANT_KEY, messages)
    assert unshared.cache_creation_input_tokens == n and unshared.cache_read_input_tokens == 0

    # B's read slid the lifetime: at 120 + 290 s A still reads (A's own copy had ended at 300)
    wait_until(lambda: last_uses(fresh_redis.url) == {1_000_120}, 10, "B's refresh in the store")
    clock_a.set(1_000_000 + 410)
    third = turn(a, TENANT_KEY, messages)
    assert third.cache_read_input_tokens == n

    # another tenant through either gateway never reads acme's entries
    clock_b.set(1_000_000 + 420)
    other = turn(b, OTHER_KEY, messages)
    assert other.cache_read_input_tokens == 0 and other.cache_creation_input_tokens == n


def use_content(c: openai.OpenAI, object_id: str, question: str) -> Any:
    return c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=2,
        extra_body={"cached_content": object_id},
    )


@pytest.mark.e2e
@pytest.mark.redis
def test_an_explicit_content_made_on_one_gateway_serves_on_another(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    fresh_redis: RedisServer,
    tmp_path: Path,
) -> None:
    settings: dict[str, Any] = {
        "billing_profiles": {"acme": "google_explicit"},
        "billing_model_map": {MODEL: "gemini-3.1-pro"},
        "billing_redis_url": fresh_redis.url,
        "billing_redis_allow_unsafe_fsync": True,  # a Redis without an AOF: not the point here
    }
    a, clock_a = billed_gateway(start_engines, start_gateway, tmp_path / "a", **settings)
    b, clock_b = billed_gateway(start_engines, start_gateway, tmp_path / "b", **settings)
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    handbook = [{"role": "system", "content": words("shared handbook", 3000)}]
    created = httpx.post(
        a.url + "/v1/cached_contents",
        json={"model": MODEL, "messages": handbook, "ttl_s": 7200},
        headers=auth,
    )
    assert created.status_code == 200, created.text
    obj = created.json()

    clock_b.set(1_000_000 + 600)
    c = openai.OpenAI(base_url=b.url + "/v1", api_key=TENANT_KEY, max_retries=0)
    used = use_content(c, obj["id"], "what does it say?")
    assert used.usage.usageMetadata["cachedContentTokenCount"] == obj["tokens"]  # type: ignore[union-attr]

    # extended on B, then deleted on A: each gateway acts on the other's latest state
    clock_b.set(1_000_000 + 3600)
    extended = httpx.patch(
        b.url + f"/v1/cached_contents/{obj['id']}", json={"ttl_s": 7200}, headers=auth
    )
    assert extended.status_code == 200 and extended.json()["expire_time"] != obj["expire_time"]
    clock_a.set(1_000_000 + 5400)
    seen_by_a = httpx.get(a.url + f"/v1/cached_contents/{obj['id']}", headers=auth).json()
    assert seen_by_a["expire_time"] == extended.json()["expire_time"]
    deleted = httpx.delete(a.url + f"/v1/cached_contents/{obj['id']}", headers=auth)
    # the refund runs from A's now (5,400 s) to the expiry B set (10,800 s), not to the first
    # (7,200 s): 1.5 times the rent of B's extension (7,200 → 10,800 s), at the same rate
    assert deleted.status_code == 200
    assert Decimal(deleted.json()["rent"]) == -Decimal(extended.json()["rent"]) * 3 / 2
    clock_b.set(1_000_000 + 5500)
    with pytest.raises(openai.BadRequestError, match="expired or was deleted"):
        use_content(c, obj["id"], "again")
    c.close()
