"""Billing keeps to the isolation scope: in a `user`-scoped tenant each end user has a ledger of
its own (a prefix one user sent is never another's read), explicit cached contents belong to
the scope that made them, and a content's expansion counts against the prompt limits."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.billing.wal import read_directory
from gateway.tenancy.tenant_file import add_key
from loadgen.text import words
from tests.conftest import MODEL
from tests.e2e.billing.test_gateway_billing import billed_gateway
from tests.servers import Served

pytestmark = pytest.mark.e2e

START = 1_000_000


def post(gateway: Served, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        gateway.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


@pytest.mark.parametrize("shared", [False, True], ids=["local-ledger", "shared-ledger"])
def test_one_end_users_prefix_is_never_another_end_users_read(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    shared: bool,
) -> None:
    tenants = tmp_path / "tenants.yaml"
    key, _, _ = add_key(tenants, "people", scope="user")
    store: dict[str, Any] = {}
    if shared:  # the session's Redis has no AOF: durability is not what this test is about
        store = {
            "billing_redis_url": request.getfixturevalue("redis_url"),
            "billing_redis_allow_unsafe_fsync": True,
        }
    gateway, clock = billed_gateway(
        start_engines, start_gateway, tmp_path, tenants_file=tenants, **store
    )
    clock.set(START)
    seed = "only-alice-sent-this-" + uuid.uuid4().hex  # its own entries in the session's Redis
    prompt = [{"role": "user", "content": words(seed, 2000)}]

    def ask(user: str) -> dict[str, Any]:
        r = post(
            gateway,
            key,
            "/v1/chat/completions",
            {"model": MODEL, "messages": prompt, "max_tokens": 2, "user": user},
        )
        assert r.status_code == 200, r.text
        usage: dict[str, Any] = r.json()["usage"]
        return usage

    alice_1 = ask("alice")
    clock.advance(30)
    alice_2 = ask("alice")
    clock.advance(30)
    bob = ask("bob")
    n = alice_1["prompt_tokens"]
    assert alice_1["prompt_tokens_details"]["cached_tokens"] == 0
    assert alice_2["prompt_tokens_details"]["cached_tokens"] == n  # alice's own repeat: a read
    # bob never sent it: no read, a write, and alice's first bill to the cent
    assert bob["prompt_tokens_details"]["cached_tokens"] == 0
    assert bob["prompt_tokens_details"]["cache_write_tokens"] == n
    assert Decimal(bob["cost"]) == Decimal(alice_1["cost"]) > Decimal(alice_2["cost"])
    records = {r["id"]: r for r in read_directory(tmp_path / "wal")}
    assert records[bob["kvgate_billing"]["id"]]["tenant"] == "people"  # billed to the tenant


def test_a_user_scoped_tenant_creates_and_uses_its_own_cached_contents(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.yaml"
    key, _, _ = add_key(tenants, "people", scope="user", billing_profile="google_explicit")
    gateway, clock = billed_gateway(
        start_engines,
        start_gateway,
        tmp_path,
        tenants_file=tenants,
        billing_model_map={MODEL: "gemini-3.1-pro"},
    )
    clock.set(START)
    handbook = [{"role": "system", "content": words("alices-handbook", 1500)}]
    created = post(
        gateway,
        key,
        "/v1/cached_contents",
        {"model": MODEL, "messages": handbook, "ttl_s": 3600, "user": "alice"},
    )
    assert created.status_code == 200, created.text
    object_id = created.json()["id"]

    def use(user: str) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "what does it say?"}],
            "max_tokens": 2,
            "user": user,
            "cached_content": object_id,
        }
        return post(gateway, key, "/v1/chat/completions", body)

    mine = use("alice")
    assert mine.status_code == 200, mine.text
    meta = mine.json()["usage"]["usageMetadata"]
    assert meta["cachedContentTokenCount"] == created.json()["tokens"]
    theirs = use("bob")  # another end user of the same tenant: not theirs to read
    assert theirs.status_code == 400
    assert "no cached content" in theirs.json()["error"]["message"]
    no_user = post(
        gateway, key, "/v1/cached_contents", {"model": MODEL, "messages": handbook, "ttl_s": 60}
    )
    assert no_user.status_code == 400 and "'user'" in no_user.json()["error"]["message"]


def test_a_cached_contents_expansion_counts_against_the_prompt_limits(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    # `words` are single-token words of the engine's vocabulary: ~6.5 bytes each, measured
    bytes_per_word = len(words("ratio", 10_000).encode()) / 10_000
    max_bytes = round(1200 * bytes_per_word)  # 1,200 words: between 1,100 and 1,300
    tenants = tmp_path / "tenants.yaml"
    small, _, _ = add_key(
        tenants, "small", billing_profile="google_explicit", max_prompt_tokens=1000
    )
    wide, _, _ = add_key(tenants, "wide", billing_profile="google_explicit")
    gateway, clock = billed_gateway(
        start_engines,
        start_gateway,
        tmp_path,
        tenants_file=tenants,
        billing_model_map={MODEL: "gemini-3.1-pro"},
        bytes_per_token=bytes_per_word,  # the engine's ratio for `words`: no learning needed
        max_prompt_bytes=max_bytes,
    )
    clock.set(START)

    def use(key: str, seed: str, num_words: int) -> httpx.Response:
        """An object of 700 words (~4.5 kB), then a question naming it."""
        handbook = [{"role": "system", "content": words(seed, 700)}]
        body = {"model": MODEL, "messages": handbook, "ttl_s": 600}
        created = post(gateway, key, "/v1/cached_contents", body)
        assert created.status_code == 200, created.text
        question = [{"role": "user", "content": words(seed + "-question", num_words)}]
        alone = post(gateway, key, "/v1/chat/completions", {"model": MODEL, "messages": question})
        assert alone.status_code == 200, alone.text  # each fits the limits on its own
        body = {
            "model": MODEL,
            "messages": question,
            "max_tokens": 2,
            "cached_content": created.json()["id"],
        }
        return post(gateway, key, "/v1/chat/completions", body)

    r = use(small, "small", 400)  # ~1,100 tokens expanded: over the tenant's 1,000
    assert r.status_code == 400, r.text
    assert "tenant 'small' may send at most 1000" in r.json()["error"]["message"]
    r = use(wide, "wide", 600)  # 1,300 words expanded: over the gateway's 1,200 words of bytes
    assert r.status_code == 400, r.text
    assert f"the maximum is {max_bytes}" in r.json()["error"]["message"]
