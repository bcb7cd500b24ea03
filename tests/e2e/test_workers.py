"""`kvgate serve --workers 2` as real processes over a real redis-server and real engines: the
kernel spreads fresh connections over both workers, a conversation still keeps to one replica,
the pod's admin port counts every request once, SIGTERM drains both, a worker's death ends the
pod, and without a shared directory the command refuses."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.billing.wal import read_directory
from loadgen.engine.timing import TimingModel
from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.conftest import FAST, MODEL, TENANT_KEY
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

HEADERS = {"authorization": f"Bearer {TENANT_KEY}"}
CHAT = "/v1/chat/completions"
STOP_TIMEOUT_S = processes.STARTUP_TIMEOUT_S
"""How long a pod or a worker may take to stop: a bound, not a wait (like the start's, it is
what a loaded machine under pytest-xdist needs, not what a stop takes)."""


@pytest.fixture
def pod(
    request: pytest.FixtureRequest,
    redis_url: str,
    start_engines: Callable[..., list[Served]],
    tmp_path: Path,
) -> Iterator[processes.Proc]:
    """Two workers over four engines (their timing: the test's indirect parameter, or FAST)."""
    engines = start_engines(4, timing=getattr(request, "param", FAST))
    with launched(redis_url, [e.url for e in engines], tmp_path) as gateway:
        yield gateway


@contextlib.contextmanager
def launched(
    redis_url: str, urls: list[str], tmp_path: Path, metrics_port: int | None = None
) -> Iterator[processes.Proc]:
    """A pod of two workers, up: its public port ready and both workers' admin pages answering."""
    args = ["--workers", "2", "--redis-url", redis_url, "--debug-headers"]
    args += ["--tenant", f"acme:{TENANT_KEY}", "--log-level", "warning"]
    args += ["--grpc-port", str(processes.free_port())]  # both workers bind it too
    env = {
        "KVGATE_BILLING_WAL_DIR": str(tmp_path / "wal"),
        "KVGATE_BILLING_MODEL_MAP": orjson.dumps({MODEL: "gpt-5.6"}).decode(),
    }
    if metrics_port is not None:
        env["KVGATE_METRICS_PORT"] = str(metrics_port)
    gateway = processes.start_gateway(processes.free_port(), urls, args, env=env)
    if metrics_port is not None:
        gateway = dataclasses.replace(gateway, metrics_url=f"http://127.0.0.1:{metrics_port}")
    try:
        processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
        wait_until(
            lambda: all(answers(gateway, i) for i in range(2)),
            processes.STARTUP_TIMEOUT_S,
            "both workers up",
        )
        yield gateway
    finally:
        processes.stop([gateway])


def workers_of(gateway: processes.Proc) -> list[int]:
    return processes.children(gateway.pid)


def pod_args(gateway: processes.Proc) -> list[str]:
    return [str(a) for a in gateway.popen.args]  # type: ignore[union-attr]


def alive(pid: int) -> bool:
    """Running (not exited, nor a zombie waiting for whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def chats_served(page: str) -> float:
    for family in text_string_to_metric_families(page):
        if family.name == "kvgate_http_requests":
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("route") == CHAT
            )
    return 0.0


def answers(gateway: processes.Proc, index: int) -> bool:
    try:
        worker_page(gateway, index)
    except httpx.HTTPError:
        return False
    return True


def worker_page(gateway: processes.Proc, index: int) -> str:
    """One worker's own /metrics, at the admin port the pod's `/pod` lists for it."""
    assert gateway.metrics_url is not None
    pod = httpx.get(f"{gateway.metrics_url}/pod", timeout=5).json()
    port = pod["workers"][index]["admin_port"]
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def ask(gateway: processes.Proc, messages: list[dict[str, Any]]) -> tuple[str, str]:
    """One turn on a fresh connection (httpx.post opens and closes its own)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
    r = httpx.post(gateway.url + CHAT, json=body, headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers["x-kvgate-replica"]


def test_both_workers_serve_one_conversation_on_one_replica_and_metrics_count_it_once(
    pod: processes.Proc, tmp_path: Path
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent." + words("workers/sys", 600)},
        {"role": "user", "content": words("workers/task", 100)},
    ]
    placements = []
    for turn in range(40):  # until both workers served turns (2^-k odds of one alone)
        answer, replica = ask(pod, messages)
        placements.append(replica)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": words(f"workers/turn{turn}", 20)},
        ]
        per_worker = [chats_served(worker_page(pod, i)) for i in range(2)]
        if turn >= 5 and all(per_worker):
            break
    assert all(per_worker), f"the kernel sent every connection to one worker: {per_worker}"
    assert len(set(placements)) == 1, placements
    assert pod.metrics_url is not None
    pod_page = httpx.get(pod.metrics_url + "/metrics", timeout=5).text
    assert chats_served(pod_page) == sum(per_worker) == len(placements)
    assert 'kvgate_replica_healthy{replica="' in pod_page and 'worker="1"' in pod_page
    assert httpx.get(pod.metrics_url + "/openapi.json", timeout=5).json()["paths"]
    # each worker billed what it served, in a WAL directory of its own
    billed = [len(list(read_directory(tmp_path / "wal" / f"worker-{i}"))) for i in range(2)]
    assert billed == per_worker
    grpc_port = int(pod_args(pod)[pod_args(pod).index("--grpc-port") + 1])
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        rpc = pb.GenerateRequest(
            model=MODEL,
            messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])],
            sampling=pb.Sampling(max_tokens=4),
        )
        auth = (("authorization", f"Bearer {TENANT_KEY}"),)
        reply = gateway_pb2_grpc.GatewayStub(channel).Generate(rpc, metadata=auth, timeout=30)
    assert reply.usage.completion_tokens == 4


def inflight(gateway: processes.Proc, index: int) -> float:
    for family in text_string_to_metric_families(worker_page(gateway, index)):
        if family.name == "kvgate_replica_inflight":
            return sum(s.value for s in family.samples)
    return 0.0


@pytest.mark.parametrize("pod", [TimingModel(decode_s_per_token=0.02)], indirect=True)
def test_sigterm_drains_every_worker_and_the_pod_exits_cleanly(pod: processes.Proc) -> None:
    children = workers_of(pod)
    # 6 s a stream: both workers must hold one at once, and on a slow machine the loop below
    # took longer than 1.2 s streams last (the first ones had ended: "every stream went to
    # one worker", once in a suite run)
    body = {"model": MODEL, "max_tokens": 300, "stream": True}
    with contextlib.ExitStack() as stack:
        streams = []
        for n in range(12):  # fresh connections until both workers have a stream in flight
            messages = [{"role": "user", "content": words(f"drain/{n}", 50)}]
            response = stack.enter_context(
                httpx.stream(
                    "POST",
                    pod.url + CHAT,
                    json={**body, "messages": messages},
                    headers=HEADERS,
                    timeout=30,
                )
            )
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            streams.append(lines)
            if all(inflight(pod, i) for i in range(2)):
                break
        assert all(inflight(pod, i) for i in range(2)), "every stream went to one worker"
        pod.popen.send_signal(signal.SIGTERM)  # seconds of each stream still to come
        for lines in streams:
            assert [line for line in lines if line][-1] == "data: [DONE]"
    assert pod.popen.wait(timeout=STOP_TIMEOUT_S) == 0
    assert not any(alive(pid) for pid in children)


def test_a_worker_that_dies_takes_the_pod_down_non_zero(pod: processes.Proc) -> None:
    victim, other = workers_of(pod)
    os.kill(victim, signal.SIGKILL)
    assert pod.popen.wait(timeout=STOP_TIMEOUT_S) != 0
    wait_until(lambda: not alive(other), STOP_TIMEOUT_S, "the other worker stopped")


def test_a_pod_starts_when_the_ports_beside_its_admin_port_are_taken(
    redis_url: str, start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    """The workers' admin ports are the kernel's pick, not `metrics_port + 1 + i`: a pod whose
    neighbouring ports another process holds (a client's ephemeral port, another server) starts,
    and `/pod` names each worker's port and pid. The pod's own port is free from the test's
    close until the supervisor binds it: another test's server may take it in between, which
    the pod refuses with status 2 (the test above); the test then tries three new ports."""
    engines = start_engines(1, timing=FAST)
    for attempt in range(1, processes.START_ATTEMPTS + 1):
        with contextlib.ExitStack() as stack:
            base, held = three_ports_in_a_row(stack)
            held[0].close()  # the pod's own admin port; the two beside it stay taken
            for sock in held[1:]:
                sock.listen()
            try:
                with launched(redis_url, [engines[0].url], tmp_path, metrics_port=base) as pod:
                    workers = httpx.get(f"http://127.0.0.1:{base}/pod", timeout=5).json()
                    page = httpx.get(f"http://127.0.0.1:{base}/metrics", timeout=5).text
                    assert sorted(w["pid"] for w in workers["workers"]) == sorted(workers_of(pod))
            except processes.ExitedBeforeReady as exc:
                if "status 2" not in str(exc) or attempt == processes.START_ATTEMPTS:
                    raise
                continue
            ports = {w["admin_port"] for w in workers["workers"]}
            assert ports.isdisjoint({base, base + 1, base + 2})
            assert chats_served(page) == 0
            return


def three_ports_in_a_row(stack: contextlib.ExitStack) -> tuple[int, list[socket.socket]]:
    """A free port whose next two are free too, all three bound by sockets `stack` holds."""
    for _attempt in range(50):
        held = [stack.enter_context(socket.socket()) for _ in range(3)]
        base = processes.free_port()
        try:
            for offset, sock in enumerate(held):
                sock.bind(("127.0.0.1", base + offset))
        except OSError:
            for sock in held:
                sock.close()
            continue
        return base, held
    raise AssertionError("no three free ports in a row in 50 tries")


def test_a_pod_whose_admin_port_is_taken_exits_at_once_naming_it(redis_url: str) -> None:
    """The supervisor binds the pod's admin port before it starts a worker: a taken port is a
    clear refusal at once, not a traceback after two workers started (which could themselves
    take the port in between: their admin sockets are the kernel's pick)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--workers", "2", "--redis-url", redis_url, "--engine", "http://x:1"]
        done = subprocess.run(
            [sys.executable, "-m", "kvgate_cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "KVGATE_METRICS_PORT": str(port)},
        )
    assert done.returncode == 2
    assert f"the admin port 127.0.0.1:{port} is taken" in done.stdout
    assert "Traceback" not in done.stderr


def test_workers_without_a_shared_directory_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate_cli", "serve", "--workers", "2", "--engine", "http://x:1"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "workers: 2 needs redis_url (--redis-url)" in done.stdout


def test_workers_do_not_outlive_a_supervisor_killed_by_sigkill(pod: processes.Proc) -> None:
    children = workers_of(pod)
    pod.popen.kill()  # no drain forwarded: the kernel's parent-death signal drains them
    pod.popen.wait(timeout=STOP_TIMEOUT_S)
    wait_until(
        lambda: not any(alive(pid) for pid in children), STOP_TIMEOUT_S, "the orphans stopped"
    )


def test_while_redis_is_away_each_worker_falls_back_on_the_whole_pods_placements(
    fresh_redis: RedisServer,
    start_engines: Callable[..., list[Served]],
    tmp_path: Path,
) -> None:
    """Issue 45 item 15 / issue 39 item 5: with Redis away every lookup is answered by the
    worker's own local index. It held only what that worker placed, so a conversation whose
    next turn the kernel gave the other worker (half of them: connections are spread by their
    4-tuple) matched nothing. The workers now send each other their placements."""
    engines = start_engines(4)
    with launched(fresh_redis.url, [e.url for e in engines], tmp_path) as gateway:
        fresh_redis.stop()
        matched = []
        for i in range(8):
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": words(f"away/{i}/sys", 600)},
                {"role": "user", "content": words(f"away/{i}/task", 100)},
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
            first = httpx.post(gateway.url + CHAT, json=body, headers=HEADERS, timeout=30)
            assert first.status_code == 200, first.text
            messages += [
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": words(f"away/{i}/next", 20)},
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
            second = httpx.post(gateway.url + CHAT, json=body, headers=HEADERS, timeout=30)
            assert second.status_code == 200, second.text
            matched.append(int(second.headers["x-kvgate-matched-blocks"]))
        assert all(m > 0 for m in matched), matched
