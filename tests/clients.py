"""SDK clients for the tests, closed after each test (conftest's autouse fixture), and the
director of an in-process gateway."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import grpc
import openai
import pytest

from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.pipeline.director import Director
from loadgen.harness.envoy import Envoy
from tests.conftest import TENANT_KEY
from tests.servers import Served

_OPEN: list[openai.OpenAI | anthropic.Anthropic] = []


def openai_client(gateway: Served | Envoy, key: str = TENANT_KEY) -> openai.OpenAI:
    """An OpenAI SDK client of the gateway (or of the Envoy in front of it), closed after the
    test."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    _OPEN.append(client)
    return client


def anthropic_client(gateway: Served, key: str = TENANT_KEY) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0)
    _OPEN.append(client)
    return client


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()


def director(gateway: Served) -> Director:
    d: Director = gateway.app.state.director
    return d


# -- gRPC: a stub per call, its channel closed after the test (the `grpc_channels` fixture) --
_CHANNELS: list[grpc.Channel] = []


def grpc_channel(gateway: Served) -> grpc.Channel:
    """A channel to the served gateway's gRPC port, closed after the test."""
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.app.state.grpc_port}")
    _CHANNELS.append(channel)
    return channel


def grpc_stub(gateway: Served) -> Any:
    """A Gateway stub on the served gateway's gRPC port; its channel closes after the test."""
    return gateway_pb2_grpc.GatewayStub(grpc_channel(gateway))


@pytest.fixture(autouse=True)
def grpc_channels() -> Iterator[None]:
    """Autouse in every module that imports it: closes the channels `grpc_stub` opened."""
    yield
    while _CHANNELS:
        _CHANNELS.pop().close()
