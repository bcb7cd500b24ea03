"""A rollout costs no request: a replica that discovery removes while a request is being routed
(above all while it is held behind a fan-out leader) is skipped, and the request is ranked again
over the replicas that serve now. Real engines on their own loopback addresses, the real
`kubernetes` client against the stub API server (tests/kube_stub.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.pipeline.director import Director
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.engine.timing import TimingModel
from loadgen.harness.processes import free_port
from tests.conftest import MODEL, TENANT_KEY
from tests.e2e.test_fanout import sibling
from tests.kube_stub import KubeStub, endpoint_slice, pod_endpoint, write_kubeconfig
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SELECTOR = "kubernetes.io/service-name=vllm"
ADDRESSES = ("127.0.0.2", "127.0.0.3")
SLOW_PREFILL = TimingModel(prefill_tokens_per_s=2_000, decode_s_per_token=0.001)
"""The leader's ~4,000-token prefill takes ~2 s: the window in which the rollout happens."""


class Pods:
    """Two engine pods behind one port, each failing its first request after its prefill (an
    engine that dies mid-prefill), a stub API server and a kubeconfig."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        config = EngineConfig(timing=SLOW_PREFILL, fail_first_bytes=1)
        self.engines = [start_app(create_engine_app(config), self.port, host) for host in ADDRESSES]
        self.api = KubeStub()
        self.api_server = start_app(self.api.app())
        self.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", self.api_server.url)
        self.members = list(ADDRESSES)

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def publish(self) -> None:
        endpoints = [pod_endpoint(h, f"vllm-{h[-1]}", f"uid-{h}") for h in self.members]
        self.api.put(endpoint_slice("vllm-abcde", "vllm", endpoints, port=self.port))

    def stop(self) -> None:
        stop_all([*self.engines, self.api_server])


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Pods]:
    p = Pods(tmp_path)
    p.publish()
    yield p
    p.stop()


def director(gateway: Served) -> Director:
    d: Director = gateway.app.state.director
    return d


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, Any]]) -> int:
    """The HTTP status the client saw."""
    try:
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_a_replica_removed_while_a_request_is_held_costs_no_request(
    pods: Pods, start_gateway: Callable[..., Served]
) -> None:
    """A leader writes a prefix on one pod, a sibling waits for it; meanwhile the other pod is
    scaled away (idle, so nothing keeps its state). The leader's engine then fails: the sibling
    is released and routed — over the pods that exist now, not the ranking it would have had
    before its wait (which put the idle, removed pod first: a KeyError, a 500)."""
    gateway = start_gateway(
        [],
        discovery="kubernetes",
        discovery_label_selector=SELECTOR,
        discovery_port_name="http",
        kubeconfig=pods.kubeconfig,
        discovery_retry_s=0.1,
        engine_prefill_tokens_per_s=2_000,
        fanout_max_hold_s=30,
        max_attempts=1,  # the leader's engine failure is the leader's answer, not retried
    )
    d = director(gateway)
    wait_until(lambda: sum(s.healthy for s in d.replicas.states.values()) == 2, what="2 pods")
    flights = d.placement.flights
    assert flights is not None

    async def scenario() -> tuple[int, int]:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=TENANT_KEY, max_retries=0)
        try:
            leader = asyncio.create_task(chat(client, sibling(0)))
            await asyncio.to_thread(wait_until, lambda: len(flights) > 0, 10, "the leader")
            held = asyncio.create_task(chat(client, sibling(1)))
            await asyncio.to_thread(wait_until, lambda: flights.stats.holds == 1, 10, "the hold")
            busy = next(u for u, s in d.replicas.states.items() if s.num_inflight)
            idle = next(h for h in ADDRESSES if pods.url(h) != busy)
            pods.members.remove(idle)  # the rollout: the idle pod goes away
            pods.publish()
            gone = pods.url(idle)
            await asyncio.to_thread(
                wait_until, lambda: gone not in d.replicas.states, 10, "the pod removed"
            )
            assert not leader.done() and not held.done()  # both still before the failure
            return await leader, await held
        finally:
            await client.close()

    leader_status, held_status = asyncio.run(scenario())
    assert leader_status == 502  # its engine failed mid-prefill and it may not retry
    assert held_status == 200  # the rollout cost the held sibling nothing
    assert flights.stats.released_failed == 1
