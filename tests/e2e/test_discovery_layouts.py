"""Pod annotations give each discovered engine its own KV events port and DP size: the real
`kubernetes` client against the stub API server (tests/kube_stub.py), real simulated engines on
their own loopback addresses behind one HTTP port, their KV events over real ZMQ."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachemap.layouts import EngineLayout
from gateway.fleet.discovery import (
    DP_SIZE_ANNOTATION,
    EVENTS_PORT_ANNOTATION,
    REPLAY_PORT_ANNOTATION,
    Discovery,
    layout_of,
)
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness.processes import free_port
from tests.conftest import FAST
from tests.e2e.test_precise import CONVERSATION, TOPIC, chat, direct, join, salt_of, via
from tests.kube_stub import KubeStub, endpoint_slice, pod, pod_endpoint, write_kubeconfig
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SELECTOR = "kubernetes.io/service-name=vllm"


def test_annotations_parse_into_a_layout_and_bad_values_fall_back() -> None:
    assert layout_of({EVENTS_PORT_ANNOTATION: "5557", DP_SIZE_ANNOTATION: "4"}) == EngineLayout(
        events_port=5557, dp_size=4
    )
    assert layout_of({REPLAY_PORT_ANNOTATION: "5558", "other": "x"}) == EngineLayout(
        replay_port=5558
    )
    bad = {EVENTS_PORT_ANNOTATION: "70000", DP_SIZE_ANNOTATION: "two"}
    assert layout_of(bad) == EngineLayout()  # each ignored: the settings' values apply
    assert layout_of({DP_SIZE_ANNOTATION: "0"}) == EngineLayout()


@dataclass
class Pods:
    """Two engine pods behind one HTTP port and the stub API server that lists them: pod a
    runs 2 DP ranks publishing on its own port (and +1), pod b one rank on another port."""

    http_port: int
    port_a: int
    port_b: int
    a: Served
    b: Served
    api: KubeStub
    api_server: Served


@pytest.fixture
def pods() -> Iterator[Pods]:
    http_port, port_a, port_b = free_port(), free_ports(2), free_ports(1)
    a = start_app(
        create_engine_app(
            EngineConfig(timing=FAST, kv_events=events_config(port_a), data_parallel_size=2)
        ),
        http_port,
        "127.0.0.2",
    )
    b = start_app(
        create_engine_app(EngineConfig(timing=FAST, kv_events=events_config(port_b))),
        http_port,
        "127.0.0.3",
    )
    api = KubeStub()
    api_server = start_app(api.app())
    yield Pods(http_port, port_a, port_b, a, b, api, api_server)
    stop_all([a, b, api_server])


def test_each_pods_annotations_set_its_events_port_and_dp_ranks(
    pods: Pods, start_gateway: Callable[..., Served], tmp_path: Path
) -> None:
    # the settings say port `unused` and 1 rank, which neither pod uses
    a, b, api, http_port = pods.a, pods.b, pods.api, pods.http_port
    port_a, port_b, unused = pods.port_a, pods.port_b, free_port()
    api.pods["vllm-a"] = pod(
        "vllm-a",
        "uid-a",
        {EVENTS_PORT_ANNOTATION: str(port_a), DP_SIZE_ANNOTATION: "2"},
    )
    api.pods["vllm-b"] = pod("vllm-b", "uid-b", {EVENTS_PORT_ANNOTATION: str(port_b)})
    endpoints = [
        pod_endpoint("127.0.0.2", "vllm-a", "uid-a"),
        pod_endpoint("127.0.0.3", "vllm-b", "uid-b"),
        pod_endpoint("127.0.0.4", "vllm-gone", "uid-gone", ready=False),  # no such pod: 404
    ]
    api.put(endpoint_slice("vllm-x", "vllm", endpoints, port=http_port))
    gateway = start_gateway(
        [],
        discovery="kubernetes",
        discovery_label_selector=SELECTOR,
        kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", pods.api_server.url),
        discovery_retry_s=0.1,
        discovery_pod_annotations=True,
        tokenizer_dir=MODEL_DIR,
        engine_block_size=16,
        kv_events_port=unused,
        kv_events_topic=TOPIC,
        overflow=False,
        fanout_hold=False,
    )
    parts = gateway.app.state.parts
    intake = parts.intake
    assert intake is not None
    wait_until(lambda: len(intake.feeds()) == 4, what="the feeds of the three pods")
    feeds = {f.config.domain: f.config.endpoint for f in intake.feeds()}
    assert feeds == {
        f"{a.url}#0": f"tcp://127.0.0.2:{port_a}",
        f"{a.url}#1": f"tcp://127.0.0.2:{port_a + 1}",
        b.url: f"tcp://127.0.0.3:{port_b}",
        f"http://127.0.0.4:{http_port}": f"tcp://127.0.0.4:{unused}",  # the settings'
    }
    # each pod read once, even after its slice changes
    api.put(endpoint_slice("vllm-x", "vllm", endpoints[:2], port=http_port))
    found: Discovery = gateway.app.state.discovery
    wait_until(lambda: found.stats.leaves == 1, what="the unready pod to leave")
    assert sorted(q["name"] for k, q in api.requests if k == "pod") == [
        "vllm-a",
        "vllm-b",
        "vllm-gone",
    ]
    # a pod that joins through the watch is read before it joins: 3 ranks on its own port
    port_c = free_port()
    api.pods["vllm-c"] = pod(
        "vllm-c", "uid-c", {EVENTS_PORT_ANNOTATION: str(port_c), DP_SIZE_ANNOTATION: "3"}
    )
    grown = [*endpoints[:2], pod_endpoint("127.0.0.5", "vllm-c", "uid-c")]
    api.put(endpoint_slice("vllm-x", "vllm", grown, port=http_port))
    c_url = f"http://127.0.0.5:{http_port}"
    wait_until(lambda: len(intake.feeds(c_url)) == 3, what="the new pod's feeds")
    assert [f.config.endpoint for f in intake.feeds(c_url)] == [
        f"tcp://127.0.0.5:{port_c + r}" for r in range(3)
    ]
    assert found.layouts.get(c_url) == EngineLayout(events_port=port_c, dp_size=3)

    # routed by rank: what rank 1 of pod a holds brings the request there, with the header
    join([gateway], [a, b])
    salt = salt_of(gateway)
    body = chat(CONVERSATION)
    direct(a, body, salt, **{"X-data-parallel-rank": "1"})
    precise = parts.keying.precise
    assert precise is not None
    wait_until(lambda: precise.index.num_blocks(a.url + "#1") > 0, what="rank 1's blocks")
    assert precise.index.num_blocks(a.url + "#0") == 0
    answer = via(gateway, body)
    assert answer.headers["x-kvgate-replica"] == a.url
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
