"""P/D roles from Kubernetes discovery (issue 42, item 3): a pod label or annotation naming
each engine's role builds the decode pool live. The real `kubernetes` client against the stub
API server (tests/kube_stub.py); three simulated engines in vLLM's `kv_both` role (either leg)
on their own loopback addresses behind one port, as pods behind a Service."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.fleet.discovery import Discovery
from gateway.settings import Settings
from loadgen.engine.disagg import BOTH, KVTransferConfig
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.harness.processes import free_port
from loadgen.text import words
from tests.clients import openai_client as client
from tests.conftest import FAST, engine_of
from tests.e2e.test_disaggregation import ask
from tests.kube_stub import KubeStub, endpoint_slice, pod, pod_endpoint, write_kubeconfig
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SELECTOR = "kubernetes.io/service-name=vllm"
ROLE = "llm-d.ai/role"
HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}


def labelled(name: str, uid: str, labels: dict[str, str], **annotations: str) -> dict[str, Any]:
    found = pod(name, uid, annotations)
    found["metadata"]["labels"] = labels
    return found


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.engines = {
            name: start_app(
                create_engine_app(
                    EngineConfig(
                        timing=FAST,
                        kv_transfer=KVTransferConfig(
                            kv_role=BOTH,
                            side_channel_host=host,
                            side_channel_port=self.port,
                            abort_timeout_s=1e6,
                        ),
                    )
                ),
                self.port,
                host,
            )
            for name, host in HOSTS.items()
        }
        self.api = KubeStub()
        self.api_server = start_app(self.api.app())
        self.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", self.api_server.url)

    def url(self, name: str) -> str:
        return self.engines[name].url

    def publish(self, members: dict[str, str]) -> None:
        """The Service's slice: engine name -> the pod uid at its address."""
        endpoints = [pod_endpoint(HOSTS[name], f"vllm-{uid}", uid) for name, uid in members.items()]
        self.api.put(endpoint_slice("vllm-x", "vllm", endpoints, port=self.port))

    def stop(self) -> None:
        stop_all([*self.engines.values(), self.api_server])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.stop()


def test_pod_roles_build_the_decode_pool_and_follow_pods_that_change_or_leave(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    api = cluster.api
    api.pods["vllm-a1"] = labelled("vllm-a1", "a1", {ROLE: "prefill"})
    api.pods["vllm-b1"] = labelled("vllm-b1", "b1", {ROLE: "decode"})
    # the annotation wins over a label of the same key
    api.pods["vllm-c1"] = labelled("vllm-c1", "c1", {ROLE: "prefill"}, **{ROLE: "decode"})
    api.pods["vllm-b2"] = labelled("vllm-b2", "b2", {ROLE: "both"})  # aggregated: prefill
    cluster.publish({"a": "a1", "b": "b1"})
    gateway = start_gateway(
        [],
        discovery="kubernetes",
        discovery_label_selector=SELECTOR,
        kubeconfig=cluster.kubeconfig,
        discovery_retry_s=0.1,
        discovery_role_key=ROLE,
        max_attempts=3,
    )
    found: Discovery = gateway.app.state.discovery
    disagg = gateway.app.state.director.disaggregation
    assert disagg is not None  # P/D on with no static decode_engines
    b, c = cluster.url("b"), cluster.url("c")
    wait_until(lambda: found.decode == {b}, what="b in the decode pool")
    assert disagg.decode_ids == {b}

    def turn(topic: str) -> tuple[str, list[int]]:
        before = {n: engine_of(e).core.counters.prompt_tokens for n, e in cluster.engines.items()}
        _, text, decoded_at = ask(client(gateway), "Roles." + words(topic, 300))
        assert text
        after = {n: engine_of(e).core.counters.prompt_tokens for n, e in cluster.engines.items()}
        return decoded_at, [n for n in sorted(HOSTS) if after[n] > before[n]]

    decoded_at, ran = turn("roles-1")
    assert decoded_at == b and ran == ["a", "b"]  # prefilled at a, pulled and decoded at b
    assert engine_of(cluster.engines["b"]).core.counters.external_tokens > 0

    cluster.publish({"a": "a1", "b": "b1", "c": "c1"})  # c joins, annotated decode
    wait_until(lambda: found.decode == {b, c}, what="c in the decode pool")

    cluster.publish({"a": "a1", "b": "b2", "c": "c1"})  # b's pod replaced by an aggregated one
    wait_until(lambda: found.decode == {c}, what="b out of the decode pool")
    assert disagg.decode_ids == {c}
    for topic in ("roles-2", "roles-3"):
        decoded_at, ran = turn(topic)
        assert decoded_at == c and "c" in ran and len(ran) == 2  # a or b prefilled

    cluster.publish({"a": "a1", "b": "b2"})  # c leaves
    wait_until(lambda: found.decode == frozenset(), what="an empty decode pool")
    assert disagg.decode_ids == frozenset()
    assert c not in gateway.app.state.director.replicas.states


def test_the_role_key_needs_kubernetes_discovery_standalone_and_one_worker() -> None:
    base: dict[str, Any] = {"engines": ["http://e:8000"], "discovery_role_key": ROLE}
    with pytest.raises(ValidationError, match="needs discovery: kubernetes"):
        Settings(**base)
    kube = {**base, "discovery": "kubernetes", "discovery_label_selector": SELECTOR}
    with pytest.raises(ValidationError, match="needs workers: 1"):
        Settings(**kube, workers=2, redis_url="redis://127.0.0.1:1")
    with pytest.raises(ValidationError, match="must name a pod label"):
        Settings(**{**kube, "discovery_role_key": " "})
    assert Settings(**kube).discovery_role_key == ROLE
