"""The gateway end to end: the real openai SDK against the gateway and 4 engines on loopback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, engine_of, metrics_url, slow_timing
from tests.loadgen.test_engine import metric
from tests.servers import Served, serve, wait_until

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a coding agent." + words("gw-system", 1500)}


def ask(c: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> tuple[Any, str]:
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, **extra
    )
    return raw.parse(), raw.headers["x-kvgate-replica"]


@pytest.fixture
def fleet(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> tuple[list[Served], Served]:
    engines = start_engines(4)
    return engines, start_gateway(engines)


def test_a_conversations_continuation_lands_on_the_replica_that_holds_it(
    fleet: tuple[list[Served], Served],
) -> None:
    engines, gateway = fleet
    c = client(gateway)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": words("task", 300)}]
    first, where = ask(c, messages)
    assert first.usage.engine_cached_tokens == 0  # type: ignore[union-attr]
    for turn in range(3):
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": words(f"turn{turn}", 200)},
        ]
        nxt, again = ask(c, messages)
        assert again == where
        usage = nxt.usage
        assert usage.engine_cached_tokens > 0.8 * usage.prompt_tokens  # type: ignore[union-attr]
        assert usage.prompt_tokens_details.cached_tokens == usage.engine_cached_tokens  # type: ignore[union-attr]
        first = nxt
    # the engine's own counters moved with exactly the traffic it served
    served = next(e for e in engines if e.url == where)
    assert metric(served.url, "vllm:request_success_total") == 4
    assert metric(served.url, "vllm:prefix_cache_hits_total") > 0
    others = [e for e in engines if e.url != where]
    assert all(metric(e.url, "vllm:prefix_cache_queries_total") == 0 for e in others)


def test_streaming_through_the_sdk(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    c = client(gateway)
    messages = [SYSTEM, {"role": "user", "content": "stream please"}]
    ask(c, messages)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 6
    usage = chunks[-1].usage
    assert usage is not None and usage.engine_cached_tokens > 0  # type: ignore[attr-defined]
    # without include_usage the client gets no usage chunk (the gateway asked for one upstream)
    plain = list(
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
    )
    assert all(ch.usage is None for ch in plain)
    assert all(ch.choices for ch in plain)


def test_completions_endpoint(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    c = client(gateway)
    prompt = words("completion", 400)
    c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.engine_cached_tokens > 300  # type: ignore[attr-defined]


def test_tenants_never_share_a_cache(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    messages = [SYSTEM, {"role": "user", "content": "same prompt"}]
    ask(client(gateway), messages)
    ask(client(gateway), messages)
    theirs, _ = ask(client(gateway, OTHER_KEY), messages)
    assert theirs.usage.engine_cached_tokens == 0


def _post(
    gateway: Served, body: Any, key: str | None = TENANT_KEY, path: str = "/v1/chat/completions"
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        return httpx.post(gateway.url + path, content=body, headers=headers)
    return httpx.post(gateway.url + path, json=body, headers=headers)


def test_each_error_case_has_its_status_and_message(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines, max_prompt_bytes=10_000)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[Any, str | None, int, str]] = [
        (ok, None, 401, "missing API key"),
        (ok, "sk-wrong", 401, "invalid API key"),
        (b"{not json", TENANT_KEY, 400, "malformed JSON"),
        (b"[1, 2]", TENANT_KEY, 400, "must be a JSON object"),
        ({"model": MODEL}, TENANT_KEY, 400, "'messages' must be a non-empty list"),
        ({"messages": ok["messages"]}, TENANT_KEY, 400, "'model' is required"),
        (
            {**ok, "messages": [{"role": "wizard", "content": "x"}]},
            TENANT_KEY,
            400,
            "role must be one of",
        ),
        ({**ok, "max_tokens": 0}, TENANT_KEY, 400, "'max_tokens' must be an integer >= 1"),
        ({**ok, "cache_salt": "mine"}, TENANT_KEY, 400, "'cache_salt' is set by the gateway"),
        (
            {**ok, "messages": [{"role": "user", "content": "x" * 20_000}]},
            TENANT_KEY,
            400,
            "the maximum is 10000",
        ),
        ({**ok, "model": "gpt-nope"}, TENANT_KEY, 404, "does not exist"),
    ]
    for body, key, status, message in cases:
        r = _post(gateway, body, key)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert message in error["message"], error
        assert set(error) == {"message", "type", "param", "code"}
    # an engine's own 400 (the prompt pushes the budget past the context) passes through
    # unchanged; a budget no context holds is the gateway's own (tests/e2e/test_api_edges.py)
    r = _post(gateway, {**ok, "max_tokens": 131071})
    assert r.status_code == 400 and "maximum context length" in r.text


def test_no_healthy_replica_is_a_503_and_all_failing_is_a_502(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, fail_first_bytes=100)
    gateway = start_gateway(engines)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = _post(gateway, ok)
    assert (
        r.status_code == 502 and "every attempt at an engine failed" in r.json()["error"]["message"]
    )
    for e in engines:
        e.stop()
    wait_until(lambda: not director(gateway).replicas.any_healthy(), what="replicas marked down")
    r = _post(gateway, ok)
    assert r.status_code == 503 and "no healthy" in r.json()["error"]["message"]
    assert httpx.get(gateway.url + "/readyz").status_code == 503
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_a_failure_before_the_first_byte_is_retried_on_the_next_replica(
    fleet: tuple[list[Served], Served],
) -> None:
    engines, gateway = fleet
    c = client(gateway)
    retries = director(gateway).stats.retries
    for stream in (False, True):
        messages = [SYSTEM, {"role": "user", "content": f"retry me (stream={stream})"}]
        _, home = ask(c, messages)
        holder = next(e for e in engines if e.url == home)
        engine_of(holder).num_failures_left = 1  # its next answer is a 500 before any byte
        if stream:
            chunks = list(
                c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
            )
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            reply, where = ask(c, messages)
            assert where != home and reply.choices[0].message.content
        assert engine_of(holder).num_failures_left == 0  # the holder was tried first
    assert director(gateway).stats.retries == retries + 2


def test_a_replica_that_refuses_connections_is_retried_and_marked_down(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines, health_interval_s=3600)  # only forwarding notices
    c = client(gateway)
    messages = [SYSTEM, {"role": "user", "content": "who holds me"}]
    _, home = ask(c, messages)
    next(e for e in engines if e.url == home).stop()
    reply, where = ask(c, messages)
    assert where != home and reply.choices[0].message.content
    assert not director(gateway).replicas.get(home).healthy


def test_a_replica_that_stops_answering_probes_stops_receiving_and_comes_back(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(4)
    gateway = start_gateway(engines, policy="round_robin")  # every healthy replica in turn
    c = client(gateway)
    d = director(gateway)
    messages = [{"role": "user", "content": "probe"}]
    _, home = ask(c, messages)
    holder = next(e for e in engines if e.url == home)
    app, port = holder.app, holder.port
    holder.stop()
    wait_until(lambda: not d.replicas.get(home).healthy, what="replica marked down")
    assert {ask(c, messages)[1] for _ in range(6)} == {e.url for e in engines} - {home}
    with serve(app, port):  # the same engine, back on its port
        wait_until(lambda: d.replicas.get(home).healthy, what="replica back up")
        assert {ask(c, messages)[1] for _ in range(4)} == {e.url for e in engines}


def test_v1_models_and_metrics(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    ask(client(gateway), [{"role": "user", "content": "count me"}])
    text = httpx.get(metrics_url(gateway) + "/metrics").text
    assert 'kvgate_routing_decisions_total{policy="cache_aware"' in text


def test_a_client_that_leaves_mid_stream_aborts_the_engine_request(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    slow = TimingModel(decode_s_per_token=0.02)  # 1,000 tokens would take 20 s
    engines = start_engines(1, timing=slow)
    gateway = start_gateway(engines)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 1000,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=body, headers=headers
    ) as r:
        first = next(r.iter_bytes())
        assert first.startswith(b"data: ")
    core = engine_of(engines[0]).core
    wait_until(lambda: core.counters.requests_aborted == 1, what="engine abort")
    wait_until(lambda: director(gateway).replicas.get(engines[0].url).num_inflight == 0)
    assert core.num_running == 0


@pytest.mark.parametrize(
    ("path", "stream", "before_first_token"),
    [
        ("/v1/chat/completions", True, True),
        ("/v1/chat/completions", False, True),
        ("/v1/chat/completions", False, False),
        ("/v1/messages", False, True),
    ],
)
def test_a_client_that_leaves_before_its_answer_aborts_the_engine_request(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    path: str,
    stream: bool,
    before_first_token: bool,
) -> None:
    # the client gives up after 0.5 s, and the engine must not go on computing for nobody
    engines = start_engines(1, timing=slow_timing(before_first_token))
    gateway = start_gateway(engines)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words("leaving", 2000)}],
        "max_tokens": 1000,
        "stream": stream,
    }
    headers = {"authorization": f"Bearer {TENANT_KEY}", "x-api-key": TENANT_KEY}
    core = engine_of(engines[0]).core
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + path, json=body, headers=headers, timeout=0.5)
    wait_until(lambda: core.counters.requests_aborted == 1, what="engine abort")
    assert core.counters.requests_finished == 0
    wait_until(lambda: director(gateway).replicas.get(engines[0].url).num_inflight == 0)
    if not before_first_token:  # a prefill in progress ends its step (the KV is written)
        assert core.num_running == 0
