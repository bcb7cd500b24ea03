"""Tenants end to end: keys from a watched file, isolation scopes, per-tenant policies, rate
limits across two gateways sharing a real Redis, and nothing in a response about anyone else's
cache. The real openai SDK and httpx against the gateway and simulated engines on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.tenancy.tenant_file import add_key, revoke
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as sdk
from tests.conftest import FAST, MODEL, OTHER_KEY, TENANT_KEY
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a coding agent." + words("iso-system", 1200)}


def post(gateway: Served, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [SYSTEM, {"role": "user", "content": content}],
        "max_tokens": 4,
        **extra,
    }


def cached(completion: Any) -> tuple[int, int]:
    usage = completion.usage
    return usage.prompt_tokens_details.cached_tokens, usage.engine_cached_tokens


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    return tmp_path / "tenants.yaml"


def test_keys_are_added_and_revoked_through_the_file_without_a_restart(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tenants_file: Path,
) -> None:
    k1, e1, _ = add_key(tenants_file, "filed")
    gateway = start_gateway(
        start_engines(2), tenants_file=tenants_file, tenants_reload_interval_s=0.02
    )
    body = chat("hello")
    assert post(gateway, k1, body).status_code == 200
    assert post(gateway, TENANT_KEY, body).status_code == 200  # --tenant keys keep working
    k2, _, _ = add_key(tenants_file, "filed")  # what `kvgate tenants add` does
    wait_until(lambda: post(gateway, k2, body).status_code == 200, what="the new key admitted")
    revoke(tenants_file, e1.id)
    wait_until(lambda: post(gateway, k1, body).status_code == 401, what="the old key refused")
    # one code path: a revoked key and one never issued get the very same answer
    revoked, unknown = post(gateway, k1, body), post(gateway, "sk-kvg-never-issued", body)
    assert (revoked.status_code, revoked.content) == (unknown.status_code, unknown.content)
    assert revoked.json()["error"]["code"] == "invalid_api_key"
    assert post(gateway, k2, body).status_code == 200


def test_another_tenants_repeated_prompt_never_shows_as_cached(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(2), debug_headers=False)
    a, b = sdk(gateway, TENANT_KEY), sdk(gateway, OTHER_KEY)
    messages: Any = [SYSTEM, {"role": "user", "content": "the same question"}]
    a.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = a.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert min(cached(again)) > 1000  # tenant A hits its own cache
    raw = b.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
    assert cached(raw.parse()) == (0, 0)
    assert not [h for h in raw.headers if h.startswith("x-kvgate")]
    # streamed, on a prompt A has sent twice and B never (not even its system prompt)
    messages = [{"role": "user", "content": words("only-a-has-sent-this", 1200)}]
    for _ in range(2):
        a.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chunks = list(
        b.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.engine_cached_tokens == 0  # type: ignore[attr-defined]


def test_a_user_scoped_tenant_gives_each_end_user_its_own_cache(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tenants_file: Path,
) -> None:
    key, _, _ = add_key(tenants_file, "people", scope="user")
    gateway = start_gateway(start_engines(2), tenants_file=tenants_file)
    c = sdk(gateway, key)
    messages: Any = [SYSTEM, {"role": "user", "content": "per-user question"}]

    def ask(**extra: Any) -> tuple[int, int]:
        return cached(
            c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **extra)
        )

    assert ask(user="alice") == (0, 0)
    assert min(ask(user="alice")) > 1000
    assert ask(user="bob") == (0, 0)  # same tenant, same prompt, another user: no hit
    assert min(ask(prompt_cache_key="bob")) > 1000  # the key names the end user when alone
    assert min(ask(user="bob", prompt_cache_key="carol")) > 1000  # `user` comes first
    # the tenant-scoped tenant with the same prompt shares nothing with any of them
    assert cached(
        sdk(gateway, TENANT_KEY).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2
        )
    ) == (0, 0)
    r = post(gateway, key, chat("no user"))
    assert r.status_code == 400
    assert "isolates its cache per end user: send 'user'" in r.json()["error"]["message"]
    r = post(gateway, key, chat("odd user", user=None, prompt_cache_key=7))
    assert r.status_code == 400 and "'prompt_cache_key' must be a string" in r.text


def test_allowed_models_and_the_prompt_size_limit(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tenants_file: Path,
) -> None:
    boxed, _, _ = add_key(tenants_file, "boxed", models=["other-model", "third-model"])
    small, _, _ = add_key(tenants_file, "small", max_prompt_tokens=500)
    gateway = start_gateway(start_engines(1), tenants_file=tenants_file)
    r = post(gateway, boxed, chat("hi"))
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["message"] == (
        f"tenant 'boxed' may not use model '{MODEL}'; allowed: other-model, third-model"
    )
    assert (error["type"], error["code"]) == ("permission_error", "model_not_allowed")
    assert sdk(gateway, boxed).models.list().data == []  # it sees only what it may use
    assert [m.id for m in sdk(gateway, small).models.list().data] == [MODEL]
    short = {"model": MODEL, "messages": [{"role": "user", "content": words("s", 100)}]}
    assert post(gateway, small, short).status_code == 200
    r = post(gateway, small, chat("a system prompt of 1,200 words is too long"))
    assert r.status_code == 400
    assert "tenant 'small' may send at most 500" in r.json()["error"]["message"]


class _LeakyHeaders:
    """A real engine that also sends the timing and cache headers some servers add."""

    LEAKS = (
        (b"server-timing", b"prefill;dur=41.2, cache;desc=hit"),
        (b"x-cache", b"HIT"),
        (b"x-cache-hit-tokens", b"4096"),
        (b"openai-processing-ms", b"41"),
        (b"x-process-time", b"0.041"),
        (b"x-request-id", b"engine-req-1"),
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def leaky_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.LEAKS]}
            await send(message)

        await self.app(scope, receive, leaky_send)


def test_no_upstream_timing_or_cache_header_reaches_a_client(
    start_gateway: Callable[..., Served],
) -> None:
    engine = start_app(_LeakyHeaders(create_engine_app(EngineConfig(timing=FAST))))
    try:
        direct = httpx.post(engine.url + "/v1/chat/completions", json=chat("x"))
        assert direct.headers["x-cache"] == "HIT"  # the engine really sends them
        allowed = {"content-type", "content-length", "transfer-encoding", "date", "server"}
        quiet = start_gateway([engine], debug_headers=False)
        responses = [
            post(quiet, TENANT_KEY, chat("json")),
            post(quiet, TENANT_KEY, chat("sse", stream=True)),
            post(quiet, TENANT_KEY, chat("engine 4xx", max_tokens=10**7)),  # passed through
        ]
        assert [r.status_code for r in responses] == [200, 200, 400]
        for r in responses:
            assert set(r.headers) - {"cache-control", "x-request-id"} <= allowed, r.headers
            # the gateway's own id of the exchange (random), never the engine's
            assert r.headers.get("x-request-id", "req_").startswith("req_"), r.headers
        # the operator's debug flag adds the gateway's own routing headers, still no upstream ones
        loud = start_gateway([engine], debug_headers=True)
        r = post(loud, TENANT_KEY, chat("debug"))
        assert r.headers["x-kvgate-replica"] == engine.url
        assert (
            set(r.headers)
            - {"x-kvgate-replica", "x-kvgate-matched-blocks", "x-kvgate-decision"}
            - {"x-kvgate-route", "x-request-id"}
            <= allowed
        )
    finally:
        stop_all([engine])


def test_rate_limits_hold_across_two_gateways_sharing_redis(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tenants_file: Path,
    redis_url: str,
) -> None:
    name = f"metered-{uuid.uuid4().hex[:8]}"  # its own buckets in the session's Redis
    key, _, _ = add_key(tenants_file, name, requests_per_min=4)
    engines = start_engines(2)
    settings = {"tenants_file": tenants_file, "redis_url": redis_url, "debug_headers": False}
    first, second = start_gateway(engines, **settings), start_gateway(engines, **settings)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
    statuses = [post(g, key, body).status_code for g in (first, second, first, second)]
    assert statuses == [200, 200, 200, 200]
    for gateway in (first, second):
        r = post(gateway, key, body)
        assert r.status_code == 429
        assert 10 <= int(r.headers["retry-after"]) <= 16  # one request per 15 s comes back
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert f"tenant '{name}' is over its rate limit (4 requests/min)" in error["message"]
    assert post(first, TENANT_KEY, body).status_code == 200  # other tenants are unaffected
    limiter = first.app.state.rate_limiter
    assert limiter.num_redis_failures == 0  # the limit was shared, not local


def test_tokens_per_minute_are_charged_by_what_was_used(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tenants_file: Path,
) -> None:
    key, _, _ = add_key(tenants_file, "tokens", tokens_per_min=3000)
    gateway = start_gateway(start_engines(1), tenants_file=tenants_file)
    used = 0
    refused = None
    for i in range(20):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words(f"tpm{i}", 400)}],
            "max_tokens": 20,
        }
        r = post(gateway, key, body)
        if r.status_code != 200:
            refused = r
            break
        used += r.json()["usage"]["total_tokens"]
    assert refused is not None and refused.status_code == 429
    assert "3000 tokens/min" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # admitted while the budget lasted: at most 3,000 (+ the trickle refilled meanwhile)
    assert 2000 < used <= 3000 + 100
    huge = {"model": MODEL, "messages": [{"role": "user", "content": words("huge", 4000)}]}
    r = post(gateway, key, huge)
    assert r.status_code == 400 and "it can never be admitted" in r.json()["error"]["message"]


def test_no_tenant_can_move_another_tenants_token_estimate(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tenants_file: Path,
) -> None:
    """The bytes-per-token estimate sizes admission (`max_prompt_tokens`): learned from every
    tenant, one tenant's odd text moved everyone's. Each tenant now learns its own."""
    small, _, _ = add_key(tenants_file, "small", max_prompt_tokens=500)
    steerer, _, _ = add_key(tenants_file, "steerer")
    gateway = start_gateway(start_engines(1), tenants_file=tenants_file)
    prose = {"model": MODEL, "messages": [{"role": "user", "content": words("prose", 300)}]}
    assert post(gateway, small, prose).status_code == 200  # ~300 tokens: within its 500
    # scattered letters tokenize at ~2 bytes a token (English prose at ~5)
    dense = " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(1200))
    for n in range(20):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{n} {dense}"}]}
        assert post(gateway, steerer, body).status_code == 200
    # the same prose again: still ~300 tokens for `small` (with one shared estimate: ~650)
    r = post(gateway, small, prose)
    assert r.status_code == 200, r.text
    estimator = director(gateway).estimator
    assert estimator.bytes_per_token(MODEL, tenant="steerer") < 2.5
    assert estimator.bytes_per_token(MODEL, tenant="small") > 4.5
