"""LoRA adapters in precise mode: real engines serving an adapter beside the base model, their KV
events over real ZMQ naming it (`lora_name`, the adapter in every block's extra keys, as vLLM
sends them), a real gateway keying a request for the adapter under it (`lora_adapters`)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec
import pytest

from cachemap.events import EventIndex, precise_keys
from gateway.events.decode import decode_batch
from loadgen.engine.kv_events import encode_batch
from loadgen.engine.kvpool import GPU, Stored
from loadgen.engine.tokenizer import block_hashes
from tests.conftest import MODEL
from tests.e2e.test_precise import (
    CONVERSATION,
    chat,
    direct,
    indexed,
    join,
    precise_settings,
    salt_of,
    via,
)
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
ADAPTER = "sql-lora"
OTHER = "chat-lora"


def test_an_adapters_events_key_its_chain_apart_from_the_base_models() -> None:
    ids = list(range(40))
    base = block_hashes(ids, 16, "s")
    lora = block_hashes(ids, 16, "s", lora_name=ADAPTER)
    assert not set(base) & set(lora)  # the engine: an adapter shares no block with the base
    stored = Stored(tuple(lora), None, tuple(ids[:32]), 16, GPU, "s", ADAPTER)
    for encoding in ("vllm", "vllm-array"):
        raw = msgspec.msgpack.decode(encode_batch([stored], 1.0, 0, encoding))
        event = raw[1][0]
        extra = event["extra_keys"] if encoding == "vllm" else event[8]
        assert extra == [[ADAPTER, "s"], [ADAPTER]]  # vLLM's order: the adapter, then the salt
        (decoded,) = decode_batch(encode_batch([stored], 1.0, 0, encoding)).events
        index = EventIndex()
        index.apply("x", decoded)
        assert index.lookup(precise_keys(ids, "s", 16, ADAPTER), 0.0)["x"].depth == 2
        assert index.lookup(precise_keys(ids, "s", 16), 0.0) == {}  # the base model: nothing
        assert index.lookup(precise_keys(ids, "s", 16, "other"), 0.0) == {}


def test_an_adapter_known_only_by_its_id_never_passes_for_the_base_model() -> None:
    ids = list(range(32))
    event = ["BlockStored", [1, 2], None, ids, 16, 7, "GPU", None]  # SGLang-style: lora_id only
    (decoded,) = decode_batch(msgspec.msgpack.encode([1.0, [event], 0])).events
    index = EventIndex()
    index.apply("x", decoded)
    assert index.num_blocks("x") == 2
    assert index.lookup(precise_keys(ids, None, 16), 0.0) == {}


def test_a_lora_request_routes_to_its_adapters_prefix_and_never_the_base_models(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    port = free_ports(2)
    x, y = (
        start_engines(1, kv_events=events_config(port + i), lora_modules=(ADAPTER, OTHER))[0]
        for i in range(2)
    )
    ports = {x.url: port, y.url: port + 1}
    adapters = {ADAPTER: MODEL, OTHER: MODEL}
    gateway = start_gateway([x, y], **precise_settings(ports, lora_adapters=adapters))
    join([gateway], [x, y])
    salt = salt_of(gateway)
    base, adapted = chat(CONVERSATION), {**chat(CONVERSATION), "model": ADAPTER}
    direct(x, base, salt)  # X holds the conversation under the base model
    direct(y, adapted, salt)  # Y under the adapter
    wait_until(indexed(gateway, x.url, 8), what="X's base blocks indexed")
    wait_until(indexed(gateway, y.url, 8), what="Y's adapter blocks indexed")
    for _ in range(3):  # each goes to the replica holding its own chain, whichever came first
        lora = via(gateway, adapted)
        assert lora.headers["x-kvgate-replica"] == y.url
        assert int(lora.headers["x-kvgate-matched-blocks"]) >= 8
        assert lora.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
        plain = via(gateway, base)
        assert plain.headers["x-kvgate-replica"] == x.url
        assert int(plain.headers["x-kvgate-matched-blocks"]) >= 8
    # a third chain (another adapter of the same base): neither X's nor Y's blocks are its
    third = via(gateway, {**chat(CONVERSATION), "model": OTHER})
    assert third.headers["x-kvgate-matched-blocks"] == "0"
    assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cards = httpx.get(x.url + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        (MODEL, None),
        (ADAPTER, MODEL),
        (OTHER, MODEL),
    ]
