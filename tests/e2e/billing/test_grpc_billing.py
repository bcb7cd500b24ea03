"""gRPC's usage is the bill: with billing on, Generate and GenerateStream report the same read,
written and uncached tokens and the same cost as the WAL records, as the HTTP front ends do."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.billing.wal import read_directory
from loadgen.text import words
from tests.conftest import MODEL, TENANT_KEY
from tests.e2e.billing.test_gateway_billing import billed_gateway
from tests.servers import Served

pytestmark = pytest.mark.e2e

START = 1_000_000
AUTH = (("authorization", f"Bearer {TENANT_KEY}"),)


def generate(stub: Any, rpc: str, request: pb.GenerateRequest) -> pb.Usage:
    if rpc == "Generate":
        return stub.Generate(request, metadata=AUTH, timeout=30).usage
    (end,) = [
        m.end for m in stub.GenerateStream(request, metadata=AUTH, timeout=30) if m.HasField("end")
    ]
    return end.usage


@pytest.mark.parametrize("profile", ["anthropic", "openai"])
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_grpc_usage_and_cost_are_what_the_wal_records(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    rpc: str,
    profile: str,
) -> None:
    gateway, clock = billed_gateway(
        start_engines,
        start_gateway,
        tmp_path,
        grpc_port=0,
        policy="round_robin",  # the second turn lands on the other replica: a physical miss
        billing_profiles={"acme": profile},
    )
    system = pb.Message(
        role=pb.ROLE_SYSTEM,
        content=[pb.ContentPart(text=words(f"grpc-billing-{rpc}", 2000))],
        cache_control=pb.CacheControl(ttl=pb.CACHE_TTL_5M),
    )
    with grpc.insecure_channel(f"127.0.0.1:{gateway.app.state.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        usages = []
        for turn in range(2):
            clock.set(START + 30 * turn)
            question = pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text=f"q{turn}")])
            request = pb.GenerateRequest(
                model=MODEL, messages=[system, question], sampling=pb.Sampling(max_tokens=2)
            )
            usages.append(generate(stub, rpc, request))
    records = {r["id"]: r for r in read_directory(tmp_path / "wal")}
    assert len(records) == 2
    for usage in usages:
        record = records[usage.billing_id]
        assert usage.cost and Decimal(usage.cost) == Decimal(record["cost"])
        assert usage.cache_read_input_tokens == record["read_tokens"]
        assert usage.cache_creation_input_tokens == record["written_tokens"]
        assert usage.input_tokens == record["uncached_tokens"]
        assert usage.prompt_tokens == record["prompt_tokens"]
        assert usage.engine_cached_tokens == record["engine_cached_tokens"]
    first, second = usages
    assert first.cache_creation_input_tokens > 1000 and first.cache_read_input_tokens == 0
    # the contract's read, though the engine that served it had nothing cached
    assert second.cache_read_input_tokens > 1000 and second.engine_cached_tokens == 0
    assert Decimal(second.cost) < Decimal(first.cost)


def test_without_billing_grpc_has_no_cost(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1), grpc_port=0)
    request = pb.GenerateRequest(
        model=MODEL,
        messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])],
        sampling=pb.Sampling(max_tokens=2),
    )
    with grpc.insecure_channel(f"127.0.0.1:{gateway.app.state.grpc_port}") as channel:
        usage = (
            gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=AUTH, timeout=30).usage
        )
    assert usage.cost == "" and usage.billing_id == "" and usage.prompt_tokens > 0
