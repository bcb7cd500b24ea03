"""SIGTERM drains a real `kvgate serve` process (issue 14, item 25): no new connection or RPC is
taken, streams in flight finish within the grace (HTTP and gRPC alike), those still running at
its end are cut and billed as aborted, and the WAL is left with nothing unsettled."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest
import yaml  # type: ignore[import-untyped]

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.billing.wal import read_directory, unsettled
from loadgen.engine.timing import TimingModel
from loadgen.harness import processes
from loadgen.text import words
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

DECODE = TimingModel(decode_s_per_token=0.02)
HEADERS = {"authorization": f"Bearer {TENANT_KEY}"}


def start(engines: list[Served], tmp_path: Path, grace_s: float) -> tuple[processes.Proc, int]:
    grpc_port = processes.free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tenants": [f"acme:{TENANT_KEY}"],
                "server_secret": "drain",
                "billing_wal_dir": str(tmp_path / "wal"),
                "billing_model_map": {MODEL: "gpt-5.6"},
                "shutdown_grace_s": grace_s,
            }
        )
    )
    args = ["--config", str(config), "--log-level", "warning", "--grpc-port", str(grpc_port)]
    gateway = processes.start_gateway(processes.free_port(), [e.url for e in engines], args)
    processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
    return gateway, grpc_port


def body(tag: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": words(tag, 200)}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/healthz", timeout=1)
    except httpx.ConnectError:
        return True
    return False


@pytest.fixture
def channels() -> Iterator[list[grpc.Channel]]:
    opened: list[grpc.Channel] = []
    yield opened
    for channel in opened:
        channel.close()


def test_sigterm_lets_streams_in_flight_finish_and_takes_nothing_new(
    start_engines: Callable[..., list[Served]], tmp_path: Path, channels: list[grpc.Channel]
) -> None:
    engines = start_engines(1, timing=DECODE)
    gateway, grpc_port = start(engines, tmp_path, grace_s=10)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    channels.append(channel)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    auth = (("authorization", f"Bearer {TENANT_KEY}"),)
    rpc = pb.GenerateRequest(
        model=MODEL,
        messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="go on")])],
        sampling=pb.Sampling(max_tokens=60),
    )
    events = stub.GenerateStream(rpc, metadata=auth, timeout=30)
    assert next(events).WhichOneof("event") == "start"
    url = gateway.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body("drain", 60), headers=HEADERS, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        gateway.popen.send_signal(signal.SIGTERM)  # ~1.2 s of each stream still to come
        wait_until(lambda: refused(gateway.url), 5, "the listener closed")
        with pytest.raises(grpc.RpcError) as late:  # no new RPC either
            stub.Generate(rpc, metadata=auth, timeout=5)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"  # the HTTP stream finished
    usage = next(orjson.loads(x[6:]) for x in rest if '"usage":{' in x)["usage"]
    assert usage["completion_tokens"] == 60
    tail = list(events)  # and the gRPC one
    assert tail[-1].WhichOneof("event") == "end" and tail[-1].end.usage.completion_tokens == 60
    started = time.monotonic()
    gateway.popen.wait(timeout=15)
    assert time.monotonic() - started < 10
    records = list(read_directory(tmp_path / "wal"))
    assert sorted(r["status"] for r in records) == ["ok", "ok"]
    assert unsettled(tmp_path / "wal") == []  # nothing left for a restart to recover


def test_a_stream_longer_than_the_grace_is_cut_and_billed_as_aborted(
    start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    engines = start_engines(1, timing=DECODE)
    gateway, _ = start(engines, tmp_path, grace_s=1)
    url = gateway.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body("cut", 500), headers=HEADERS, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        started = time.monotonic()
        gateway.popen.send_signal(signal.SIGTERM)  # 10 s of stream left, 1 s of grace
        rest = [line for line in lines if line]  # cut at the grace, with a clean error
    assert rest[-1] == "data: [DONE]"
    error = orjson.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable_error"
    gateway.popen.wait(timeout=15)
    assert time.monotonic() - started < 8
    records = list(read_directory(tmp_path / "wal"))
    assert [r["status"] for r in records] == ["aborted"]
    assert records[0]["prompt_tokens"] > 150 and records[0]["output_tokens"] == 0
    assert unsettled(tmp_path / "wal") == []
