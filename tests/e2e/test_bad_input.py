"""Bad input on every front end: a clear 4xx (or gRPC status), never a 500, never a hang.

Fields the gateway does not forward, JSON nested too deep, bodies over the limit, uploads that
stall, clients that leave before the answer; and the last resort: an unexpected exception is a
logged 500 with a request id, never a stack trace."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from tests.clients import director, grpc_channels  # noqa: F401 (autouse)
from tests.clients import grpc_stub as stub
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

AUTH = {"authorization": f"Bearer {TENANT_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(gateway: Served, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes | Iterator) else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(gateway.url + path, content=content, headers=headers, timeout=30, **kwargs)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture
def gateway(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> Served:
    return start_gateway(start_engines(1), grpc_port=0)


def grpc_request(**extra: Any) -> pb.GenerateRequest:
    messages = extra.pop(
        "messages", [pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])]
    )
    return pb.GenerateRequest(
        model=MODEL, messages=messages, sampling=pb.Sampling(max_tokens=2), **extra
    )


def grpc_error(call: Callable[..., Any], request: pb.GenerateRequest) -> tuple[Any, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call(request, metadata=tuple(AUTH.items()), timeout=30)
        list(result) if not isinstance(result, pb.GenerateResponse) else None
    error: Any = info.value
    return error.code(), error.details()


# -- item 3: an allow-list of forwarded fields ---------------------------------------------------
@pytest.mark.parametrize("field", ["kv_transfer_params", "priority", "vllm_xargs", "request_id"])
@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_engine_control_fields_are_refused_by_name(
    gateway: Served, path: str, body: dict[str, Any], field: str
) -> None:
    value: Any = {"remote_block_ids": [1, 2]} if field != "priority" else -100
    r = post(gateway, path, {**body, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]


def test_unknown_fields_are_refused_and_the_safe_extras_forwarded(gateway: Served) -> None:
    r = post(gateway, "/v1/chat/completions", {**CHAT, "frobnicate": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    assert "docs/api.md" in r.json()["error"]["message"]
    extras = {
        "ignore_eos": True,
        "min_tokens": 1,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "stop_token_ids": [2],
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "seed": 3,
        "logprobs": False,
        "stop": ["\n\n"],
    }
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        r = post(gateway, path, {**body, **extras, "user": "u1", "stream": False})
        assert r.status_code == 200, r.text


# -- item 7: JSON nested too deep ----------------------------------------------------------------
def test_json_nested_too_deep_is_a_400_on_every_http_front_end(gateway: Served) -> None:
    arguments = "[" * 3000 + "]" * 3000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    deep_part = {"type": "data", "data": nested(300)}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(300, {})}}
    cases: list[tuple[str, dict[str, Any]]] = [
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "assistant", "tool_calls": [call]}, *CHAT["messages"]]},
        ),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [deep_part]}]}),
        ("/v1/chat/completions", {**CHAT, "tools": [tool]}),
        ("/v1/chat/completions", {**CHAT, "metadata": {"x": nested(300)}}),
        ("/v1/completions", {**COMPLETION, "logit_bias": nested(300)}),
        (
            "/v1/messages",
            {
                **MESSAGES,
                "tools": [{"name": "f", "input_schema": {"type": "object", "p": nested(300)}}],
            },
        ),
        (
            "/v1/messages",
            {
                **MESSAGES,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "tool_use",
                                "id": "t",
                                "name": "f",
                                "input": {"a": nested(300)},
                            }
                        ],
                    },
                    *MESSAGES["messages"],
                ],
            },
        ),
    ]
    for path, body in cases:
        r = post(gateway, path, body)
        assert r.status_code == 400, (path, r.text[:300])
        assert "nest" in r.text, r.text[:300]


def test_json_nested_too_deep_is_invalid_argument_over_grpc(gateway: Served) -> None:
    s = stub(gateway)
    call = pb.ToolCall(id="c1", name="f", arguments_json="[" * 3000 + "]" * 3000)
    assistant = pb.Message(role=pb.ROLE_ASSISTANT, tool_calls=[call])
    user = pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])
    deep_schema = json.dumps({"type": "object", "p": nested(300)})
    requests = [
        grpc_request(messages=[assistant, user]),
        grpc_request(tools=[pb.Tool(name="f", parameters_json=deep_schema)]),
    ]
    for request in requests:
        for method in (s.Generate, s.GenerateStream):
            code, details = grpc_error(method, request)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "nest" in details


# -- item 7: the last resort -----------------------------------------------------------------------
def test_an_unexpected_exception_is_a_logged_500_with_a_request_id_on_every_front_end(
    gateway: Served, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(parsed: ParsedRequest, tenant: Tenant) -> ParsedRequest:
        raise RuntimeError("a bug deep inside the gateway: secret-internal-detail")

    director(gateway).request_hooks.append(broken)
    caplog.set_level(logging.ERROR)
    seen: list[str] = []
    for path, body, kind in (
        ("/v1/chat/completions", CHAT, "openai"),
        ("/v1/completions", COMPLETION, "openai"),
        ("/v1/messages", MESSAGES, "anthropic"),
    ):
        r = post(gateway, path, body)
        assert r.status_code == 500, r.text
        assert "secret-internal-detail" not in r.text and "Traceback" not in r.text
        error = r.json()["error"]
        message = error["message"]
        assert error["type"] == "api_error"
        if kind == "anthropic":
            assert r.json()["type"] == "error"
        request_id = r.headers["x-request-id"]
        assert request_id in message
        seen.append(request_id)
    s = stub(gateway)
    for method in (s.Generate, s.GenerateStream):
        code, details = grpc_error(method, grpc_request())
        assert code == grpc.StatusCode.INTERNAL, details
        assert "secret-internal-detail" not in details
        seen.append(details.rsplit(" ", 1)[-1].rstrip(")"))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for request_id in seen:  # each one logged with its id (and the traceback)
        assert request_id in logged, (request_id, logged[-2000:])
    assert len(set(seen)) == len(seen)


# -- item 8: the body limit, enforced while reading ------------------------------------------------
def raw_http(port: int, head: bytes, body: bytes = b"", read_timeout_s: float = 10.0) -> bytes:
    """Send a request's head and part of its body on a raw socket; what the gateway answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s) as sock:
        sock.sendall(head + body)
        chunks = []
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
                if b"\r\n\r\n" in b"".join(chunks) and b"}" in data:
                    break
        except TimeoutError:
            pass
        return b"".join(chunks)


def head(path: str, length: int | None, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: gateway", f"authorization: Bearer {TENANT_KEY}"]
    lines.append("content-type: application/json")
    lines.append(
        f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


BILLING = "/v1/cached_contents"
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", BILLING)


def test_a_body_over_the_limit_is_a_413_before_it_is_read_on_every_http_route(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    gateway = start_gateway(
        start_engines(1),
        max_body_bytes=100_000,
        max_prompt_bytes=50_000,
        billing_wal_dir=tmp_path / "wal",
        billing_profiles={"acme": "google_explicit"},
    )
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}
    for path in PATHS:
        # declared 50 MB, 1 kB sent: refused at once, without waiting for the rest
        started = time.monotonic()
        answer = raw_http(gateway.port, head(path, 50_000_000), b"{" + b" " * 1000)
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
        assert b"100000" in answer
        assert time.monotonic() - started < 5
        # chunked (no length declared): refused once what arrived passes the limit
        r = post(gateway, path, iter([orjson.dumps(big)]))
        assert r.status_code == 413, (path, r.text[:200])
        if path == "/v1/messages":
            assert r.json()["error"]["type"] == "request_too_large"
        else:
            assert r.json()["error"]["code"] == "body_too_large"
    assert post(gateway, "/v1/chat/completions", CHAT).status_code == 200


def test_a_grpc_message_over_the_body_limit_is_resource_exhausted(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(
        start_engines(1), grpc_port=0, max_body_bytes=100_000, max_prompt_bytes=100_000
    )
    text = pb.ContentPart(text="x" * 150_000)
    code, details = grpc_error(
        stub(gateway).Generate,
        grpc_request(messages=[pb.Message(role=pb.ROLE_USER, content=[text])]),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details


# -- item 24: slow uploads and clients that leave -----------------------------------------------
def test_a_stalled_upload_gets_a_408_at_the_deadline(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1), body_read_timeout_s=0.5)
    for path in ("/v1/chat/completions", "/v1/messages"):
        started = time.monotonic()
        answer = raw_http(gateway.port, head(path, 1000), b'{"model": ')  # 10 of 1,000 bytes
        elapsed = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), (path, answer[:200])
        assert 0.4 < elapsed < 5, elapsed
    # the refusals are logged by the server's thread after the answer: the test ends once both
    # are counted (logged first), not while a line is still on its way to a closed capture
    counts = gateway.app.state.request_metrics.http
    wait_until(
        lambda: all(
            counts.get((p, "408"), 0) == 1 for p in ("/v1/chat/completions", "/v1/messages")
        ),
        what="both refusals counted",
    )


def test_a_client_that_leaves_before_the_answer_is_counted_as_a_disconnect(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1))
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(head("/v1/chat/completions", 1000) + b'{"model": ')
    counts = gateway.app.state.request_metrics.http
    wait_until(
        lambda: counts.get(("/v1/chat/completions", "499"), 0) == 1, what="the disconnect counted"
    )
    assert counts.get(("/v1/chat/completions", "500"), 0) == 0
