"""Precise mode with a P/D fleet (issue 42, item 3): 2 prefill and 1 decode simulated engines
(vLLM NixlConnector's roles) publishing KV events over real ZMQ, a real gateway keying with the
model's tokenizer. Events come from both roles: the prefill instance's computed blocks, the
decode instance's pulled ones; the prefill pick follows what the events say."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from loadgen.engine.disagg import CONSUMER, PRODUCER, KVTransferConfig
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.text import words
from tests.conftest import FAST, engine_of
from tests.e2e.test_precise import (
    AUTH,
    chat,
    direct,
    indexed,
    join,
    parts_of,
    precise_settings,
    salt_of,
)
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e


def _engine(role: str, events_port: int) -> Served:
    port = free_ports(1)
    while port == events_port:
        port = free_ports(1)
    transfer = KVTransferConfig(kv_role=role, side_channel_port=port, abort_timeout_s=1e6)
    config = EngineConfig(timing=FAST, kv_transfer=transfer, kv_events=events_config(events_port))
    return start_app(create_engine_app(config), port)


def test_events_from_both_roles_index_the_prefill_and_the_decode_instance(
    start_gateway: Callable[..., Served],
) -> None:
    base = free_ports(3)
    prefill = [_engine(PRODUCER, base), _engine(PRODUCER, base + 1)]
    decode = _engine(CONSUMER, base + 2)
    engines = [*prefill, decode]
    try:
        ports = {e.url: base + i for i, e in enumerate(engines)}
        gateway = start_gateway(prefill, decode_engines=[decode.url], **precise_settings(ports))
        join([gateway], engines)
        # 1. through the gateway: prefilled at one prefill instance, pulled by the decode one;
        # both publish what they store
        body = {
            **chat([{"role": "user", "content": "Both roles." + words("precise-pd", 300)}]),
            "max_tokens": 4,
        }
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvgate-replica"] == decode.url
        prefilled = [e for e in prefill if engine_of(e).core.counters.prompt_tokens > 0]
        assert len(prefilled) == 1
        wait_until(indexed(gateway, prefilled[0].url, 16), what="the prefill's blocks indexed")
        wait_until(indexed(gateway, decode.url, 16), what="the decode's pulled blocks indexed")
        assert engine_of(decode).core.counters.external_tokens > 0
        # 2. a conversation only the other prefill instance's events know: the prefill pick
        # goes there, and the client is billed its hit
        other = next(e for e in prefill if e is not prefilled[0])
        known = chat([{"role": "user", "content": "Known elsewhere." + words("pd-ev", 300)}])
        direct(other, known, salt_of(gateway))  # served whole: no transfer params
        wait_until(indexed(gateway, other.url, 16), what="the other prefill's blocks indexed")
        before = engine_of(other).core.counters.cached_tokens
        again = httpx.post(gateway.url + "/v1/chat/completions", json=known, headers=AUTH)
        assert again.status_code == 200, again.text
        # the route names the prefill pick (x-kvgate-replica is the decode instance that answered)
        route = dict(kv.split("=", 1) for kv in again.headers["x-kvgate-route"].split())
        assert route["replica"] == other.url and route["answered"] == decode.url
        matched, of = route["matched"].split("/")
        assert int(matched) == int(of) >= 16
        assert engine_of(other).core.counters.cached_tokens > before  # prefilled there
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == engine_of(other).core.counters.cached_tokens - before
        precise = parts_of(gateway).keying.precise
        assert precise is not None
        assert precise.index.num_blocks(decode.url) >= 16  # the decode instance stays indexed
    finally:
        stop_all(engines)
