"""LoRA adapters and several base models through a real gateway and real engines (issue 42,
items 7-8): residency first, no thrash at `max_loras`, loading on demand, adapters a tenant may
not use answered 404 in each API's shape, and each base model routed to its own replicas."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tenancy.tenant_file import add_key
from tests.conftest import MODEL, TENANT_KEY, metrics_url
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
ADAPTERS = ("sql-lora", "chat-lora")
AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


def ask(gateway: Served, model: str, text: str, key: str = TENANT_KEY) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{text} " + "context " * 200}],
        "max_tokens": 2,
    }
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def loads(engine: Served) -> int:
    n: int = httpx.get(engine.url + "/server_info").json()["lora_loads"]
    return n


def test_an_adapter_stays_where_it_is_resident_and_never_evicts_one_in_use(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, lora_modules=ADAPTERS, max_loras=1)
    gateway = start_gateway(engines, lora_adapters=dict.fromkeys(ADAPTERS, MODEL))
    homes: dict[str, set[str]] = {a: set() for a in ADAPTERS}
    for i in range(6):  # each turn a new prompt: only residency keeps an adapter in place
        for adapter in ADAPTERS:
            r = ask(gateway, adapter, f"turn {i} for {adapter}")
            assert r.status_code == 200, r.text
            homes[adapter].add(r.headers["x-kvgate-replica"])
    (sql,), (chat,) = homes.values()
    assert sql != chat  # one slot each: two adapters on two replicas, one load each
    assert sum(loads(e) for e in engines) == 2
    # approximate keys include the adapter: the same prompt matches under its own adapter only
    again = ask(gateway, ADAPTERS[0], "turn 5 for sql-lora")
    assert int(again.headers["x-kvgate-matched-blocks"]) > 0
    for other in (MODEL, ADAPTERS[1]):
        assert ask(gateway, other, "turn 5 for sql-lora").headers["x-kvgate-matched-blocks"] == "0"


def test_round_robin_thrashes_the_same_traffic(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """The control: the same requests, routed blind to adapters, load one per turn."""
    engines = start_engines(2, lora_modules=ADAPTERS, max_loras=1)
    gateway = start_gateway(
        engines, lora_adapters=dict.fromkeys(ADAPTERS, MODEL), policy="round_robin"
    )
    for i in range(3):
        for adapter in (*ADAPTERS, *ADAPTERS[::-1]):
            assert ask(gateway, adapter, f"turn {i}").status_code == 200
    assert sum(loads(e) for e in engines) > 2


def test_on_demand_an_adapter_is_loaded_where_the_router_sends_it_once(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, runtime_lora_updating=True, max_loras=2)
    gateway = start_gateway(
        engines,
        lora_adapters={"fresh-lora": MODEL},
        lora_loading="on_demand",
        lora_adapter_paths={"fresh-lora": "/adapters/fresh"},
    )
    replicas = {ask(gateway, "fresh-lora", f"q{i}").headers["x-kvgate-replica"] for i in range(4)}
    assert len(replicas) == 1  # resident there after the first: the rest follow it
    listing = {
        e.url: [c["id"] for c in httpx.get(e.url + "/v1/models").json()["data"]] for e in engines
    }
    (home,) = replicas
    assert "fresh-lora" in listing[home]
    assert all("fresh-lora" not in ids for url, ids in listing.items() if url != home)
    page = httpx.get(metrics_url(gateway) + "/metrics").text
    assert "kvgate_adapter_loads_total 1.0" in page


def test_preloaded_only_routes_an_adapter_to_replicas_that_list_it(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    plain = start_engines(1, runtime_lora_updating=True)
    serving = start_engines(1, lora_modules=ADAPTERS[:1])
    gateway = start_gateway([*plain, *serving], lora_adapters={ADAPTERS[0]: MODEL})
    for i in range(3):
        r = ask(gateway, ADAPTERS[0], f"q{i}")
        assert r.headers["x-kvgate-replica"] == serving[0].url
    assert [c["id"] for c in httpx.get(plain[0].url + "/v1/models").json()["data"]] == [MODEL]


def test_an_adapter_a_tenant_may_not_use_is_a_404_in_each_apis_shape(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.yaml"
    key, _, _ = add_key(tenants, "narrow", models=[MODEL, ADAPTERS[0]])
    engines = start_engines(1, lora_modules=ADAPTERS, max_loras=2)
    gateway = start_gateway(
        engines, tenants_file=tenants, lora_adapters=dict.fromkeys(ADAPTERS, MODEL)
    )
    assert ask(gateway, ADAPTERS[0], "allowed", key).status_code == 200
    openai_style = ask(gateway, ADAPTERS[1], "not mine", key)
    assert openai_style.status_code == 404
    error: dict[str, Any] = openai_style.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert ADAPTERS[1] in error["message"] and "chat-lora" not in error["message"].split(":")[-1]
    anthropic = httpx.post(
        gateway.url + "/v1/messages",
        json={
            "model": ADAPTERS[1],
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "not mine"}],
        },
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        timeout=10,
    )
    assert anthropic.status_code == 404
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "not_found_error"
    # a base model outside the tenant's list is still a 403 (it is no one's secret)
    assert ask(gateway, "other-base", "x", key).status_code == 403


def test_each_base_model_is_routed_to_its_own_replicas(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    small = start_engines(2)
    large = start_engines(1, model="kvgate-sim-70b")
    gateway = start_gateway([*small, *large])
    wait_until(
        lambda: httpx.get(gateway.url + "/v1/models", headers=AUTH).status_code == 200,
        what="the gateway's model list",
    )
    for i in range(4):
        r = ask(gateway, "kvgate-sim-70b", f"big {i}")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-replica"] == large[0].url
        r = ask(gateway, MODEL, f"small {i}")
        assert r.headers["x-kvgate-replica"] in {e.url for e in small}
    missing = ask(gateway, "kvgate-sim-405b", "none")
    assert missing.status_code == 404
    assert "kvgate-sim-70b" in missing.json()["error"]["message"]
