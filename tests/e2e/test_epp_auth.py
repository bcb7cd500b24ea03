"""The picker's port as a hostile client reaches it (issue 45 item 11): only Envoy, holding the
shared token (`epp_token`, sent as `grpc_service.initial_metadata`), may open an ext-proc
stream; a tenant is authenticated on the headers; the buffered body is bounded in total."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import httpx
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from gateway.api.epp.service import Conversation
from loadgen.harness.envoy import Envoy, EnvoySetup, envoy
from tests.conftest import MODEL, TENANT_KEY, engine_of
from tests.e2e.test_epp import endpoint, start_stack
from tests.e2e.test_precise import parts_of
from tests.servers import Served

pytestmark = pytest.mark.e2e
__all__ = ["start_stack"]  # the fixture, used by name

TOKEN = "envoy-only-4c1f"
ANSWER_TIMEOUT_S = 5.0
"""A first answer comes in milliseconds; 5 s means none is coming."""


def headers(key: str = TENANT_KEY, path: str = "/v1/chat/completions") -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": path, "authorization": f"Bearer {key}"}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            )
        )
    )


def body(data: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def chat_body(content: str = "hello") -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})


def first_answer(
    port: int, messages: Sequence[pb.ProcessingRequest], token: str | None = None
) -> pb.ProcessingResponse:
    """The picker's first answer to a stream of `messages` from a client of our own (its
    status, raised, when the picker ends the stream instead)."""
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        answers = stub.Process(iter(messages), metadata=metadata, timeout=ANSWER_TIMEOUT_S)
        try:
            answer = next(answers)
        finally:
            answers.cancel()
    assert isinstance(answer, pb.ProcessingResponse), answer
    return answer


def decisions(gateway: Served) -> int:
    return sum(gateway.app.state.director.stats.decisions.values())


def test_a_forged_client_without_the_token_is_refused_before_it_is_read(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines, mode="epp", epp_port=0, epp_token=TOKEN)
    port = gateway.app.state.epp_port
    request = [headers(), body(chat_body(), end=True)]
    for token in (None, "guess"):
        with pytest.raises(grpc.RpcError) as refused:
            first_answer(port, request, token)
        assert refused.value.code()  # type: ignore[attr-defined] == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in (refused.value.details() or "")  # type: ignore[attr-defined]
    assert decisions(gateway) == 0  # nothing was parsed, admitted or routed
    # Envoy's token: the stream is served as before
    answer = first_answer(port, request, TOKEN)
    assert answer.WhichOneof("response") == "request_headers", answer
    assert decisions(gateway) == 1


def test_an_unknown_key_is_refused_on_the_headers_before_any_body(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1)
    gateway = start_gateway(engines, mode="epp", epp_port=0)
    answer = first_answer(gateway.app.state.epp_port, [headers(key="sk-nobody")])
    assert answer.immediate_response.status.code == 401, answer


def test_a_body_over_max_body_bytes_in_total_is_refused_while_it_streams(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1)
    limit = 64 * 1024
    gateway = start_gateway(
        engines, mode="epp", epp_port=0, max_prompt_bytes=limit // 2, max_body_bytes=limit
    )
    chunk = b" " * (16 * 1024)  # each message is small; five of them are over the limit
    stream = [headers()] + [body(chunk, end=False) for _ in range(5)]
    answer = first_answer(gateway.app.state.epp_port, stream)
    refusal = answer.immediate_response
    assert refusal.status.code == 413, answer
    assert orjson.loads(refusal.body)["error"]["code"] == "body_too_large"
    assert decisions(gateway) == 0
    # a body within the limit is picked as before
    answer = first_answer(gateway.app.state.epp_port, [headers(), body(chat_body(), end=True)])
    assert answer.WhichOneof("response") == "request_headers", answer


def test_envoy_sends_the_token_as_initial_metadata_and_without_it_fails_closed(
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    engines, gateway, proxy = start_stack(
        engines=None, envoy_options={"picker_token": TOKEN}, epp_token=TOKEN
    )
    request: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=request, headers=auth)
    assert r.status_code == 200, r.text
    served = sum(len(engine_of(e).seen_headers) for e in engines)
    assert served == 1
    # an Envoy without the token: its streams are refused and the request fails closed
    setup = EnvoySetup(gateway.app.state.epp_port, [endpoint(e) for e in engines])
    with envoy(setup) as bare:
        bare.wait_picker(healthy=True)  # gRPC health is open: only ext-proc streams need it
        r = httpx.post(bare.url + "/v1/chat/completions", json=request, headers=auth)
        assert r.status_code >= 500, r.text
    assert sum(len(engine_of(e).seen_headers) for e in engines) == served


class Recorder:
    """The stream's write side, kept: what the picker sent."""

    def __init__(self) -> None:
        self.sent: list[pb.ProcessingResponse] = []

    async def write(self, message: pb.ProcessingResponse) -> None:
        self.sent.append(message)


def test_nothing_of_the_request_is_kept_after_the_pick(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1), mode="epp", epp_port=0)
    front = parts_of(gateway).front

    async def converse() -> tuple[int, list[str]]:
        recorder = Recorder()
        conversation = Conversation(front, recorder, 30.0)
        await conversation.handle(headers())
        await conversation.handle(body(chat_body(), end=True))
        for _ in range(3):  # chunks after the pick: a confused or hostile sender
            await conversation.handle(body(b"x" * 4096, end=False))
        kept = len(conversation.body)
        await conversation.close(None)
        return kept, [m.WhichOneof("response") for m in recorder.sent]

    loop = gateway.server.servers[0].get_loop()
    kept, answers = asyncio.run_coroutine_threadsafe(converse(), loop).result(10)
    assert answers[0] == "request_headers"  # the pick, then its body, nothing more
    assert set(answers[1:]) == {"request_body"}
    assert kept == 0
