"""Billing in the running gateway: the real openai SDK against engines on loopback, the meter's
clock driven by the test (`app.state.billing.meter.clock`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.billing.pricing.clock import ManualClock
from gateway.billing.wal import read_directory
from loadgen.engine.tokenizer import count_tokens
from loadgen.text import words
from tests.billing.generate import SCENARIOS, session
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served

pytestmark = pytest.mark.e2e

ADMIN_KEY = "sk-admin-test"
TOKENIZER = "loadgen.engine.tokenizer:count_tokens"
"""The simulated engine's tokenizer: with it, block positions are exact token counts."""
GP = "<|im_start|>assistant\n"


def client(gateway: Served, key: str = TENANT_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def billed_gateway(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    **overrides: Any,
) -> tuple[Served, ManualClock]:
    engines = start_engines(2)
    values: dict[str, Any] = {
        "billing_wal_dir": tmp_path / "wal",
        "billing_model_map": {MODEL: "sonnet-5", f"openai:{MODEL}": "gpt-5.6"},
        "admin_keys": [ADMIN_KEY],
    }
    values.update(overrides)
    gateway = start_gateway(engines, **values)
    clock = ManualClock(1_000_000)
    gateway.app.state.billing.meter.clock = clock
    return gateway, clock


@pytest.fixture
def anthropic_gateway(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> Iterator[tuple[Served, ManualClock]]:
    yield billed_gateway(
        start_engines, start_gateway, tmp_path, billing_profiles={"acme": "anthropic"}
    )


def cached(text: str, ttl: str = "5m") -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}


def test_the_sliding_ttl_follows_the_meters_clock_from_request_starts(
    anthropic_gateway: tuple[Served, ManualClock],
) -> None:
    gateway, clock = anthropic_gateway
    c = client(gateway)
    messages = [{"role": "user", "content": [cached(words("v2", 3000))]}]
    usages = []
    # docs/billing.md#test-vectors, vector 2: write, read, read, a miss at 598 + 300
    for t in (0, 299, 598, 898):
        clock.set(1_000_000 + t)
        usages.append(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage)
    reads = [u.cache_read_input_tokens for u in usages]  # type: ignore[union-attr]
    writes = [u.cache_creation_input_tokens for u in usages]  # type: ignore[union-attr]
    n = usages[0].prompt_tokens  # type: ignore[union-attr]
    assert writes[0] == n and reads[1] == reads[2] == n and reads[3] == 0 and writes[3] == n
    # the engine held the prefix all along: the bill follows the contract, not the replica
    assert usages[3].engine_cached_tokens > 0  # type: ignore[union-attr]
    assert usages[3].prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    c.close()


def test_the_openai_path_reports_the_contracts_cached_tokens_whichever_replica_served(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    gateway, clock = billed_gateway(start_engines, start_gateway, tmp_path, policy="round_robin")
    c = client(gateway)
    conversation = [{"role": "user", "content": words("openai-contract", 2000)}]
    first = c.chat.completions.create(model=MODEL, messages=conversation, max_tokens=2)
    clock.advance(60)
    second = c.chat.completions.create(model=MODEL, messages=conversation, max_tokens=2)
    u1, u2 = first.usage, second.usage
    assert u1 is not None and u2 is not None
    assert u1.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert u1.prompt_tokens_details.cache_write_tokens == u1.prompt_tokens  # type: ignore[union-attr]
    # round robin sent the repeat to the other replica: a physical miss, a contractual hit
    assert u2.engine_cached_tokens == 0  # type: ignore[attr-defined]
    assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens  # type: ignore[union-attr]
    assert Decimal(u2.cost) < Decimal(u1.cost)  # type: ignore[attr-defined]
    c.close()


def test_a_streamed_responses_usage_is_billed_and_durable_before_the_client_sees_it(
    anthropic_gateway: tuple[Served, ManualClock], tmp_path: Path
) -> None:
    gateway, _ = anthropic_gateway
    c = client(gateway)
    messages = [{"role": "system", "content": [cached(words("stream", 2000))]}]
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[*messages, {"role": "user", "content": "go"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            # the record is on disk by the time this chunk arrives
            ids = {r["id"] for r in read_directory(tmp_path / "wal")}
            assert usage.kvgate_billing["id"] in ids  # type: ignore[attr-defined]
    assert usage is not None
    assert usage.cache_creation_input_tokens > 0  # type: ignore[attr-defined]
    assert usage.input_tokens > 0  # type: ignore[attr-defined]  (after the breakpoint)
    assert usage.cache_creation_input_tokens + usage.input_tokens == usage.prompt_tokens  # type: ignore[attr-defined]
    c.close()


@pytest.mark.parametrize(
    ("messages_extra", "error"),
    [
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "valid: 5m, 1h"),
        ({"cache_control": "yes"}, "cache_control must be"),
    ],
)
def test_bad_marks_are_400s_that_name_the_rule(
    anthropic_gateway: tuple[Served, ManualClock], messages_extra: dict[str, Any], error: str
) -> None:
    gateway, _ = anthropic_gateway
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi", **messages_extra}],
    }
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert response.status_code == 400
    assert error in response.json()["error"]["message"]


def test_breakpoint_limits_are_400s(anthropic_gateway: tuple[Served, ManualClock]) -> None:
    gateway, _ = anthropic_gateway
    c = client(gateway)
    five = [cached(words(f"bp{i}", 10)) for i in range(5)]
    with pytest.raises(openai.BadRequestError, match="at most 4 are allowed"):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": five}], max_tokens=2
        )
    order = [cached(words("a", 10), "5m"), cached(words("b", 10), "1h")]
    with pytest.raises(openai.BadRequestError, match="must come before"):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": order}], max_tokens=2
        )
    c.close()


# -- the 50-step agent session (docs/billing.md#agent-session) through the gateway --------------
def _piece(role: str | None, content: str, gp: bool) -> str:
    head = f"<|im_start|>{role}\n" if role else ""
    return head + content + "<|im_end|>\n" + (GP if gp else "")


@functools.cache
def exact_text(seed: str, role: str | None, target: int, gp: bool) -> str:
    """Content whose rendered block is exactly `target` simulated tokens (each single-token word
    adds exactly one; plain user and assistant turns render the same in the engine's template
    and in the gateway's canonical rendering, so the counts agree on both sides)."""
    overhead = count_tokens(_piece(role, words(seed, 1) + "\n", gp)) - 1
    content = words(seed, target - overhead) + "\n"
    assert count_tokens(_piece(role, content, gp)) == target
    return content


def session_messages(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The session's segments as chat messages whose blocks have exactly the segments' tokens:
    the task and each tool result are user messages (their blocks own the generation prompt),
    each output an assistant message; the last segment's cache mark goes on its message."""
    messages = []
    for segment in segments:
        output = segment["id"].startswith("output")
        role = "assistant" if output else "user"
        text = exact_text(segment["id"], None if output else role, segment["tokens"], not output)
        message: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": text}]}
        if "cache_control" in segment:
            message["content"][0]["cache_control"] = {
                "type": "ephemeral",
                "ttl": segment["cache_control"]["ttl"],
            }
        messages.append(message)
    return messages


@pytest.mark.parametrize(("scenario", "exact"), [("warm_5m", "0.88415"), ("1h", "1.0124")])
def test_the_50_step_session_through_the_gateway(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    scenario: str,
    exact: str,
) -> None:
    """The chat API's `cache_control` parts at both TTLs (the other scenarios differ in the
    meter, not the front end: they run through the Messages API below, and every scenario runs
    on the meter alone in tests/billing/test_vectors.py). The pings scenario needs max_tokens 0,
    which only the Anthropic Messages API accepts."""
    gateway, clock = billed_gateway(
        start_engines,
        start_gateway,
        tmp_path,
        billing_profiles={"acme": "anthropic"},
        billing_tokenizer=TOKENIZER,
    )
    c = client(gateway)
    total = Decimal(0)
    steps = session(**SCENARIOS[scenario])
    for step in steps:
        clock.set(1_000_000 + step["t"])
        response = c.chat.completions.create(
            model=MODEL, messages=session_messages(step["segments"]), max_tokens=step["max_tokens"]
        )
        usage = response.usage
        assert usage is not None and usage.completion_tokens == step["output_tokens"]
        assert usage.prompt_tokens == sum(s["tokens"] for s in step["segments"])
        total += Decimal(usage.cost)  # type: ignore[attr-defined]
    assert str(total) == exact
    assert len(steps) == 50
    c.close()


@pytest.mark.parametrize(
    ("scenario", "exact"),
    [
        ("uncached", "5.075"),
        ("warm_5m", "0.88415"),
        ("expiries", "1.87775"),
        ("1h", "1.0124"),
        ("pings", "0.97055"),
    ],
)
def test_the_50_step_session_through_the_messages_api(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    scenario: str,
    exact: str,
) -> None:
    """The real anthropic SDK against /v1/messages, the meter's clock driven by the test: billed
    exactly as `kvgate billing simulate` prices the same session (pings included: max_tokens 0,
    the Messages front end handing the director a body the chat API would refuse)."""
    import anthropic

    gateway, clock = billed_gateway(
        start_engines,
        start_gateway,
        tmp_path,
        billing_profiles={"acme": "anthropic"},
        billing_tokenizer=TOKENIZER,
    )
    c = anthropic.Anthropic(base_url=gateway.url, api_key=TENANT_KEY, max_retries=0)
    total = Decimal(0)
    pings = 0
    steps = session(**SCENARIOS[scenario])
    for step in steps:
        clock.set(1_000_000 + step["t"])
        messages = session_messages(step["segments"])
        reply = c.messages.create(
            model=MODEL,
            max_tokens=step["max_tokens"],
            messages=messages,  # type: ignore[arg-type]
        )
        usage = reply.usage
        assert usage.output_tokens == step["output_tokens"]
        prompt = sum(s["tokens"] for s in step["segments"])
        read = usage.cache_read_input_tokens or 0
        written = usage.cache_creation_input_tokens or 0
        assert usage.input_tokens + read + written == prompt
        if step["max_tokens"] == 0:  # a ping: nothing generated, the whole prompt read
            pings += 1
            assert read == prompt and written == usage.input_tokens == 0
        total += Decimal(str(usage.model_extra["cost"]))  # type: ignore[index]
    assert str(total) == exact
    assert len(steps) == (59 if scenario == "pings" else 50)
    assert pings == (9 if scenario == "pings" else 0)
    c.close()


def test_held_fan_out_siblings_read_what_their_leader_wrote(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    """docs/billing.md vector 7, "waiting", live: three identical requests sent together; the
    gateway holds the two later ones until the first one's first token. A held request's clock
    starts at its release, so each reads the entry its leader wrote: one write and three reads
    (r4 comes later), IET = 1.25·N + 3·0.1·N. Before: the clock started before the hold, the
    siblings were billed as writes of their own (3.75·N + 0.1·N)."""
    import asyncio

    from loadgen.engine.timing import TimingModel

    engines = start_engines(2, timing=TimingModel(prefill_tokens_per_s=6_500))
    gateway = start_gateway(
        engines,
        engine_prefill_tokens_per_s=6_500,
        billing_wal_dir=tmp_path / "wal",
        billing_model_map={MODEL: "sonnet-5"},
        billing_profiles={"acme": "anthropic"},
    )
    messages = [{"role": "user", "content": [cached(words("v7-live", 3000))]}]

    async def together() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key=TENANT_KEY, max_retries=0
        ) as c:
            return await asyncio.gather(
                *(
                    c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
                    for _ in range(3)
                )
            )

    usages = [r.usage for r in asyncio.run(together())]
    flights = gateway.app.state.director.placement.flights
    assert flights.stats.holds == 2 and flights.stats.released_landed == 2
    r4 = client(gateway).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    usages.append(r4.usage)
    n = usages[0].prompt_tokens
    writes = sorted(u.cache_creation_input_tokens for u in usages)  # type: ignore[union-attr]
    reads = sorted(u.cache_read_input_tokens for u in usages)  # type: ignore[union-attr]
    assert writes == [0, 0, 0, n] and reads == [0, n, n, n]
    iet = sum(Decimal(r["iet"]) for r in read_directory(tmp_path / "wal"))
    assert iet == Decimal("1.25") * n + 3 * Decimal("0.1") * n  # 15,500 at N = 10,000


def test_the_live_ledger_keeps_to_its_configured_bound(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    """billing_ledger_max_entries bounds what the meter keeps (issue 14, item 24): distinct
    prompts past the bound drop the soonest-expiring entries; the latest stay readable."""
    gateway, clock = billed_gateway(
        start_engines, start_gateway, tmp_path, billing_ledger_max_entries=16
    )
    c = client(gateway)
    for i in range(48):
        clock.advance(1)
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(f"bound-{i}", 1200)}],
            max_tokens=2,
        )  # fmt: skip
    ledger = gateway.app.state.billing.meter.ledgers["openai"]
    assert ledger.num_entries() <= 17 and ledger.num_evicted > 0
    clock.advance(1)
    again = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": words("bound-47", 1200)}],
        max_tokens=2,
    )  # fmt: skip
    assert again.usage is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    c.close()
