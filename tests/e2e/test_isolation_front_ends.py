"""The salt's isolation on every front end (chat is in test_isolation.py and test_gateway.py):
a client cannot send a `cache_salt`, and another tenant's identical prompt is never a hit, over
/v1/completions, /v1/messages and gRPC's Generate and GenerateStream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import orjson
import pytest

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY
from tests.servers import Served

pytestmark = pytest.mark.e2e

PROMPT = words("isolated-on-every-front-end", 1500)


@pytest.fixture
def gateway(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> Served:
    return start_gateway(start_engines(1), grpc_port=0, debug_headers=False)


@pytest.fixture
def channel(gateway: Served) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.app.state.grpc_port}") as channel:
        yield channel


def post(gateway: Served, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    return httpx.post(
        gateway.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
def test_a_clients_cache_salt_is_refused(gateway: Served, path: str, body: dict[str, Any]) -> None:
    r = post(gateway, path, {**body, "cache_salt": "copied-from-someone"}, TENANT_KEY)
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.text


def test_grpc_has_no_way_to_send_a_salt(gateway: Served, channel: grpc.Channel) -> None:
    """The contract has no such field; one smuggled in as an unknown field is dropped, and the
    request is served in the caller's own scope."""
    assert "cache_salt" not in pb.GenerateRequest.DESCRIPTOR.fields_by_name
    request = pb.GenerateRequest(
        model=MODEL,
        messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text=PROMPT)])],
        sampling=pb.Sampling(max_tokens=2),
    )
    salt_field = b"\xfa\x06\x04salt"  # field 111, length-delimited: "salt"
    smuggled = pb.GenerateRequest.FromString(request.SerializeToString() + salt_field)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    for key in (TENANT_KEY, TENANT_KEY):  # written, then read, in acme's scope
        reply = stub.Generate(smuggled, metadata=(("authorization", f"Bearer {key}"),), timeout=30)
    assert reply.usage.engine_cached_tokens > 1000
    other = stub.Generate(
        smuggled, metadata=(("authorization", f"Bearer {OTHER_KEY}"),), timeout=30
    )
    assert other.usage.engine_cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_completions_never_hit_another_tenants_prompt(gateway: Served, stream: bool) -> None:
    body = {"model": MODEL, "prompt": f"{stream} {PROMPT}", "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}

    def usage(key: str) -> dict[str, Any]:
        r = post(gateway, "/v1/completions", body, key)
        assert r.status_code == 200, r.text
        if not stream:
            found: dict[str, Any] = r.json()["usage"]
            return found
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
        (last,) = [orjson.loads(e)["usage"] for e in events if '"usage"' in e]
        return dict(last)

    usage(TENANT_KEY)
    mine, theirs = usage(TENANT_KEY), usage(OTHER_KEY)
    assert mine["engine_cached_tokens"] > 1000
    assert theirs["engine_cached_tokens"] == 0 == theirs["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_grpc_never_hits_another_tenants_prompt(
    gateway: Served, channel: grpc.Channel, rpc: str
) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    text = f"{rpc}: {PROMPT}"
    request = pb.GenerateRequest(
        model=MODEL,
        messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text=text)])],
        sampling=pb.Sampling(max_tokens=2),
    )

    def usage(key: str) -> pb.Usage:
        metadata = (("authorization", f"Bearer {key}"),)
        if rpc == "Generate":
            return stub.Generate(request, metadata=metadata, timeout=30).usage
        (end,) = [
            m.end
            for m in stub.GenerateStream(request, metadata=metadata, timeout=30)
            if m.HasField("end")
        ]
        return end.usage

    usage(TENANT_KEY)
    mine, theirs = usage(TENANT_KEY), usage(OTHER_KEY)
    assert mine.engine_cached_tokens > 1000 and mine.cache_read_input_tokens == 0  # no marks
    assert theirs.engine_cached_tokens == 0
