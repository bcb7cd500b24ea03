"""The gRPC front end end to end: a real gRPC client (the generated stub over a loopback
channel) against the gateway's grpc.aio server and simulated engines; health and reflection;
and one conversation through OpenAI HTTP, Anthropic HTTP and gRPC on one replica."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import anthropic
import grpc
import httpx
import openai
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.api.grpc.convert import to_parsed
from gateway.api.grpc.service import start_grpc
from gateway.api.openai.parse import parse_chat
from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import (
    grpc_channel,
    grpc_channels,  # noqa: F401 (autouse)
)
from tests.clients import grpc_stub as stub
from tests.conftest import (
    MODEL,
    TENANT_KEY,
    engine_of,
    gateway_settings,
    metrics_url,
    slow_timing,
)
from tests.gateway.test_anthropic_convert import OPENAI
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

AUTH = (("authorization", f"Bearer {TENANT_KEY}"),)
SYSTEM_TEXT = "You are a coding agent. " + words("grpc-system", 1200)
TIMEOUT_S = 30.0


def text(role: int, value: str, **extra: Any) -> pb.Message:
    return pb.Message(role=role, content=[pb.ContentPart(text=value)], **extra)


def conversation(task: str) -> list[pb.Message]:
    return [
        text(pb.ROLE_SYSTEM, SYSTEM_TEXT, cache_control=pb.CacheControl(ttl=pb.CACHE_TTL_1H)),
        text(pb.ROLE_USER, task),
    ]


def request(messages: list[pb.Message], max_tokens: int = 8, **extra: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=extra.pop("model", MODEL),
        messages=messages,
        sampling=pb.Sampling(max_tokens=max_tokens),
        cache_control=pb.CacheControl(),
        **extra,
    )


@pytest.fixture
def fleet(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> tuple[list[Served], Served]:
    engines = start_engines(4)
    return engines, start_gateway(engines, grpc_port=0)


def replica_of(call: Any) -> str:
    return str(dict(call.initial_metadata())["x-kvgate-replica"])


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    error: Any = info.value
    return error.code(), error.details()


def test_generate_and_the_next_turn_reads_what_the_first_wrote(
    fleet: tuple[list[Served], Served],
) -> None:
    engines, gateway = fleet
    s = stub(gateway)
    messages = conversation(words("grpc-task", 300))
    first, call = s.Generate.with_call(request(messages), metadata=AUTH, timeout=TIMEOUT_S)
    where = replica_of(call)
    assert first.finish_reason == "length" and len(first.text.split()) == 8
    u = first.usage
    assert (u.prompt_tokens, u.completion_tokens, u.output_tokens) == (u.prompt_tokens, 8, 8)
    assert u.engine_cached_tokens == 0 == u.cache_read_input_tokens
    assert u.ephemeral_1h_input_tokens > 1000 and u.ephemeral_5m_input_tokens > 200
    assert u.input_tokens + u.cache_creation_input_tokens == u.prompt_tokens
    messages += [text(pb.ROLE_ASSISTANT, first.text), text(pb.ROLE_USER, "and then?")]
    # the client's W3C trace context in the metadata reaches the engine (kvgate not tracing)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    metadata = (*AUTH, ("traceparent", traceparent))
    second, call = s.Generate.with_call(request(messages), metadata=metadata, timeout=TIMEOUT_S)
    assert replica_of(call) == where
    assert engine_of(next(e for e in engines if e.url == where)).last_traceparent == traceparent
    u2 = second.usage
    assert u2.cache_read_input_tokens == u2.engine_cached_tokens > 0.95 * u.prompt_tokens
    assert u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens == (
        u2.prompt_tokens
    )
    served = next(e for e in engines if e.url == where)
    assert engine_of(served).core.counters.requests_finished == 2


def test_generate_stream(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    s = stub(gateway)
    messages = conversation(words("grpc-stream", 200))
    s.Generate(request(messages), metadata=AUTH, timeout=TIMEOUT_S)
    events = list(s.GenerateStream(request(messages, 12), metadata=AUTH, timeout=TIMEOUT_S))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and set(kinds[1:-1]) == {"text"}
    assert events[0].start.id.startswith("chatcmpl-") and events[0].start.model == MODEL
    assert len("".join(e.text for e in events[1:-1]).split()) == 12
    end = events[-1].end
    assert end.finish_reason == "length" and end.usage.output_tokens == 12
    assert end.usage.cache_read_input_tokens > 1000


def test_a_prewarm_over_grpc(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    s = stub(gateway)
    messages = conversation(words("grpc-prewarm", 100))
    warm = s.Generate(request(messages, 0), metadata=AUTH, timeout=TIMEOUT_S)
    assert warm.text == "" and warm.usage.output_tokens == 0 and warm.usage.completion_tokens == 1
    again = s.Generate(request(messages, 0), metadata=AUTH, timeout=TIMEOUT_S)
    assert again.usage.cache_read_input_tokens > 1000
    code, details = code_of(lambda: list(s.GenerateStream(request(messages, 0), metadata=AUTH)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "call Generate" in details


def test_each_error_status(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines, grpc_port=0, max_prompt_bytes=100_000, max_body_bytes=150_000)
    s = stub(gateway)
    ok = request([text(pb.ROLE_USER, "hi")], 2)
    cases: list[tuple[Any, Any, grpc.StatusCode, str]] = [
        (ok, (), grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
        (ok, (("authorization", "Bearer sk-no"),), grpc.StatusCode.UNAUTHENTICATED, "invalid"),
        (request([], 2), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "'messages' must not be empty"),
        (
            request([pb.Message(content=[pb.ContentPart(text="x")])], 2),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "role must be one of ROLE_SYSTEM",
        ),
        (
            request(
                [
                    pb.Message(
                        role=pb.ROLE_ASSISTANT,
                        tool_calls=[pb.ToolCall(name="f", arguments_json="{")],
                    )
                ],
                2,
            ),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "arguments_json is not valid JSON",
        ),
        (
            request([text(pb.ROLE_USER, "x", cache_control=pb.CacheControl())] * 5, 2),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "at most 4 cache_control breakpoints",
        ),
        (
            request([text(pb.ROLE_USER, "x" * 120_000)], 2),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "the maximum is 100000",
        ),
        # beyond the message size limit (max_body_bytes), gRPC refuses before the gateway parses
        (
            request([text(pb.ROLE_USER, "x" * 200_000)], 2),
            AUTH,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
        # the engine's own 400 (the prompt pushes the budget past the context)
        (
            request([text(pb.ROLE_USER, "hi")], 131071),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "maximum context",
        ),
        # a budget no context holds: the gateway's own words
        (
            request([text(pb.ROLE_USER, "hi")], 10**7),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "holds at most 131072 tokens",
        ),
        (
            request([text(pb.ROLE_USER, "hi")], 2, model="nope"),
            AUTH,
            grpc.StatusCode.NOT_FOUND,
            "does not exist",
        ),
    ]
    for message, metadata, code, details in cases:
        for rpc in (s.Generate, lambda *a, **k: list(s.GenerateStream(*a, **k))):
            got, said = code_of(lambda: rpc(message, metadata=metadata, timeout=TIMEOUT_S))  # noqa: B023
            assert got == code and details in said, (got, said)
    for e in engines:
        engine_of(e).num_failures_left = 100
    code, details = code_of(lambda: s.Generate(ok, metadata=AUTH, timeout=TIMEOUT_S))
    assert code == grpc.StatusCode.UNAVAILABLE and "every attempt at an engine failed" in details
    for e in engines:
        e.stop()
    director = gateway.app.state.director
    wait_until(lambda: not director.replicas.any_healthy(), what="replicas marked down")
    code, details = code_of(lambda: s.Generate(ok, metadata=AUTH, timeout=TIMEOUT_S))
    assert code == grpc.StatusCode.UNAVAILABLE and "no healthy" in details

    # /metrics counts every call the service saw by method and status (gRPC refuses an
    # oversized message itself, before the service: not counted)
    expected = Counter(
        (method, code.name)
        for _, _, code, _ in cases
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED
        for method in ("Generate", "GenerateStream")
    )
    expected[("Generate", "UNAVAILABLE")] += 2
    counted: Counter[tuple[str, str]] = Counter()
    text_ = httpx.get(metrics_url(gateway) + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text_):
        for sample in family.samples:
            if sample.name == "kvgate_grpc_requests_total":
                counted[(sample.labels["method"], sample.labels["code"])] += int(sample.value)
            if sample.name == "kvgate_grpc_request_duration_seconds_count":
                assert sample.value == sum(
                    n for (m, _), n in expected.items() if m == sample.labels["method"]
                )
    assert counted == expected


@pytest.mark.parametrize("before_first_token", [False, True])
def test_a_client_deadline_cancels_the_upstream_request(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    before_first_token: bool,
) -> None:
    engines = start_engines(1, timing=slow_timing(before_first_token))
    gateway = start_gateway(engines, grpc_port=0)
    s = stub(gateway)
    message = request([text(pb.ROLE_USER, words("deadline", 2000))], 1000)
    core = engine_of(engines[0]).core
    for rpc in (s.Generate, lambda *a, **k: list(s.GenerateStream(*a, **k))):
        aborted = core.counters.requests_aborted
        code, _ = code_of(lambda: rpc(message, metadata=AUTH, timeout=0.5))  # noqa: B023
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(
            lambda n=aborted + 1: core.counters.requests_aborted == n,
            what="engine abort",
        )
        assert core.counters.requests_finished == 0
    director = gateway.app.state.director
    wait_until(lambda: director.replicas.get(engines[0].url).num_inflight == 0)


def test_health_checking_and_reflection(fleet: tuple[list[Served], Served]) -> None:
    _, gateway = fleet
    channel = grpc_channel(gateway)
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "kvgate.v1.Gateway"):
        check = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert check.status == serving
    database = ProtoReflectionDescriptorDatabase(channel)
    assert "kvgate.v1.Gateway" in database.get_services()
    assert "grpc.health.v1.Health" in database.get_services()
    described = database.FindFileContainingSymbol("kvgate.v1.GenerateRequest")
    assert described.package == "kvgate.v1"


def test_one_conversation_through_openai_anthropic_and_grpc_lands_on_one_replica(
    fleet: tuple[list[Served], Served],
) -> None:
    engines, gateway = fleet
    task = words("cross-api", 300)
    system = "You are a coding agent. " + words("cross-system", 1200)
    oa = openai.OpenAI(base_url=gateway.url + "/v1", api_key=TENANT_KEY, max_retries=0)
    an = anthropic.Anthropic(base_url=gateway.url, api_key=TENANT_KEY, max_retries=0)
    try:
        raw = oa.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": task}],
        )
        first = raw.parse()
        where = raw.headers["x-kvgate-replica"]
        reply = first.choices[0].message.content or ""
        # turn 2 over Anthropic's API: the same conversation, plus one turn
        raw2 = an.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=8,
            system=system,
            messages=[
                {"role": "user", "content": task},
                {"role": "assistant", "content": reply},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}
                    ],
                },
            ],
        )
        second = raw2.parse()
        assert raw2.headers["x-kvgate-replica"] == where
        assert second.usage.cache_read_input_tokens > first.usage.prompt_tokens * 0.95  # type: ignore[union-attr]
    finally:
        oa.close()
        an.close()
    # turn 3 over gRPC
    messages = [
        text(pb.ROLE_SYSTEM, system),
        text(pb.ROLE_USER, task),
        text(pb.ROLE_ASSISTANT, reply),
        text(pb.ROLE_USER, "more"),
        text(pb.ROLE_ASSISTANT, second.content[0].text),
        text(pb.ROLE_USER, "and more"),
    ]
    third, call = stub(gateway).Generate.with_call(
        request(messages), metadata=AUTH, timeout=TIMEOUT_S
    )
    assert replica_of(call) == where
    assert third.usage.engine_cached_tokens > 0.95 * second.usage.cache_read_input_tokens
    served = next(e for e in engines if e.url == where)
    assert engine_of(served).core.counters.requests_finished == 3
    others = [e for e in engines if e.url != where]
    assert all(engine_of(e).core.counters.requests_finished == 0 for e in others)


def test_a_grpc_request_renders_exactly_as_its_openai_twin() -> None:
    def call(call_id: str, path: str) -> pb.ToolCall:
        return pb.ToolCall(
            id=call_id, name="read", arguments_json=orjson.dumps({"path": path}).decode()
        )

    function = OPENAI["tools"][0]["function"]
    grpc_request = pb.GenerateRequest(
        model="m",
        tools=[
            pb.Tool(
                name="read",
                description=function["description"],
                parameters_json=orjson.dumps(function["parameters"]).decode(),
                cache_control=pb.CacheControl(ttl=pb.CACHE_TTL_1H),
            )
        ],
        messages=[
            pb.Message(
                role=pb.ROLE_SYSTEM,
                content=[
                    pb.ContentPart(text="You are a coding agent. "),
                    pb.ContentPart(text="Be brief."),
                ],
            ),
            text(pb.ROLE_USER, "Fix the bug in main.py"),
            pb.Message(
                role=pb.ROLE_ASSISTANT,
                content=[pb.ContentPart(text="Reading it.", cache_control=pb.CacheControl())],
                tool_calls=[call("t1", "main.py"), call("t2", "util.py")],
            ),
            pb.Message(
                role=pb.ROLE_TOOL, tool_call_id="t1", content=[pb.ContentPart(text="print(1)")]
            ),
            pb.Message(
                role=pb.ROLE_TOOL, tool_call_id="t2", content=[pb.ContentPart(text="def f(): pass")]
            ),
            text(pb.ROLE_USER, "Go on."),
        ],
        cache_control=pb.CacheControl(),
    )
    parsed = to_parsed(grpc_request, streaming_rpc=False, max_prompt_bytes=1 << 22)
    assert parsed.rendered == parse_chat(orjson.dumps(OPENAI), 1 << 22).rendered
    tools, part, last = parsed.breakpoints
    assert tools.ttl == "1h" and part.ttl == last.ttl == "5m"
    assert parsed.rendered[: part.offset].endswith(b"Reading it.")
    assert parsed.rendered[last.offset :] == b"<|im_start|>assistant\n"
    assert parsed.body["stream"] is True  # upstream always streams: cancellation reaches it


def test_kvgate_serve_answers_grpc_beside_http_on_grpc_port() -> None:
    from loadgen.harness import processes

    grpc_port = processes.free_port()
    args = ["--tenant", f"acme:{TENANT_KEY}", "--grpc-port", str(grpc_port), "--debug-headers"]
    with (
        processes.engines(1) as procs,
        processes.gateway([procs[0].url], args),
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        check = health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        s = gateway_pb2_grpc.GatewayStub(channel)
        reply, call = s.Generate.with_call(
            request([text(pb.ROLE_USER, "hi")], 3), metadata=AUTH, timeout=TIMEOUT_S
        )
        assert len(reply.text.split()) == 3 and replica_of(call) == procs[0].url


def test_the_grpc_port_setting_is_a_port() -> None:
    from pydantic import ValidationError

    from gateway.settings import load_settings

    assert load_settings().grpc_port is None  # no gRPC unless asked
    assert load_settings(grpc_port=0).grpc_port == 0
    with pytest.raises(ValidationError, match="must be a TCP port"):
        load_settings(grpc_port=70000)


async def test_a_taken_grpc_port_is_a_clear_error(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1)
    first = start_gateway(engines, grpc_port=0)
    taken = first.app.state.grpc_port
    settings = gateway_settings([e.url for e in engines], grpc_port=taken)
    with pytest.raises(RuntimeError, match=f"Failed to bind to address 127.0.0.1:{taken}"):
        await start_grpc(settings, first.app.state.parts.front)


def test_an_engine_stream_that_breaks_is_unavailable(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1, timing=TimingModel(decode_s_per_token=0.02))
    gateway = start_gateway(engines, grpc_port=0)
    events = stub(gateway).GenerateStream(
        request([text(pb.ROLE_USER, "go")], 300), metadata=AUTH, timeout=TIMEOUT_S
    )
    assert next(events).WhichOneof("event") == "start"
    engines[0].server.should_exit = engines[0].server.force_exit = True  # the engine dies
    code, details = code_of(lambda: list(events))
    assert code == grpc.StatusCode.UNAVAILABLE and "upstream failure" in details
    for internal in ("TransferEncodingError", "400", "Payload", "http://"):  # issue 14, item 22
        assert internal not in details
