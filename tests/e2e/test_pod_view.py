"""One prober and scraper per pod (issue 17 item 4): `kvgate serve --workers 2` as real
processes over a real redis-server and stand-in replicas on real loopback ports
(loadgen.bench.idle, which count what they are asked). The replicas see one probe stream and
one scrape stream, both workers route around a replica that goes down, and a worker whose
view's source goes silent (worker 0 stopped with SIGSTOP) probes and scrapes for itself. With
Kubernetes discovery (the stub API server of tests/kube_stub.py) the pod lists and watches the
EndpointSlices once, both workers route to what joins and stop routing to what leaves, and a
follower whose worker 0 stops watches for itself."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen.bench.idle import StandInLog, stand_ins
from loadgen.harness import processes
from tests.kube_stub import KubeStub, endpoint_slice, pod_endpoint, write_kubeconfig
from tests.servers import start_app, stop_all, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

HEALTH_INTERVAL_S = 0.3
METRICS_INTERVAL_S = 0.2
TIMEOUT_S = 0.5
WINDOW_S = 2.0
"""How long the requests reaching the replicas are counted (a measurement window)."""
BOUND_S = 2 * (HEALTH_INTERVAL_S + TIMEOUT_S) + 2 * METRICS_INTERVAL_S + TIMEOUT_S
"""Two failed probes mark a replica down; a follower hears of it within its view's staleness
bound (`ReplicaSet.stale_after_s`); the waits below allow four times that on a busy machine."""


@contextlib.contextmanager
def pod(redis_url: str, urls: list[str], **env: str) -> Iterator[processes.Proc]:
    args = ["--workers", "2", "--redis-url", redis_url, "--log-level", "warning"]
    env = {
        "KVGATE_HEALTH_INTERVAL_S": str(HEALTH_INTERVAL_S),
        "KVGATE_METRICS_INTERVAL_S": str(METRICS_INTERVAL_S),
        "KVGATE_HEALTH_TIMEOUT_S": str(TIMEOUT_S),
        **env,
    }
    gateway = processes.start_gateway(processes.free_port(), urls, args, env=env)
    try:
        processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
        wait_until(lambda: len(admin_ports(gateway)) == 2, 30, "both workers listed")
        wait_until(lambda: all(answers(gateway, i) for i in range(2)), 30, "both workers up")
        yield gateway
    finally:
        processes.stop([gateway])


def admin_ports(gateway: processes.Proc) -> list[int]:
    try:
        pod = httpx.get(f"{gateway.metrics_url}/pod", timeout=5).json()
    except httpx.HTTPError:
        return []
    return [int(w["admin_port"]) for w in pod["workers"]]


def worker_pid(gateway: processes.Proc, index: int) -> int:
    pod = httpx.get(f"{gateway.metrics_url}/pod", timeout=5).json()
    return int(pod["workers"][index]["pid"])


def page(gateway: processes.Proc, index: int) -> str:
    port = admin_ports(gateway)[index]
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def answers(gateway: processes.Proc, index: int) -> bool:
    try:
        page(gateway, index)
    except (httpx.HTTPError, IndexError):
        return False
    return True


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def healthy(gateway: processes.Proc, index: int, url: str) -> float | None:
    return sample(page(gateway, index), "kvgate_replica_healthy", replica=url)


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def route_around_and_back(gateway: processes.Proc, log: StandInLog, urls: list[str]) -> None:
    """A replica answering 503 is marked down by both workers within the bound, and up again
    when it answers: worker 1 from worker 0's view alone."""
    down = urls[0]
    log.down.add(port_of(down))
    t0 = time.monotonic()
    wait_until(
        lambda: all(healthy(gateway, i, down) == 0.0 for i in range(2)),
        4 * BOUND_S,
        "both workers marking the replica down",
    )
    assert time.monotonic() - t0 < 4 * BOUND_S
    assert all(healthy(gateway, i, u) == 1.0 for i in range(2) for u in urls[1:])
    log.down.discard(port_of(down))
    wait_until(
        lambda: all(healthy(gateway, i, down) == 1.0 for i in range(2)),
        4 * BOUND_S,
        "both workers routing to it again",
    )
    # worker 1 learned it all from worker 0's view: it never had to probe for itself
    assert sample(page(gateway, 1), "kvgate_pod_view_lapses_total") == 0.0


@pytest.mark.parametrize(
    ("path", "env", "interval_s"),
    [
        ("/metrics", {}, METRICS_INTERVAL_S),
        ("/health", {"KVGATE_SCRAPE_METRICS": "false"}, HEALTH_INTERVAL_S),
    ],
    ids=["scrapes", "probes"],
)
def test_the_replicas_see_one_stream_of_scrapes_and_of_probes_from_a_pod(
    redis_url: str, path: str, env: dict[str, str], interval_s: float
) -> None:
    log = StandInLog()
    with stand_ins(3, log) as urls, pod(redis_url, urls, **env) as gateway:
        # the follower has adopted worker 0's view (its own start-up probes are behind it)
        wait_until(
            lambda: (
                (sample(page(gateway, 1), "kvgate_pod_view_datagrams_total", event="received") or 0)
                >= 3
            ),
            15,
            "worker 1 receiving worker 0's view",
        )
        before = {u: log.port_hits[port_of(u), path] for u in urls}
        t0 = time.monotonic()
        time.sleep(WINDOW_S)  # a measurement window, not synchronisation
        elapsed = time.monotonic() - t0
        hits = {u: log.port_hits[port_of(u), path] - before[u] for u in urls}
        # one loop sleeps `interval_s` between its rounds: at most elapsed / interval + 1 rounds
        # (two workers each scraping would be twice that)
        rounds = elapsed / interval_s + 1
        assert all(1 <= n <= rounds for n in hits.values()), (hits, rounds)
        for index in range(2):
            assert all(healthy(gateway, index, u) == 1.0 for u in urls)
        # a datagram late past its cover on a loaded machine is one lapse (the follower then
        # watches for itself until the next view: the designed fallback, seen once in the suite
        # at 0.2-s intervals); one stream of scrapes is what `hits` above holds to its bound
        assert (sample(page(gateway, 1), "kvgate_pod_view_lapses_total") or 0.0) <= 1.0


def replicas_of(gateway: processes.Proc, index: int) -> set[str]:
    """The replicas worker `index` routes to or may route to (in its replica set)."""
    return {
        s.labels["replica"]
        for family in text_string_to_metric_families(page(gateway, index))
        for s in family.samples
        if s.name == "kvgate_replica_healthy"
    }


def discovery_event(gateway: processes.Proc, index: int, kind: str) -> float:
    return sample(page(gateway, index), "kvgate_discovery_events_total", kind=kind) or 0.0


@contextlib.contextmanager
def kube_api(tmp_path: Path) -> Iterator[tuple[KubeStub, dict[str, str]]]:
    """The stub API server, and the settings that make a gateway discover from it."""
    api = KubeStub()
    server = start_app(api.app())
    env = {
        "KVGATE_DISCOVERY": "kubernetes",
        "KVGATE_DISCOVERY_LABEL_SELECTOR": "kubernetes.io/service-name=vllm",
        "KVGATE_DISCOVERY_PORT_NAME": "http",
        "KVGATE_KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", server.url)),
        "KVGATE_DISCOVERY_RETRY_S": "0.1",
    }
    try:
        yield api, env
    finally:
        stop_all([server])


def publish(api: KubeStub, url: str) -> None:
    """One slice per stand-in (each listens on its own port, one port per slice)."""
    name = f"vllm-{port_of(url)}"
    api.put(
        endpoint_slice(name, "vllm", [pod_endpoint("127.0.0.1", name, name)], port=port_of(url))
    )


def test_both_workers_route_around_a_down_replica_and_one_whose_view_goes_silent_probes_itself(
    redis_url: str, tmp_path: Path
) -> None:
    """The pod discovers its replicas: one list and one watch (worker 0's) reach the API server
    while worker 0 runs; worker 1 watches for itself while worker 0 is stopped."""
    log = StandInLog()
    with stand_ins(4, log) as every, kube_api(tmp_path) as (api, env):
        for url in (every[0], every[1], every[3]):
            publish(api, url)
        with pod(redis_url, [], **env) as gateway:
            wait_until(
                lambda: all(
                    replicas_of(gateway, i) == {every[0], every[1], every[3]} for i in range(2)
                ),
                4 * BOUND_S,
                "both workers discovering",
            )
            publish(api, every[2])  # a pod joins and one leaves: both workers follow
            api.delete(f"vllm-{port_of(every[3])}")
            urls = every[:3]
            wait_until(
                lambda: all(replicas_of(gateway, i) == set(urls) for i in range(2)),
                4 * BOUND_S,
                "both workers routing to the pod that joined, not to the one that left",
            )
            assert discovery_event(gateway, 1, "sets_applied") >= 1
            assert api.count("list") == 1 and api.count("watch") == 1  # worker 0's alone
            wait_until(lambda: all(healthy(gateway, i, u) == 1.0 for i in range(2) for u in urls))
            route_around_and_back(gateway, log, urls)
            # worker 0 alive but silent: worker 1 probes, scrapes and watches for itself
            leader = worker_pid(gateway, 0)
            os.kill(leader, signal.SIGSTOP)  # worker 0 alive but silent
            try:
                wait_until(
                    lambda: sample(page(gateway, 1), "kvgate_pod_view_lapses_total") == 1.0,
                    4 * BOUND_S,
                    "worker 1 noticing the silence",
                )
                # worker 0 is stopped: every scrape from now on is worker 1's own
                scrapes = log.port_hits[port_of(urls[1]), "/metrics"]
                wait_until(
                    lambda: log.port_hits[port_of(urls[1]), "/metrics"] >= scrapes + 3,
                    4 * BOUND_S,
                    "worker 1 scraping for itself",
                )
                log.down.add(port_of(urls[0]))
                wait_until(
                    lambda: healthy(gateway, 1, urls[0]) == 0.0,
                    4 * BOUND_S,
                    "worker 1 marking the replica down by its own probes",
                )
                assert healthy(gateway, 1, urls[1]) == 1.0
                wait_until(lambda: api.count("list") == 2, 4 * BOUND_S, "worker 1 listing")
                assert discovery_event(gateway, 1, "takeovers") == 1.0
                api.delete(f"vllm-{port_of(urls[2])}")  # seen by worker 1's own watch
                wait_until(
                    lambda: replicas_of(gateway, 1) == set(urls[:2]),
                    4 * BOUND_S,
                    "worker 1 dropping the pod its own watch saw leave",
                )
            finally:
                os.kill(leader, signal.SIGCONT)
            received = sample(page(gateway, 1), "kvgate_pod_view_datagrams_total", event="received")
            applied = discovery_event(gateway, 1, "sets_applied")
            assert received is not None
            wait_until(
                lambda: (
                    (
                        sample(
                            page(gateway, 1), "kvgate_pod_view_datagrams_total", event="received"
                        )
                        or 0
                    )
                    > received
                    and discovery_event(gateway, 1, "sets_applied") > applied
                ),
                4 * BOUND_S,
                "worker 1 back on worker 0's view and endpoint sets",
            )
            assert all(replicas_of(gateway, i) == set(urls[:2]) for i in range(2))
