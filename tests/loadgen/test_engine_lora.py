"""LoRA adapters on the simulated engine on its own, as vLLM serves them: the GPU slots
(`--max-loras`, LRU, the wait at the limit), `vllm:lora_requests_info`, the runtime load and
unload routes, and the prefix cache keyed with the adapter."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from loadgen.engine.lora import AdapterSlots, parse_lora_module
from loadgen.engine.timing import TimingModel
from tests.conftest import MODEL, engine_of
from tests.loadgen.test_engine import LONG
from tests.servers import Served, wait_until

ADAPTERS = ("sql-lora", "chat-lora", "code-lora")


def ask(url: str, model: str, content: str = LONG, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=10)


def lora_info(url: str) -> dict[str, str]:
    text = httpx.get(url + "/metrics").text
    match = re.search(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.M)
    assert match, "vllm:lora_requests_info missing from /metrics"
    return dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))


def info(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(url + "/server_info").json()
    return body


@contextmanager
def decoding(url: str, model: str) -> Iterator[None]:
    """A streamed request for `model` decoding (slowly) until the block ends and its client
    leaves: it holds its adapter's slot meanwhile."""
    stop = threading.Event()

    def run() -> None:
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "hold " + model}],
                "max_tokens": 1000,
                "stream": True,
            },
            timeout=30,
        ) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def test_slots_evict_the_least_recently_used_idle_adapter_and_wait_when_all_are_held() -> None:
    async def story() -> None:
        slots = AdapterSlots(max_loras=2)
        assert await slots.acquire("a") is True  # a cold load
        assert await slots.acquire("b") is True
        assert await slots.acquire("a") is False  # resident: no load
        slots.release("a")
        slots.release("a")
        # b is held by a request, a is idle: c takes a's slot, b is never evicted
        assert await slots.acquire("c") is True
        assert list(slots.resident) == ["b", "c"]
        assert slots.num_loads == 3 and slots.num_evictions == 1
        slots.release("c")
        # b held, c idle: a comes back in c's slot, the least recently used idle one
        assert await slots.acquire("a") is True
        assert list(slots.resident) == ["b", "a"]
        # now every slot is held: d waits until one is released
        d = asyncio.ensure_future(slots.acquire("d"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not d.done() and slots.waiting == {"d": 1}
        slots.release("b")
        assert await d is True
        assert list(slots.resident) == ["a", "d"] and not slots.waiting

    asyncio.run(story())


def test_a_client_leaving_during_a_load_leaves_no_adapter_behind() -> None:
    async def story() -> None:
        slots = AdapterSlots(max_loras=1, load_s=30.0)
        task = asyncio.ensure_future(slots.acquire("a"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert slots.waiting == {"a": 1}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not slots.resident and not slots.waiting

    asyncio.run(story())


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_module("sql=/models/sql") == ("sql", "/models/sql")
    assert parse_lora_module('{"name": "sql", "path": "/m/sql", "base_model_name": "x"}') == (
        "sql",
        "/m/sql",
    )
    for bad in ("sql", "=/x", '{"name": "sql"}', "{oops"):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_module(bad)


def test_adapters_in_two_slots_load_evict_and_show_in_lora_requests_info(
    start_engines: Callable[..., list[Served]],
) -> None:
    (engine,) = start_engines(1, lora_modules=ADAPTERS, max_loras=2)
    cards = httpx.get(engine.url + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None)] + [
        (a, MODEL) for a in ADAPTERS
    ]
    assert lora_info(engine.url) == {
        "max_lora": "2",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    sql, chat_, code = ADAPTERS
    for model in (sql, chat_, sql, MODEL):  # two loads; the base model takes no slot
        assert ask(engine.url, model).status_code == 200
    assert (info(engine.url)["lora_loads"], info(engine.url)["lora_evictions"]) == (2, 0)
    assert ask(engine.url, code).status_code == 200  # evicts chat-lora, the LRU one
    assert list(engine_of(engine).adapters.resident) == [sql, code]
    assert ask(engine.url, chat_).status_code == 200  # back: evicts sql-lora
    assert (info(engine.url)["lora_loads"], info(engine.url)["lora_evictions"]) == (4, 2)
    # one slot, held by a decoding stream: another adapter's request waits, shown as waiting
    slow = TimingModel(decode_s_per_token=0.2, decode_s_per_seq=0.0, time_scale=1.0)
    (one,) = start_engines(1, lora_modules=ADAPTERS, max_loras=1, timing=slow, lora_load_s=0)
    with decoding(one.url, sql):
        wait_until(lambda: lora_info(one.url)["running_lora_adapters"] == sql, what="sql runs")
        result: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: result.append(ask(one.url, chat_, max_tokens=1)), daemon=True
        )
        waiter.start()
        wait_until(lambda: lora_info(one.url)["waiting_lora_adapters"] == chat_, what="chat waits")
        assert not result  # not served while sql-lora holds the only slot
    waiter.join(timeout=10)
    assert result and result[0].status_code == 200
    assert lora_info(one.url)["running_lora_adapters"] == ""


def test_the_prefix_cache_is_keyed_with_the_adapter(
    start_engines: Callable[..., list[Served]],
) -> None:
    (engine,) = start_engines(1, lora_modules=ADAPTERS, max_loras=0)
    sql, chat_, _ = ADAPTERS

    def cached(model: str) -> int:
        r = ask(engine.url, model)
        assert r.status_code == 200, r.text
        n: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return n

    assert cached(sql) == 0
    assert cached(chat_) == 0  # the same prompt under another adapter: nothing shared
    assert cached(MODEL) == 0  # nor with the base model
    assert cached(sql) > 0 and cached(chat_) > 0 and cached(MODEL) > 0


def test_adapters_load_and_unload_at_run_time_only_when_allowed(
    start_engines: Callable[..., list[Served]],
) -> None:
    (closed,) = start_engines(1, lora_modules=ADAPTERS[:1])
    refused = httpx.post(
        closed.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}
    )
    assert refused.status_code == 404  # vLLM attaches the routes only when allowed
    (engine,) = start_engines(1, runtime_lora_updating=True)
    assert lora_info(engine.url)["max_lora"] == "1"
    new = {"lora_name": "fresh-lora", "lora_path": "/adapters/fresh"}
    assert ask(engine.url, "fresh-lora").status_code == 404
    loaded = httpx.post(engine.url + "/v1/load_lora_adapter", json=new)
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'fresh-lora' added successfully."
    cards = httpx.get(engine.url + "/v1/models").json()["data"]
    assert ("fresh-lora", "/adapters/fresh", MODEL) in [
        (c["id"], c["root"], c["parent"]) for c in cards
    ]
    assert ask(engine.url, "fresh-lora").status_code == 200
    again = httpx.post(engine.url + "/v1/load_lora_adapter", json=new)
    assert again.status_code == 400
    assert (
        again.json()["error"]["message"] == "The lora adapter 'fresh-lora' has already been loaded."
    )
    missing = httpx.post(engine.url + "/v1/load_lora_adapter", json={"lora_name": "y"})
    assert missing.status_code == 400 and "lora_path" in missing.json()["error"]["message"]
    gone = httpx.post(engine.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh-lora"})
    assert gone.status_code == 200
    assert gone.text == "Success: LoRA adapter 'fresh-lora' removed successfully."
    assert not engine_of(engine).adapters.resident  # idle: its slot is free again
    assert ask(engine.url, "fresh-lora").status_code == 404
    unknown = httpx.post(engine.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh-lora"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The lora adapter 'fresh-lora' cannot be found."
