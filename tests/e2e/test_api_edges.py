"""The API's edges, through the real openai and anthropic SDKs where they reach: unknown paths
and wrong methods in each API's error shape, output budgets and sampling numbers refused in the
gateway's words, non-JSON bodies refused, a repeated cached Anthropic request that writes
nothing, Anthropic's count_tokens, and HEAD /metrics on the admin port."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from loadgen.text import words
from tests.clients import anthropic_client, openai_client
from tests.conftest import MODEL, TENANT_KEY, metrics_url
from tests.servers import Served

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def gateway(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> Served:
    return start_gateway(start_engines(2))


def openai_shaped(r: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "detail" not in r.json()
    return error


def anthropic_shaped(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    error: dict[str, Any] = body["error"]
    return error


def test_unknown_paths_and_wrong_methods_answer_in_the_apis_shape(gateway: Served) -> None:
    nope = httpx.get(gateway.url + "/v1/nope", headers=AUTH)
    assert nope.status_code == 404 and "GET /v1/nope" in openai_shaped(nope)["message"]
    wrong = httpx.delete(gateway.url + "/v1/chat/completions", headers=AUTH)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert "use POST" in openai_shaped(wrong)["message"]
    messages = httpx.get(gateway.url + "/v1/messages", headers=AUTH)
    assert messages.status_code == 405
    assert anthropic_shaped(messages)["type"] == "invalid_request_error"
    deeper = httpx.get(gateway.url + "/v1/messages/nope", headers=AUTH)
    assert deeper.status_code == 404 and anthropic_shaped(deeper)["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError, match="no such route"):
        openai_client(gateway).get("/nope", cast_to=httpx.Response)


def test_an_output_budget_past_the_context_is_refused_in_the_gateways_words(
    gateway: Served,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**9
        )
    message = str(refused.value)
    assert "'max_tokens' is 1000000000" in message and "131072 tokens" in message
    assert "maximum context length" not in message  # the engine's own words
    # the anthropic SDK refuses so large a budget unstreamed before sending: over the wire
    body = {"model": MODEL, "max_tokens": 10**9, "messages": [{"role": "user", "content": "hi"}]}
    refused_a = httpx.post(gateway.url + "/v1/messages", json=body, headers=AUTH)
    assert refused_a.status_code == 400
    error = anthropic_shaped(refused_a)
    assert "'max_tokens' is 1000000000" in error["message"] and "engine" not in error["message"]


def test_sampling_numbers_out_of_range_are_refused(gateway: Served) -> None:
    for field, value in (("temperature", 5), ("top_p", 1.5), ("presence_penalty", -3)):
        with pytest.raises(openai.BadRequestError, match=f"'{field}' must be between"):
            openai_client(gateway).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                **{field: value},
            )
    with pytest.raises(anthropic.BadRequestError, match="'temperature' must be between 0 and 1"):
        anthropic_client(gateway).messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"temperature": 1.5},  # this SDK version types it out
        )
    ok = httpx.post(
        gateway.url + "/v1/chat/completions", json={**CHAT, "temperature": 2}, headers=AUTH
    )
    assert ok.status_code == 200  # the range's ends are in it


def test_a_body_not_declared_as_json_is_a_415(gateway: Served) -> None:
    import orjson

    raw = orjson.dumps(CHAT)
    plain = {**AUTH, "Content-Type": "text/plain"}
    refused = httpx.post(gateway.url + "/v1/chat/completions", content=raw, headers=plain)
    assert refused.status_code == 415
    assert "application/json" in openai_shaped(refused)["message"]
    refused_a = httpx.post(gateway.url + "/v1/messages", content=raw, headers=plain)
    assert refused_a.status_code == 415 and anthropic_shaped(refused_a)
    charset = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(gateway.url + "/v1/chat/completions", content=raw, headers=charset).is_success
    assert httpx.post(gateway.url + "/v1/chat/completions", content=raw, headers=AUTH).is_success


def test_a_repeated_cached_anthropic_request_writes_nothing(gateway: Served) -> None:
    c = anthropic_client(gateway)
    system: Any = [
        {"type": "text", "text": words("edges-system", 800), "cache_control": {"type": "ephemeral"}}
    ]
    messages: Any = [{"role": "user", "content": "and now?"}]
    first = c.messages.create(model=MODEL, max_tokens=2, system=system, messages=messages)
    again = c.messages.create(model=MODEL, max_tokens=2, system=system, messages=messages)
    assert first.usage.cache_creation_input_tokens and first.usage.cache_creation_input_tokens > 500
    assert again.usage.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens


def test_count_tokens_in_anthropics_shape(gateway: Served) -> None:
    c = anthropic_client(gateway)
    messages: Any = [{"role": "user", "content": words("count-me", 400)}]
    answered = c.messages.create(model=MODEL, max_tokens=2, messages=messages)
    counted = c.messages.count_tokens(model=MODEL, messages=messages)
    # the estimate learned from this tenant's answers: within 10% of what the engine counted
    assert (
        abs(counted.input_tokens - answered.usage.input_tokens) <= answered.usage.input_tokens / 10
    )
    raw = httpx.post(
        gateway.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": messages},
        headers={"x-api-key": TENANT_KEY},
    )
    assert raw.json() == {"input_tokens": counted.input_tokens}
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="no-such-model", messages=messages)
    with pytest.raises(anthropic.BadRequestError, match="unknown fields"):
        c.messages.count_tokens(model=MODEL, messages=messages, extra_body={"max_tokens": 3})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(gateway, key="sk-wrong").messages.count_tokens(
            model=MODEL, messages=messages
        )


def test_head_metrics_on_the_admin_port(gateway: Served) -> None:
    head = httpx.head(metrics_url(gateway) + "/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"].startswith("text/plain")
    assert httpx.head(gateway.url + "/metrics").status_code == 404  # never on the tenants' port
