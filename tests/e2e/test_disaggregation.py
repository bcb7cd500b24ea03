"""A prefill/decode fleet behind the gateway (vLLM NixlConnector's protocol), over real HTTP
with the openai SDK: 2 prefill and 2 decode simulated engines."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from gateway.server.app import create_app
from loadgen.engine.disagg import CONSUMER, PRODUCER, KVTransferConfig
from loadgen.engine.server import Engine, EngineConfig, create_engine_app
from loadgen.engine.timing import TimingModel
from loadgen.harness.processes import free_port
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import FAST, MODEL, OTHER_KEY, engine_of, gateway_settings
from tests.servers import Served, start_app, stop_all

pytestmark = pytest.mark.e2e


def _engine(role: str, timing: TimingModel = FAST) -> Served:
    port = free_port()
    transfer = KVTransferConfig(kv_role=role, side_channel_port=port, abort_timeout_s=1e6)
    return start_app(create_engine_app(EngineConfig(timing=timing, kv_transfer=transfer)), port)


@dataclass
class Fleet:
    prefill: list[Served]
    decode: list[Served]
    gateway: Served

    def engine(self, url: str) -> Engine:
        return engine_of(next(e for e in self.prefill + self.decode if e.url == url))

    def prompt_tokens(self, served: list[Served]) -> list[int]:
        return [engine_of(e).core.counters.prompt_tokens for e in served]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    prefill = [_engine(PRODUCER), _engine(PRODUCER)]
    decode = [_engine(CONSUMER), _engine(CONSUMER)]
    settings = gateway_settings(
        [e.url for e in prefill], decode_engines=[e.url for e in decode], max_attempts=3
    )
    gateway = start_app(create_app(settings))
    yield Fleet(prefill, decode, gateway)
    stop_all([gateway, *prefill, *decode])


def ask(c: openai.OpenAI, content: str, **extra: Any) -> tuple[Any, str, str]:
    """One streamed chat turn: its usage, its text, the replica that answered (a decode one)."""
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    usage, text = None, ""
    for chunk in raw.parse():
        usage = chunk.usage or usage
        text += "".join(c.delta.content or "" for c in chunk.choices)
    return usage, text, raw.headers["x-kvgate-replica"]


def test_a_repeat_is_prefilled_where_cached_and_billed_as_the_prefill_read_it(
    fleet: Fleet,
) -> None:
    c = client(fleet.gateway)
    prompt = "You are a coding agent." + words("pd-repeat", 600)
    before = fleet.prompt_tokens(fleet.prefill)
    first, text, decoded_at = ask(c, prompt)
    assert decoded_at in [e.url for e in fleet.decode]
    assert len(text.split()) >= 4  # the decode instance generated the answer
    # the decode instance pulled the prompt (and counts it cached), but the prefill computed it
    assert first.prompt_tokens_details.cached_tokens == 0
    assert fleet.engine(decoded_at).core.counters.external_tokens > 0
    second, _, _ = ask(c, prompt)
    assert second.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // 16 * 16
    moved = [a - b for a, b in zip(fleet.prompt_tokens(fleet.prefill), before, strict=True)]
    assert sorted(moved) == [0, 2 * first.prompt_tokens]  # one prefill instance served both


def test_the_salt_isolates_tenants_on_both_roles(fleet: Fleet) -> None:
    prompt = "A shared system prompt." + words("pd-salt", 500)
    ask(client(fleet.gateway), prompt)
    hits = [engine_of(e).core.counters.cached_tokens for e in fleet.prefill + fleet.decode]
    other, _, _ = ask(client(fleet.gateway, OTHER_KEY), prompt)
    assert other.prompt_tokens_details.cached_tokens == 0
    after = [engine_of(e).core.counters.cached_tokens for e in fleet.prefill + fleet.decode]
    assert after == hits  # neither the prefill nor the decode instance hit the other's blocks


def test_a_client_never_sends_transfer_params(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(fleet.gateway).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"kv_transfer_params": {"do_remote_prefill": True}},
        )
    assert "kv_transfer_params" in str(caught.value)


def test_a_failing_prefill_and_a_failing_decode_are_retried(fleet: Fleet) -> None:
    c = client(fleet.gateway)
    prompt = "Retry me." + words("pd-retry", 500)
    before = fleet.prompt_tokens(fleet.prefill)
    _, _, decoded_at = ask(c, prompt)
    after = fleet.prompt_tokens(fleet.prefill)
    prefilled_at = next(e for e, b, a in zip(fleet.prefill, before, after, strict=True) if a > b)
    # the instances a repeat goes to first (its prefix is cached on both) now fail once each
    stats = director(fleet.gateway).stats
    retries = stats.retries
    disagg = director(fleet.gateway).disaggregation
    assert disagg is not None
    decode_failures = disagg.num_decode_failures
    fleet.engine(decoded_at).num_failures_left = 1
    usage, text, again = ask(c, prompt)
    assert text and again != decoded_at  # the other decode instance answered
    assert disagg.num_decode_failures == decode_failures + 1
    engine_of(prefilled_at).num_failures_left = 1
    usage, text, _ = ask(c, prompt + " and more")
    assert text and usage.prompt_tokens > 0
    assert stats.retries == retries + 1  # the other prefill instance took it


def test_an_evicted_prefix_is_reconciled_against_the_prefill_instance() -> None:
    """The usage's cached tokens are the prefill's: a shortfall there makes the prefill
    instance suspect (its entries are what misled the pick), never the decode instance."""
    prefill, decode = _engine(PRODUCER), _engine(CONSUMER)
    settings = gateway_settings([prefill.url], decode_engines=[decode.url])
    gateway = start_app(create_app(settings))
    try:
        prompt = "Evicted later." + words("pd-reconcile", 500)
        ask(client(gateway), prompt)
        assert engine_of(prefill).reset_prefix_cache()  # the prefill forgets it (a wipe)
        usage, _, _ = ask(client(gateway), prompt)
        assert usage.prompt_tokens_details.cached_tokens == 0
        states = director(gateway).replicas.states
        assert states[prefill.url].suspicions == 1
        assert states[decode.url].suspicions == 0
    finally:
        stop_all([gateway, prefill, decode])


def test_a_continuation_leaves_its_busier_decode_instance_for_an_idle_one() -> None:
    """The decode pick is load-aware first: turn 2 of a conversation decodes where turn 1 did
    (both decode instances idle: the cached prefix breaks the tie); while turn 2 still streams
    there, turn 3 goes to the idle instance, though the busy one holds its whole prefix (the
    old bound, 25% + 256 tokens, kept it there: the imbalance bench-pd measured)."""
    prefill = _engine(PRODUCER)
    slow = TimingModel(time_scale=0.25)  # 23 ms a token: turn 2's 128 tokens stream for 3 s
    decode = [_engine(CONSUMER, slow), _engine(CONSUMER, slow)]
    settings = gateway_settings([prefill.url], decode_engines=[e.url for e in decode])
    gateway = start_app(create_app(settings))
    try:
        c = client(gateway)
        prompt = "A long agent session." + words("pd-balance", 500)
        _, _, first = ask(c, prompt)
        held = c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt + " Turn two."}],
            max_tokens=128,  # its load, 128 + 64 tokens, is within the old bound
            stream=True,
        )
        assert held.headers["x-kvgate-replica"] == first  # level loads: its prefix decides
        stream = held.parse()
        next(iter(stream))  # turn 2 is decoding on `first`
        _, _, third = ask(c, prompt + " Turn two. Turn three.")
        assert third != first
        stream.close()
    finally:
        stop_all([gateway, prefill, *decode])


def _sglang_engine(prefill: bool) -> Served:
    port = free_port()
    transfer = KVTransferConfig(
        kv_role=PRODUCER if prefill else CONSUMER,
        sglang=True,
        side_channel_port=port,
        abort_timeout_s=1e6,
    )
    return start_app(create_engine_app(EngineConfig(timing=FAST, kv_transfer=transfer)), port)


def test_sglangs_bootstrap_protocol_sends_both_legs_at_once() -> None:
    """`pd_protocol: sglang` (issue 42): the request goes to a prefill and a decode instance in
    SGLang's `--disaggregation-mode` at once with bootstrap_host/port/room, the decode instance
    pulls the prefill's blocks at the room and answers the client (openai SDK, streamed and
    whole); the usage is the prefill's; a client's own bootstrap fields are refused."""
    prefill = [_sglang_engine(True), _sglang_engine(True)]
    decode = [_sglang_engine(False), _sglang_engine(False)]
    settings = gateway_settings(
        [e.url for e in prefill],
        decode_engines=[e.url for e in decode],
        pd_protocol="sglang",
        max_attempts=3,
    )
    gateway = start_app(create_app(settings))
    try:
        c = client(gateway)
        prompt = "SGLang's rooms." + words("pd-sglang", 600)
        first, text, decoded_at = ask(c, prompt)
        assert decoded_at in [e.url for e in decode] and len(text.split()) >= 4
        pulled = engine_of(next(e for e in decode if e.url == decoded_at)).core.counters
        assert pulled.external_tokens > 0  # it pulled the prefill's blocks at the room
        assert first.prompt_tokens_details.cached_tokens == 0
        second, _, _ = ask(c, prompt)  # prefilled where cached, billed as the prefill read it
        assert second.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // 16 * 16
        whole = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt + " again"}], max_tokens=6
        )
        assert whole.choices[0].message.content and whole.usage is not None
        for e in prefill:  # every room's blocks were read: none left held
            held = httpx.get(e.url + "/metrics").text
            assert "\nvllm:nixl_num_held_requests 0.0" in held
        with pytest.raises(openai.BadRequestError, match="bootstrap_room"):
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"bootstrap_room": 7},
            )
    finally:
        stop_all([gateway, *prefill, *decode])


def test_the_prefill_instance_is_free_once_its_leg_ends() -> None:
    """The prefill instance's lease ends with the prefill leg (issue 42): while the decode
    instance pulls (slowly here: 1.5 s), the prefill instance counts no request in flight, no
    pending prefill and no expected output. Before, it counted all three until the decode's
    first byte, and its load bound pushed the next request sharing the prefix (a continuation,
    another session on the same system prompt) off the instance that had just cached it:
    kvgate's prefill hit ratio below round robin's in `kvgate bench-pd`."""
    prefill = [_engine(PRODUCER), _engine(PRODUCER)]
    port = free_port()
    slow_pull = KVTransferConfig(
        kv_role=CONSUMER, side_channel_port=port, abort_timeout_s=1e6, pull_latency_ms=1.5e6
    )
    decode = start_app(create_engine_app(EngineConfig(timing=FAST, kv_transfer=slow_pull)), port)
    settings = gateway_settings([e.url for e in prefill], decode_engines=[decode.url])
    gateway = start_app(create_app(settings))
    try:
        c = client(gateway)
        prompt = "A shared agent prompt." + words("pd-free", 600)
        ask(c, prompt)  # cached on one prefill instance
        states = director(gateway).replicas.states
        before = [engine_of(e).core.counters.prompt_tokens for e in prefill]
        answered = threading.Event()

        def turn_two() -> None:
            ask(c, prompt + " Turn two.")
            answered.set()

        thread = threading.Thread(target=turn_two)
        thread.start()
        prefilled_at = None
        while prefilled_at is None and not answered.wait(0.005):
            after = [engine_of(e).core.counters.prompt_tokens for e in prefill]
            prefilled_at = next(
                (e.url for e, b, a in zip(prefill, before, after, strict=True) if a > b), None
            )
        assert prefilled_at is not None
        # the prefill leg ends, the decode instance pulls for 1.5 s: the load moves to it
        moved = False
        while not moved and not answered.wait(0.005):
            state, decoding = states[prefilled_at], states[decode.url]
            free = (state.num_inflight, state.pending_prefill_tokens, state.decode_tokens)
            moved = free == (0, 0.0, 0.0) and decoding.num_inflight == 1
        assert moved, "the prefill instance counted the request until the decode answered"
        assert states[decode.url].decode_tokens > 0
        thread.join()
    finally:
        stop_all([gateway, *prefill, decode])
