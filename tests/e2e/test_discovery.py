"""Engine discovery from EndpointSlices: the real `kubernetes` client, through a kubeconfig the
test writes, against a stub API server on loopback (tests/kube_stub.py); real simulated engines
on their own loopback addresses (127.0.0.2, .3, .4) behind one port, as pods behind a Service."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.fleet.discovery import Discovery, Endpoint, endpoints_of, merge
from gateway.pipeline.director import Director
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.harness import processes
from loadgen.harness.processes import free_port
from loadgen.text import words
from tests.conftest import FAST, MODEL, TENANT_KEY
from tests.kube_stub import KubeStub, endpoint_slice, pod_endpoint, write_kubeconfig
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SELECTOR = "kubernetes.io/service-name=vllm"
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


# -- the pure part: what a slice says ----------------------------------------------------------
def test_endpoints_of_a_slice_by_port_name_and_address_type() -> None:
    slice_ = endpoint_slice(
        "vllm-a",
        "vllm",
        [
            pod_endpoint("10.0.0.1", "vllm-0", "u0"),
            pod_endpoint("10.0.0.2", "vllm-1", "u1", ready=False),
            {"addresses": ["10.0.0.3"]},  # no conditions at all: ready, by the API's rule
        ],
        port=8000,
    )
    slice_["ports"].append({"name": "metrics", "port": 9090})
    assert endpoints_of(slice_, "http") == [
        Endpoint("http://10.0.0.1:8000", True, "u0", "vllm-0"),
        Endpoint("http://10.0.0.2:8000", False, "u1", "vllm-1"),
        Endpoint("http://10.0.0.3:8000", True),
    ]
    assert endpoints_of(slice_, "metrics", "https")[0].url == "https://10.0.0.1:9090"
    assert endpoints_of(slice_, None) == []  # two ports and no name: ambiguous, nothing
    assert endpoints_of(slice_, "grpc") == []
    v6 = endpoint_slice("v6", "vllm", [pod_endpoint("fd00::1", "p", "u")], port=8000)
    v6["addressType"] = "IPv6"
    assert endpoints_of(v6, None)[0].url == "http://[fd00::1]:8000"


def test_an_address_in_two_slices_is_ready_if_either_says_so() -> None:
    url = "http://10.0.0.1:8000"
    merged = merge({"a": [Endpoint(url, False, "u0")], "b": [Endpoint(url, True, "u0")], "c": []})
    assert merged == {url: Endpoint(url, True, "u0")}


# -- the live part --------------------------------------------------------------------------
class Cluster:
    """Three engine pods behind one port, a stub API server, a kubeconfig."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.engines = [
            start_app(create_engine_app(EngineConfig(timing=FAST)), self.port, host)
            for host in ADDRESSES
        ]
        self.api = KubeStub()
        self.api_server = start_app(self.api.app())
        self.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", self.api_server.url)
        self.uids = {host: f"uid-{host}" for host in ADDRESSES}
        self.ready = dict.fromkeys(ADDRESSES, True)
        self.members = list(ADDRESSES[:2])

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def slice(self) -> dict[str, Any]:
        endpoints = [
            pod_endpoint(h, f"vllm-{h[-1]}", self.uids[h], ready=self.ready[h])
            for h in self.members
        ]
        return endpoint_slice("vllm-abcde", "vllm", endpoints, port=self.port)

    def publish(self) -> None:
        self.api.put(self.slice())

    def stop(self) -> None:
        stop_all([*self.engines, self.api_server])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    c.publish()
    # a slice of another Service in the namespace: never an engine
    c.api.put(endpoint_slice("other", "redis", [pod_endpoint("127.0.0.9", "r", "r")], port=6379))
    yield c
    c.stop()


def discovering(start_gateway: Callable[..., Served], cluster: Cluster, **extra: Any) -> Served:
    return start_gateway(
        [],
        discovery="kubernetes",
        discovery_label_selector=SELECTOR,
        discovery_port_name="http",
        kubeconfig=cluster.kubeconfig,
        discovery_retry_s=0.1,
        **extra,
    )


def director(gateway: Served) -> Director:
    d: Director = gateway.app.state.director
    return d


def discovery(gateway: Served) -> Discovery:
    found: Discovery = gateway.app.state.discovery
    return found


def healthy(gateway: Served) -> set[str]:
    return {u for u, s in director(gateway).replicas.states.items() if s.healthy}


def ask(gateway: Served, conversation: str) -> tuple[str, int, str]:
    """One turn: (replica, matched blocks, decision reason), from the debug headers."""
    messages = [
        {"role": "system", "content": words(f"{conversation}/system", 400)},
        {"role": "user", "content": words(f"{conversation}/task", 100)},
    ]
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    h = response.headers
    return h["x-kvgate-replica"], int(h["x-kvgate-matched-blocks"]), h["x-kvgate-decision"]


def entries(gateway: Served, replica: str) -> int:
    return director(gateway).directory.local.index.num_entries(replica)


def test_replicas_join_and_leave_live(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    gateway = discovering(start_gateway, cluster)
    first = {cluster.url(h) for h in ADDRESSES[:2]}
    # the first list is applied before the gateway serves; the other Service's slice is not
    assert set(director(gateway).replicas.states) == first
    wait_until(lambda: healthy(gateway) == first, what="both pods healthy")
    where, _, _ = ask(gateway, "join-leave")
    assert where in first
    assert cluster.api.count("list") == 1
    assert cluster.api.requests[0][1]["labelSelector"] == SELECTOR

    cluster.members.append(ADDRESSES[2])  # scale up: a third pod joins
    cluster.publish()
    third = cluster.url(ADDRESSES[2])
    wait_until(lambda: third in healthy(gateway), what="the new pod routed to")

    # the pod that served the conversation leaves: removed and forgotten in the directory
    home, matched, _ = ask(gateway, "join-leave")
    assert home == where and matched > 0
    assert entries(gateway, home) > 0
    cluster.members.remove(home.removeprefix("http://").split(":")[0])
    cluster.publish()
    wait_until(lambda: home not in director(gateway).replicas.states, what="the pod removed")
    assert entries(gateway, home) == 0
    moved, matched, reason = ask(gateway, "join-leave")
    assert moved != home and matched == 0 and reason == "no_match"

    # the Service's slice is deleted: only the static list (empty) remains
    cluster.api.delete("vllm-abcde")
    wait_until(lambda: not director(gateway).replicas.states, what="every pod gone")
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert response.status_code == 503
    assert httpx.get(gateway.url + "/readyz").status_code == 503
    stats = discovery(gateway).stats
    assert stats.joins == 3 and stats.leaves == 3 and stats.relists_after_gone == 0


def test_a_not_ready_pod_is_held_out_until_ready_again(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    gateway = discovering(start_gateway, cluster)
    a, b = (cluster.url(h) for h in ADDRESSES[:2])
    wait_until(lambda: healthy(gateway) == {a, b}, what="both pods healthy")
    cluster.ready[ADDRESSES[0]] = False  # e.g. failing its readiness probe, or terminating
    cluster.publish()
    wait_until(lambda: healthy(gateway) == {b}, what="the pod held down")
    assert a in director(gateway).replicas.states  # still known: its cache may be intact
    for n in range(4):
        assert ask(gateway, f"held-{n}")[0] == b
    cluster.ready[ADDRESSES[0]] = True
    cluster.publish()
    wait_until(lambda: healthy(gateway) == {a, b}, what="the pod back")


def test_a_pod_that_restarts_is_a_new_epoch(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    """The pod at an address is replaced (a new uid: a StatefulSet pod re-created, or an IP
    reused): its cache is new, so the directory forgets it, though the address is the same and
    the engine process here did not even change (discovery alone caused the epoch)."""
    gateway = discovering(start_gateway, cluster)
    wait_until(lambda: len(healthy(gateway)) == 2, what="both pods healthy")
    home, _, _ = ask(gateway, "restart")
    again, matched, _ = ask(gateway, "restart")
    assert again == home and matched > 0
    assert entries(gateway, home) > 0
    host = home.removeprefix("http://").split(":")[0]
    cluster.uids[host] = "uid-replaced"
    cluster.publish()
    wait_until(lambda: discovery(gateway).stats.epochs == 1, what="the epoch")
    assert entries(gateway, home) == 0
    _, matched, reason = ask(gateway, "restart")
    assert matched == 0 and reason == "no_match"
    assert home in healthy(gateway)  # forgotten, not removed


def test_a_container_restart_in_its_pod_is_a_new_epoch_too(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    """The engine process restarts inside the same pod (same uid, same address): the slice
    says not ready, then ready; the engine's new start time bumps the epoch."""
    gateway = discovering(start_gateway, cluster)
    wait_until(lambda: len(healthy(gateway)) == 2, what="both pods healthy")
    home, _, _ = ask(gateway, "container-restart")
    assert ask(gateway, "container-restart")[1] > 0 and entries(gateway, home) > 0
    host = home.removeprefix("http://").split(":")[0]
    cluster.ready[host] = False
    cluster.publish()
    wait_until(lambda: home not in healthy(gateway), what="held down")
    index = ADDRESSES.index(host)
    cluster.engines[index].stop()
    cluster.engines[index] = start_app(
        create_engine_app(EngineConfig(timing=FAST)), cluster.port, host
    )
    cluster.ready[host] = True
    cluster.publish()
    wait_until(lambda: home in healthy(gateway), what="back")
    wait_until(lambda: entries(gateway, home) == 0, what="the start marker's epoch")
    assert discovery(gateway).stats.epochs == 0  # not discovery's doing: the same pod
    _, matched, reason = ask(gateway, "container-restart")
    assert matched == 0 and reason == "no_match"


def test_an_expired_watch_lists_again(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    """The history is compacted while a change happens that no event reports; the gateway's
    next watch gets 410 Gone, and only its new list can show the change."""
    gateway = discovering(start_gateway, cluster)
    a, b, c = (cluster.url(h) for h in ADDRESSES)
    wait_until(lambda: healthy(gateway) == {a, b}, what="both pods healthy")
    wait_until(lambda: cluster.api.count("watch") >= 1, what="the watch open")

    def scale_silently(slices: dict[str, dict[str, Any]]) -> None:
        cluster.members = [ADDRESSES[1], ADDRESSES[2]]  # a left and c joined, unreported
        item = copy.deepcopy(cluster.slice())
        item["metadata"] = slices["vllm-abcde"]["metadata"]
        slices["vllm-abcde"] = item

    cluster.api.expire(scale_silently)
    wait_until(lambda: healthy(gateway) == {b, c}, what="the change seen through a new list")
    stats = discovery(gateway).stats
    assert stats.relists_after_gone == 1 and stats.lists == 2
    assert cluster.api.count("gone") == 1
    assert a not in director(gateway).replicas.states
    # and the watch resumed after the new list: a later change arrives as an event
    cluster.members.append(ADDRESSES[0])
    cluster.publish()
    wait_until(lambda: healthy(gateway) == {a, b, c}, what="the next event")
    assert stats.lists == 2


def test_a_watch_the_server_ends_resumes_from_its_version(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    """The API server ends every watch after timeoutSeconds (with a bookmark): the gateway
    watches again from there, without listing again."""
    gateway = discovering(start_gateway, cluster, discovery_watch_timeout_s=1)
    wait_until(lambda: cluster.api.count("watch") >= 3, timeout_s=15, what="watches renewed")
    assert cluster.api.count("list") == 1
    versions = [int(q["resourceVersion"]) for kind, q in cluster.api.requests if kind == "watch"]
    assert versions == sorted(versions) and versions[-1] == cluster.api.version
    cluster.members.append(ADDRESSES[2])
    cluster.publish()
    wait_until(lambda: len(healthy(gateway)) == 3, what="the change after renewals")


def test_the_static_list_stays_beside_discovered_pods(
    cluster: Cluster, start_gateway: Callable[..., Served]
) -> None:
    static = start_app(create_engine_app(EngineConfig(timing=FAST)))
    try:
        gateway = start_gateway(
            [static],
            discovery="kubernetes",
            discovery_label_selector=SELECTOR,
            discovery_port_name="http",
            kubeconfig=cluster.kubeconfig,
        )
        wait_until(lambda: len(healthy(gateway)) == 3, what="static + discovered")
        cluster.api.delete("vllm-abcde")
        wait_until(lambda: healthy(gateway) == {static.url}, what="the discovered ones gone")
    finally:
        static.stop()


def test_a_wrong_token_is_retried_and_never_kills_the_gateway(
    cluster: Cluster, start_gateway: Callable[..., Served], tmp_path: Path
) -> None:
    bad = tmp_path / "bad-kubeconfig"
    bad.write_text(cluster.kubeconfig.read_text().replace("stub-token", "wrong"))
    gateway = start_gateway(
        [],
        discovery="kubernetes",
        discovery_label_selector=SELECTOR,
        kubeconfig=bad,
        discovery_retry_s=0.05,
    )
    wait_until(lambda: discovery(gateway).stats.errors >= 2, what="401s retried")
    assert not discovery(gateway).stats.synced and not director(gateway).replicas.states
    assert httpx.get(gateway.url + "/healthz").status_code == 200
    assert httpx.get(gateway.url + "/readyz").status_code == 503


def test_kvgate_serve_discovers_from_the_command_line(cluster: Cluster) -> None:
    """The flags as an operator outside the chart would type them, in a real process."""
    port = free_port()
    proc = processes.start_gateway(
        port,
        [],
        [
            "--discovery",
            "kubernetes",
            "--label-selector",
            SELECTOR,
            "--port-name",
            "http",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--tenant",
            f"acme:{TENANT_KEY}",
        ],
    )
    try:
        processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
        assert httpx.get(proc.url + "/readyz").json() == {"healthy_replicas": 2}
    finally:
        processes.stop([proc])
