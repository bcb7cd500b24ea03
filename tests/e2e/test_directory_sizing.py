"""The approximate directory sized from the engines' reported KV (issue 42): a gateway left at
the default `directory_capacity_blocks` (65,536 entries, an H100's KV several times over) in
front of small simulated engines forgets a prefix when the engine that held it has evicted it,
instead of predicting it there for the TTL. Real engines over loopback HTTP, a real
redis-server for the shared directory."""

from __future__ import annotations

import math
from collections.abc import Callable

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.directory.routing import RoutingDirectory
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.text import words
from tests.clients import director
from tests.conftest import FAST, MODEL, TENANT_KEY, metrics_url
from tests.servers import Served, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

SMALL_KV_BLOCKS = 64
"""Engine blocks of 16 tokens: 1,024 tokens of KV, 16 directory entries at the configured 4
bytes a token (before any response taught the gateway the text's ratio)."""
SMALL_ENTRIES = SMALL_KV_BLOCKS * 16 * 4 // 256
PROMPT_TOKENS = 400
"""~10 directory entries of the simulated tokenizer's text (~6.5 bytes a token: ~26 entries of
KV), 26 KV blocks: four more such prompts on one replica pass both its engine's KV and its
directory's cap."""


def ask(gateway: Served, content: str) -> tuple[str, int, int]:
    """One chat turn: the replica, the blocks the gateway predicted cached there, and the
    tokens the engine found cached."""
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (
        response.headers["x-kvgate-replica"],
        int(response.headers["x-kvgate-matched-blocks"]),
        cached,
    )


def directory_of(gateway: Served) -> RoutingDirectory:
    directory: RoutingDirectory = gateway.app.state.parts.directory
    return directory


def test_a_prefix_the_small_engine_evicted_is_no_longer_predicted_there(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, capacity_blocks=SMALL_KV_BLOCKS)
    gateway = start_gateway(engines)  # directory_capacity_blocks: the default, 65,536
    page = httpx.get(metrics_url(gateway) + "/metrics").text
    for e in engines:
        assert directory_of(gateway).local.index.capacity_of(e.url) == SMALL_ENTRIES
        assert f'kvgate_directory_capacity_entries{{replica="{e.url}"}} 16.0' in page
    prompt = words("sizing-p", PROMPT_TOKENS)
    home, _, _ = ask(gateway, prompt)
    assert ask(gateway, prompt)[1:] != (0, 0)  # predicted and cached where it went
    # other prompts until four more landed there: its engine evicted the prefix whole
    landed = 0
    for i in range(60):
        replica, _, _ = ask(gateway, words(f"sizing-q{i}", PROMPT_TOKENS))
        landed += replica == home
        if landed == 4:
            break
    assert landed == 4
    replica, predicted, cached = ask(gateway, prompt)
    assert cached == 0  # the premise: no engine holds the prefix any more
    # the directory forgot it too (unsized it predicted the whole prompt at `home`: a miss
    # reconciliation would correct only after the request had been sent there)
    assert predicted == 0, f"predicted {predicted} blocks cached at {replica}"
    # the capacity followed the ratio the responses taught (the simulated tokenizer's words)
    ratio = director(gateway).estimator.fleet_bytes_per_token
    assert 5.0 < ratio < 8.0
    learned = math.ceil(SMALL_KV_BLOCKS * 16 * ratio / 256)
    wait_until(lambda: directory_of(gateway).local.index.capacity_of(home) == learned)


def test_the_capacity_follows_an_engine_restarted_with_another_kv_and_redis_gets_it(
    start_gateway: Callable[..., Served], redis_url: str
) -> None:
    engine = start_app(create_engine_app(EngineConfig(timing=FAST, capacity_blocks=64)))
    started = [engine]
    try:
        gateway = start_gateway([engine], redis_url=redis_url)
        directory = directory_of(gateway)
        assert directory.shared is not None
        assert directory.local.index.capacity_of(engine.url) == SMALL_ENTRIES
        assert directory.shared.capacity_of(engine.url) == SMALL_ENTRIES
        stop_all([engine])
        # the same port, a KV 8x larger (a new engine version, another GPU): 128 entries
        engine = start_app(
            create_engine_app(EngineConfig(timing=FAST, capacity_blocks=512)), engine.port
        )
        started.append(engine)
        wait_until(
            lambda: directory.local.index.capacity_of(engine.url) == 8 * SMALL_ENTRIES,
            what="the capacity of the restarted engine",
        )
        assert directory.shared.capacity_of(engine.url) == 8 * SMALL_ENTRIES
    finally:
        stop_all(started)


def test_an_engine_larger_than_the_setting_or_silent_keeps_the_setting(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(1)  # 4,096 blocks: 1,024 entries at 4 bytes a token
    silent = start_app(_no_metrics_engine())
    try:
        gateway = start_gateway([*engines, silent], directory_capacity_blocks=500)
        index = directory_of(gateway).local.index
        assert index.capacity_of(engines[0].url) == 500  # the setting is the smaller
        assert index.capacity_of(silent.url) == 500  # no KV reported: the setting
        page = httpx.get(metrics_url(gateway) + "/metrics").text
        for url in (engines[0].url, silent.url):
            assert f'kvgate_directory_capacity_entries{{replica="{url}"}} 500.0' in page
        assert ask(gateway, "hello " + words("sizing-silent", 50))[0] in {
            engines[0].url,
            silent.url,
        }
    finally:
        stop_all([silent])


def _no_metrics_engine() -> Starlette:
    """A simulated engine whose /metrics has no `vllm:cache_config_info` (as SGLang's)."""
    app = create_engine_app(EngineConfig(timing=FAST))

    async def bare(request: Request) -> PlainTextResponse:
        return PlainTextResponse("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app.router.routes.insert(0, Route("/metrics", bare))
    return app
