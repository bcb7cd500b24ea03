"""`POST /v1/messages` end to end: the real `anthropic` SDK against the gateway and simulated
engines on loopback; and the stream translator's events folded by the SDK's own accumulator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from gateway.api.anthropic.routes import StreamTranslator
from gateway.request.parsed import CHAT, ParsedRequest
from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import anthropic_client as client
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, engine_of
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

CACHED = {"type": "ephemeral"}
SYSTEM = [
    {
        "type": "text",
        "text": "You are a coding agent. " + words("anthropic-system", 1200),
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
]
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


@pytest.fixture
def fleet(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> tuple[list[Served], Served]:
    engines = start_engines(4)
    return engines, start_gateway(engines)


def user(text: str, cache: bool = True) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text}
    if cache:
        block["cache_control"] = CACHED
    return {"role": "user", "content": [block]}


def create(c: anthropic.Anthropic, messages: list[dict[str, Any]], **extra: Any) -> Any:
    extra.setdefault("max_tokens", 8)
    raw = c.messages.with_raw_response.create(
        model=MODEL, system=SYSTEM, tools=TOOLS, messages=messages, **extra
    )
    return raw.parse(), raw.headers["x-kvgate-replica"]


def test_the_second_turn_reads_what_the_first_wrote(fleet: tuple[list[Served], Served]) -> None:
    engines, gateway = fleet
    c = client(gateway)
    messages = [user(words("task", 300))]
    first, where = create(c, messages)
    assert first.type == "message" and first.role == "assistant"
    assert first.stop_reason == "max_tokens" and len(first.content[0].text.split()) == 8
    u = first.usage
    assert u.cache_read_input_tokens == 0 and u.engine_cached_tokens == 0  # type: ignore[attr-defined]
    # the whole prompt up to the last breakpoint was written: the system prompt at 1h, the rest 5m
    assert u.cache_creation.ephemeral_1h_input_tokens > 1000
    assert u.cache_creation.ephemeral_5m_input_tokens > 200
    assert u.cache_creation_input_tokens == (
        u.cache_creation.ephemeral_1h_input_tokens + u.cache_creation.ephemeral_5m_input_tokens
    )
    assert 0 < u.input_tokens < 10  # only the generation prompt follows the last breakpoint
    assert u.output_tokens == 8
    messages += [
        {"role": "assistant", "content": first.content[0].text},
        user(words("next", 100)),
    ]
    second, again = create(c, messages)
    assert again == where
    u2 = second.usage
    assert u2.cache_read_input_tokens > first.usage.cache_creation_input_tokens * 0.95
    assert u2.cache_read_input_tokens == u2.engine_cached_tokens  # type: ignore[attr-defined]
    assert u2.cache_creation.ephemeral_1h_input_tokens == 0  # the 1h prefix was read, not written
    assert 0 < u2.cache_creation.ephemeral_5m_input_tokens < 200
    served = next(e for e in engines if e.url == where)
    assert engine_of(served).core.counters.requests_finished == 2


def test_streaming_through_the_sdk(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    c = client(gateway)
    messages = [user(words("stream-task", 200))]
    first, _ = create(c, messages)
    prompt_tokens = (
        first.usage.input_tokens
        + first.usage.cache_read_input_tokens
        + first.usage.cache_creation_input_tokens
    )
    with c.messages.stream(
        model=MODEL, system=SYSTEM, tools=TOOLS, messages=messages, max_tokens=12
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    assert "message_delta" in kinds and kinds.count("content_block_start") == 1
    assert len(final.content[0].text.split()) == 12 and final.stop_reason == "max_tokens"
    # the SDK folded message_delta's cumulative usage into the final message
    u = final.usage
    assert u.cache_read_input_tokens is not None and u.cache_read_input_tokens > 1000
    assert u.output_tokens == 12
    assert u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0) == (
        prompt_tokens
    )


def test_the_key_from_x_api_key_or_bearer_and_errors_in_anthropics_shape(
    fleet: tuple[list[Served], Served],
) -> None:
    _, gateway = fleet
    body = {"model": MODEL, "max_tokens": 2, "messages": [user("hi", cache=False)]}
    url = gateway.url + "/v1/messages"
    assert httpx.post(url, json=body, headers={"x-api-key": TENANT_KEY}).status_code == 200
    bearer = {"authorization": f"Bearer {TENANT_KEY}"}
    assert httpx.post(url, json=body, headers=bearer).status_code == 200
    cases: list[tuple[Any, dict[str, str], int, str, str]] = [
        (body, {}, 401, "authentication_error", "send it as 'x-api-key: KEY'"),
        (body, {"x-api-key": "sk-wrong"}, 401, "authentication_error", "invalid API key"),
        (b"{nope", bearer, 400, "invalid_request_error", "malformed JSON"),
        (
            {**body, "max_tokens": 0, "stream": True},
            bearer,
            400,
            "invalid_request_error",
            "pre-warm",
        ),
        ({**body, "model": "nope"}, bearer, 404, "not_found_error", "does not exist"),
        # a budget no context holds: the gateway's own 400 (tests/e2e/test_api_edges.py)
        ({**body, "max_tokens": 10**7}, bearer, 400, "invalid_request_error", "holds at most"),
        # one that only the prompt pushes past the context: the engine's 400, in Anthropic's shape
        ({**body, "max_tokens": 131071}, bearer, 400, "invalid_request_error", "maximum context"),
    ]
    for payload, headers, status, kind, message in cases:
        if isinstance(payload, bytes):
            r = httpx.post(url, content=payload, headers=headers)
        else:
            r = httpx.post(url, json=payload, headers=headers)
        assert r.status_code == status, r.text
        answer = r.json()
        assert answer["type"] == "error" and answer["error"]["type"] == kind
        assert message in answer["error"]["message"], answer
    with pytest.raises(anthropic.AuthenticationError):
        client(gateway, "sk-wrong").messages.create(model=MODEL, max_tokens=2, messages=[user("x")])
    with pytest.raises(anthropic.BadRequestError, match="at most 4"):
        client(gateway).messages.create(
            model=MODEL, max_tokens=2, messages=[user("x") for _ in range(5)]
        )


def test_a_prewarm_reads_and_refreshes_the_cache_and_generates_nothing(
    fleet: tuple[list[Served], Served],
) -> None:
    engines, gateway = fleet
    c = client(gateway)
    messages = [user(words("prewarm", 300))]
    warm, where = create(c, messages, max_tokens=0)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0 and warm.usage.cache_creation_input_tokens > 1000
    served = next(e for e in engines if e.url == where)
    counters = engine_of(served).core.counters
    assert counters.generation_tokens == 1  # one token generated upstream, and discarded
    again, there = create(c, messages, max_tokens=0)
    assert there == where and again.usage.cache_read_input_tokens > 1000
    # the engine recomputes the prompt's last block (16 tokens), as vLLM does, but the prefix
    # up to the breakpoint was cached whole: Anthropic reports nothing written for it
    assert again.usage.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens == warm.usage.cache_creation_input_tokens


def test_the_tenant_salt_isolates_anthropic_requests_too(
    fleet: tuple[list[Served], Served],
) -> None:
    _, gateway = fleet
    messages = [user("the same prompt")]
    create(client(gateway), messages)
    mine, _ = create(client(gateway), messages)
    theirs, _ = create(client(gateway, OTHER_KEY), messages)
    assert mine.usage.cache_read_input_tokens > 1000
    assert theirs.usage.cache_read_input_tokens == 0 == theirs.usage.engine_cached_tokens


def test_a_client_that_leaves_mid_stream_aborts_the_engine_request(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, timing=TimingModel(decode_s_per_token=0.02))
    gateway = start_gateway(engines)
    body = {"model": MODEL, "max_tokens": 1000, "stream": True, "messages": [user("go")]}
    headers = {"x-api-key": TENANT_KEY}
    with httpx.stream("POST", gateway.url + "/v1/messages", json=body, headers=headers) as r:
        first = next(r.iter_bytes())
        assert first.startswith(b"event: message_start")
    core = engine_of(engines[0]).core
    wait_until(lambda: core.counters.requests_aborted == 1, what="engine abort")
    director = gateway.app.state.director
    wait_until(lambda: director.replicas.get(engines[0].url).num_inflight == 0)


def _fold(events: bytes) -> Any:
    """Feed SSE bytes to the SDK's own accumulator, as `MessageStream` does."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for raw in events.split(b"\n\n"):
        if not raw:
            continue
        kind, data = raw.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert kind == b"event: " + event["type"].encode()
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


def test_tool_calls_stream_as_tool_use_blocks_the_sdk_parses() -> None:
    parsed = ParsedRequest(CHAT, MODEL, {"stop": ["END"]}, b"x" * 400, True, True)
    translator = StreamTranslator(parsed)
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def call(index: int, fragment: str, **first: str) -> dict[str, Any]:
        function = {"arguments": fragment, **({"name": first["name"]} if first else {})}
        return {"index": index, **({"id": first["id"]} if first else {}), "function": function}

    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me look."}),
        chunk({"tool_calls": [call(0, '{"pa', id="c1", name="read_file")]}),
        chunk({"tool_calls": [call(0, 'th": "a.py"}')]}),
        chunk({"tool_calls": [call(1, '{"path": "b.py"}', id="c2", name="read_file")]}),
        chunk({}, "tool_calls"),
        {**head, "choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 9}},
    ]
    events = b"".join(b"".join(translator.chunk(c)) for c in chunks) + b"".join(translator.finish())
    message = _fold(events)
    assert message.id == "msg_chatcmpl-1" and message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me look."
    assert (message.content[1].id, message.content[1].input) == ("c1", {"path": "a.py"})
    assert (message.content[2].id, message.content[2].input) == ("c2", {"path": "b.py"})
    assert (message.usage.input_tokens, message.usage.output_tokens) == (100, 9)
    # a matched stop sequence is reported as one
    stopped = StreamTranslator(parsed)
    events = b"".join(stopped.chunk(chunk({"content": "done"})))
    stop_choice = {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}
    events += b"".join(stopped.chunk({**head, "choices": [stop_choice]}))
    events += b"".join(stopped.finish())
    message = _fold(events)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")


def test_an_engine_stream_that_breaks_ends_with_an_error_event(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, timing=TimingModel(decode_s_per_token=0.02))
    gateway = start_gateway(engines)
    body = {"model": MODEL, "max_tokens": 300, "stream": True, "messages": [user("go")]}
    headers = {"x-api-key": TENANT_KEY}
    url = gateway.url + "/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        chunks = r.iter_bytes()
        assert next(chunks).startswith(b"event: message_start")
        engines[0].server.should_exit = engines[0].server.force_exit = True  # the engine dies
        rest = b"".join(chunks)
    last = rest.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    kind, data = last.split(b"\n")
    assert kind == b"event: error"
    error = orjson.loads(data.removeprefix(b"data: "))
    message = error["error"]["message"]
    assert error["error"]["type"] == "api_error" and "upstream failure" in message
    for internal in ("TransferEncodingError", "400", "Payload", "http://"):  # issue 14, item 22
        assert internal not in message
    assert b"message_stop" not in rest
