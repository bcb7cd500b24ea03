"""The simulated engine's prefill and decode roles (vLLM's NixlConnector), over real HTTP:
the exchange a P/D router drives, the pull of what a decode instance lacks, and the refusals."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadgen.engine.disagg import CONSUMER, PRODUCER, KVTransferConfig
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.harness.processes import free_port
from loadgen.text import words
from tests.conftest import FAST, MODEL, engine_of
from tests.servers import Served, start_app, stop_all, wait_until

LONG = "You are a careful agent." + words("disagg-test", 400)
BYTES_PER_TOKEN = 1024


def _start(role: str, **transfer: Any) -> Served:
    """An engine in `role` at 1,000× speed; unread blocks are held for the whole test unless
    the test says otherwise (vLLM's 480 s would be 0.48 s here)."""
    transfer.setdefault("abort_timeout_s", 1e6)
    port = free_port()
    config = KVTransferConfig(
        kv_role=role,
        side_channel_port=port,
        kv_bytes_per_token=BYTES_PER_TOKEN,
        pull_latency_ms=0.0,
        **transfer,
    )
    return start_app(create_engine_app(EngineConfig(timing=FAST, kv_transfer=config)), port)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Served, Served]]:
    prefill = _start(PRODUCER)
    decode = _start(CONSUMER, kv_load_failure_policy="fail")
    yield prefill, decode
    stop_all([prefill, decode])


def _body(content: str = LONG, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10)


def _prefill(url: str, content: str = LONG) -> dict[str, Any]:
    """The router's first leg, as vLLM's toy proxy sends it."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    r = _post(url, _body(content, max_tokens=1, stream=False, kv_transfer_params=params))
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_prefill_answers_with_params_and_decode_pulls_what_it_lacks(
    fleet: tuple[Served, Served],
) -> None:
    prefill, decode = fleet
    first = _prefill(prefill.url)
    params = first["kv_transfer_params"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    num_blocks = prompt_tokens // 16
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    assert len(params["remote_block_ids"]) == num_blocks
    assert metric(prefill.url, "vllm:nixl_num_held_requests") == 1  # held until read

    bytes_before = metric(decode.url, "vllm:nixl_bytes_transferred_total")
    r = _post(decode.url, _body(kv_transfer_params=params))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # every full block but the one holding the last prompt token comes from the prefill
    assert usage["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    pulled = metric(decode.url, "vllm:nixl_bytes_transferred_total") - bytes_before
    assert pulled == num_blocks * 16 * BYTES_PER_TOKEN
    wait_until(lambda: metric(prefill.url, "vllm:nixl_num_held_requests") == 0, what="freed")

    # read once: the same params again are stale, and this decode's policy is `fail`
    failed = metric(decode.url, "vllm:nixl_num_failed_transfers_total")
    again = _post(decode.url, _body(kv_transfer_params=params))
    assert again.status_code == 500
    assert "KV transfer failed" in again.json()["error"]["message"]
    assert metric(decode.url, "vllm:nixl_num_failed_transfers_total") == failed + 1


def test_a_continuation_pulls_only_the_blocks_the_decode_instance_lacks(
    fleet: tuple[Served, Served],
) -> None:
    prefill, decode = fleet
    opening = "A second conversation." + words("continuation", 300)
    first = _prefill(prefill.url, opening)
    assert _post(decode.url, _body(opening, kv_transfer_params=first["kv_transfer_params"]))
    longer = opening + words("the next turn", 200)
    second = _prefill(prefill.url, longer)
    held = len(second["kv_transfer_params"]["remote_block_ids"])
    local = (first["usage"]["prompt_tokens"] - 1) // 16  # blocks the first turn left cached
    before = metric(decode.url, "vllm:nixl_blocks_transferred_total")
    r = _post(decode.url, _body(longer, kv_transfer_params=second["kv_transfer_params"]))
    assert r.status_code == 200, r.text
    assert metric(decode.url, "vllm:nixl_blocks_transferred_total") - before == held - local


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({"remote_engine_id": "another-engine"}, 500),  # unknown engine: the pull is refused
        ({"remote_request_id": "never-held"}, 500),
        ({"remote_port": "not-a-port"}, 400),  # malformed
        ({"remote_block_ids": None}, 400),
    ],
)
def test_unknown_or_malformed_params_are_refused(
    fleet: tuple[Served, Served], change: dict[str, Any], status: int
) -> None:
    prefill, decode = fleet
    params = {**_prefill(prefill.url)["kv_transfer_params"], **change}
    r = _post(decode.url, _body(kv_transfer_params=params))
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_recompute_policy_prefills_locally_when_the_pull_fails() -> None:
    decode = _start(CONSUMER)  # vLLM's default policy: recompute
    try:
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "gone",
            "remote_request_id": "gone",
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": free_port(),  # nobody listens
        }
        r = _post(decode.url, _body(kv_transfer_params=params))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(decode.url, "vllm:nixl_num_failed_transfers_total") == 1
    finally:
        stop_all([decode])


def test_unread_blocks_are_freed_after_the_abort_timeout() -> None:
    prefill = _start(PRODUCER, abort_timeout_s=20.0)  # 20 ms at 1,000×
    try:
        _prefill(prefill.url)
        wait_until(lambda: metric(prefill.url, "vllm:nixl_num_expired_total") == 1, what="expiry")
        assert metric(prefill.url, "vllm:nixl_num_held_requests") == 0
    finally:
        stop_all([prefill])


def test_an_engine_without_a_connector_ignores_transfer_params() -> None:
    plain = start_app(create_engine_app(EngineConfig(timing=FAST)))
    try:
        r = _post(plain.url, _body(kv_transfer_params={"do_remote_decode": True}))
        assert r.status_code == 200 and "kv_transfer_params" not in r.json()
    finally:
        stop_all([plain])


def test_sglang_bootstrap_prefill_and_decode_sent_at_once() -> None:
    """SGLang's protocol: both instances get the request together, with the prefill's
    bootstrap address and a room; the decode instance waits for that room's prefill."""
    prefill = _start(PRODUCER, sglang=True)
    decode = _start(CONSUMER, sglang=True)
    try:
        room: dict[str, Any] = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.port,
            "bootstrap_room": 7,
        }
        body = _body(**room)

        async def both() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=10) as client:
                path = "/v1/chat/completions"
                d = asyncio.create_task(client.post(decode.url + path, json=body))
                p = asyncio.create_task(client.post(prefill.url + path, json=body))
                return await d, await p

        decoded, prefilled = asyncio.run(both())
        assert prefilled.status_code == decoded.status_code == 200, decoded.text
        assert prefilled.json()["usage"]["completion_tokens"] == 1  # the prefill's first token
        assert decoded.json()["usage"]["completion_tokens"] == 4
        prompt_tokens = decoded.json()["usage"]["prompt_tokens"]
        cached = decoded.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt_tokens - 1) // 16 * 16  # pulled, not computed
        assert metric(decode.url, "vllm:nixl_blocks_transferred_total") == prompt_tokens // 16
    finally:
        stop_all([prefill, decode])


def test_a_request_waiting_for_held_blocks_starts_when_the_hold_ends() -> None:
    """Held blocks fill a small cache: the next request waits for them, and starts when the
    hold times out (nothing else would wake the scheduler: no request is running)."""
    prefill = _start(PRODUCER, abort_timeout_s=300.0)  # 0.3 s at 1,000×
    engine = engine_of(prefill)
    try:
        first = _prefill(prefill.url)
        held = len(first["kv_transfer_params"]["remote_block_ids"])
        engine.core.cache.capacity_blocks = held + 4  # what is held leaves too little
        r = _post(prefill.url, _body("Another prompt." + words("after-the-hold", 400)))
        assert r.status_code == 200, r.text
        assert metric(prefill.url, "vllm:nixl_num_expired_total") == 1
    finally:
        stop_all([prefill])


def test_an_sglang_room_its_decode_gave_up_on_holds_no_blocks() -> None:
    """A decode instance whose pull stopped waiting for its room (the prefill queued longer than
    the bootstrap wait) is gone: when the room's prefill ends, its blocks are not held until
    the abort timeout (they had pinned the cache and stalled the prefill's queue behind them,
    the sglang-router arm of `kvgate bench-pd` under load)."""
    prefill = _start(PRODUCER, sglang=True, bootstrap_wait_s=0.05)
    try:
        pull = httpx.post(prefill.url + "/kv_transfer/pull", json={"request_id": "room-9"})
        assert pull.status_code == 404  # waited 50 ms for a prefill that had not come
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.port, "bootstrap_room": 9}
        r = _post(prefill.url, _body(max_tokens=1, **room))
        assert r.status_code == 200, r.text
        assert metric(prefill.url, "vllm:nixl_num_held_requests") == 0
        assert metric(prefill.url, "vllm:nixl_num_expired_total") == 1
        # another room, its decode still waiting, is held as before
        r = _post(prefill.url, _body(max_tokens=1, **{**room, "bootstrap_room": 10}))
        assert r.status_code == 200 and metric(prefill.url, "vllm:nixl_num_held_requests") == 1
    finally:
        stop_all([prefill])
