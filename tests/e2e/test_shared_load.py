"""Two gateways on one Redis see each other's load (`gateway.fleet.shared_load`): a peer's long
prefills queued on the replica holding a conversation move that conversation's next turn at
this gateway, as its own would — real gateways, real engines, a real redis-server. Without the
shared view the turn goes to the prefix (the assertion fails). Engine scraping is off at the
deciding gateway, so nothing but the shared view can tell it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import MODEL, TENANT_KEY, metrics_url
from tests.e2e.test_shared_directory import SHARED, ask, conversation
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SLOW = TimingModel(prefill_tokens_per_s=4_000.0)
"""~1 s per 4,000-token prefill: the peer's queue stays queued while the other gateway routes."""


def _flood(gateway: Served, messages: list[dict[str, Any]], n: int) -> None:
    body = {
        "model": MODEL,
        "messages": [*messages, {"role": "user", "content": words(f"flood-{n}", 2500)}],
        "max_tokens": 1,
    }
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def stacked_peer_and_bounded_gateway(
    start_gateway: Callable[..., Served],
    engines: list[Served],
    redis_url: str,
    share: dict[str, Any],
    name: str,
) -> tuple[Served, Served, str, list[dict[str, Any]]]:
    """Two gateways on one Redis: a peer that stacks its prompts on a prefix (a huge slack, no
    spreading, no flow control, whose affinity wait holds a request back from a replica without
    room) and one that bounds load tightly and scrapes no engine (only shared figures can tell
    it the peer's load). The conversation `name`'s first turn is asked at the second and
    recorded in Redis: returns (peer, here, the replica holding it, its next turn)."""
    peer = start_gateway(
        engines,
        redis_url=redis_url,
        absolute_slack_tokens=10_000_000,
        overflow=False,
        fanout_hold=False,
        flow_control=False,
        **SHARED,
        **share,
    )
    here = start_gateway(
        engines,
        redis_url=redis_url,
        absolute_slack_tokens=2_000,
        scrape_metrics=False,
        overflow=False,
        **SHARED,
        **share,
    )
    messages = conversation(name)
    reply, holder, _ = ask(here, messages)
    wait_until(lambda: director(here).directory.idle, what="the first turn's record in Redis")
    return (
        peer,
        here,
        holder,
        [
            *messages,
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": words("next turn", 50)},
        ],
    )


@pytest.mark.parametrize("shared", [True, False])
def test_a_peers_queued_prefills_move_the_next_turn_off_their_replica(
    shared: bool,
    redis_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    engines = start_engines(2, timing=SLOW)
    share = {"share_load": shared, "load_share_interval_s": 0.05}
    peer, here, holder, messages = stacked_peer_and_bounded_gateway(
        start_gateway, engines, redis_url, share, f"shared-load-{shared}"
    )
    queued = director(peer).replicas.get(holder)
    seen = director(here).replicas.get(holder)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_flood, peer, messages, n) for n in range(4)]
        wait_until(lambda: queued.num_prefilling >= 3, what="the peer's prefills queued")
        if shared:
            wait_until(
                lambda: seen.peer is not None and seen.peer.num_prefilling >= 3,
                what="the peer's queue in this gateway's view",
            )
        raw = client(here).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8
        )
        page = httpx.get(metrics_url(here) + "/metrics").text
        for f in futures:
            f.result()
    where, reason = raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-decision"]
    if shared:
        assert where != holder and reason == "load_bound"
        assert 'kvgate_load_shared_rounds_total{event="ok"}' in page
        assert 'kvgate_load_shared_calls_total{call="published"}' in page
        shared_load = director(here).replicas.shared_load
        assert shared_load is not None and shared_load.failed == 0
    else:
        assert (where, reason) == (holder, "prefix")
        assert "kvgate_load_shared_rounds_total" not in page
