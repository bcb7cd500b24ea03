from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.server.app import create_app
from gateway.settings import Settings, load_settings
from loadgen.engine.server import Engine, EngineConfig, create_engine_app
from loadgen.engine.timing import TimingModel
from loadgen.harness.redis_servers import RedisServer
from tests.servers import Served, start_app, stop_all

# The tests speak plain HTTP over loopback only, so no test needs a trust store; but every
# `httpx.get(...)` builds a client whose TLS context loads certifi's bundle (~27 ms of CPU a
# call on this machine, thousands of calls a suite, in the processes the tests start as well).
# An empty certificate directory makes that context free; a developer's own setting is kept.
os.environ.setdefault("SSL_CERT_DIR", tempfile.mkdtemp(prefix="kvgate-no-ca-"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that start servers (`e2e`) first, the unit tests after, each file's tests in
    their order: `make test`'s `--dist loadfile --no-loadscope-reorder` hands files out in this
    order (without that flag xdist sorts the files by their number of tests and this order is
    lost), so the minutes-long files start early and the many short ones fill the workers at
    the end instead of one worker finishing a long file alone."""
    serving = {item.path for item in items if item.get_closest_marker("e2e") is not None}
    items.sort(key=lambda item: item.path not in serving)


FAST = TimingModel(time_scale=1000.0)
"""Engines 1000x faster than real time: a 10k-token prefill takes under a millisecond."""
TENANT_KEY = "sk-test-acme"
OTHER_KEY = "sk-test-globex"
MODEL = "kvgate-sim-8b"


def slow_timing(before_first_token: bool) -> TimingModel:
    """An engine whose answer a client gives up on: a prefill of ~3,000 tokens at 100 tokens/s
    takes 30 s (the wait before the first token), or 1,000 tokens at 20 ms each take 20 s."""
    if before_first_token:
        return TimingModel(prefill_tokens_per_s=100.0)
    return TimingModel(decode_s_per_token=0.02)


def metrics_url(gateway: Served) -> str:
    """An in-process gateway's admin port (/metrics, the API documents)."""
    return f"http://127.0.0.1:{gateway.app.state.metrics_port}"


def engine_of(served: Served) -> Engine:
    engine: Engine = served.app.state.engine
    return engine


@pytest.fixture
def start_engines() -> Iterator[Callable[..., list[Served]]]:
    started: list[Served] = []

    def start(n: int = 4, **config: Any) -> list[Served]:
        config.setdefault("timing", FAST)
        new = [start_app(create_engine_app(EngineConfig(**config))) for _ in range(n)]
        started.extend(new)
        return new

    yield start
    stop_all(started)


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(engines: list[Served], **overrides: Any) -> Served:
        settings = gateway_settings([e.url for e in engines], **overrides)
        started.append(start_app(create_app(settings)))
        return started[-1]

    yield start
    stop_all(started)


def gateway_settings(engine_urls: list[str], **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "engines": engine_urls,
        "tenants": [f"acme:{TENANT_KEY}", f"globex:{OTHER_KEY}"],
        "server_secret": "test-secret",
        "health_interval_s": 0.05,
        "unhealthy_after": 1,
        "debug_headers": True,
        "seed": 7,
        "metrics_port": 0,  # the admin port: any free one (tests run gateways side by side)
    }
    values.update(overrides)
    return load_settings(**values)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server for the whole session, on a unix socket (never port 6379).
    Tests that share it use their own key prefixes or flush only what they wrote."""
    from loadgen.harness.redis_servers import redis_server

    with redis_server() as server:
        yield server.url


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own (TCP on a free port): it may be killed and restarted."""
    from loadgen.harness.redis_servers import redis_server

    with redis_server(port=0) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A real 3-master Redis Cluster for the whole session, on free loopback ports."""
    from loadgen.harness.redis_servers import redis_cluster

    with redis_cluster() as cluster:
        yield cluster.url


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    """Every SDK client a test opened through tests.clients is closed after it. Where no test
    has imported tests.clients there is none: the SDKs' import (~2 s, ~15 s on a loaded machine)
    is not paid by a test that never used them."""
    yield
    clients = sys.modules.get("tests.clients")
    if clients is not None:
        clients.close_all()
