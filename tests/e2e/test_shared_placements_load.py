"""A peer's placements reach this gateway's load view before its next decision, not at the
next load-share round (`gateway.fleet.shared_load`: published at placement, read in the
lookup's round trip). The round here is a minute long, so after the gateways' start only the
placements' own write and the lookups' read can carry the peer's load: real gateways, real
engines, a real redis-server (and a 3-master Cluster, where the read goes down the load key's
master's lane beside the lookups). Without them the next turn goes to its prefix's replica,
behind the peer's queue."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import redis
from redis.cluster import RedisCluster

from gateway.fleet.shared_load import LOAD_KEY
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import MODEL
from tests.e2e.test_shared_directory import ask, conversation
from tests.e2e.test_shared_load import SLOW, _flood, stacked_peer_and_bounded_gateway
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

ROUND_S = 60.0
"""Longer than the test: after the round each gateway runs at its start, none runs."""


def _published_prefilling(store: redis.Redis | RedisCluster, gateway_id: str, url: str) -> int:
    """The requests prefilling on `url` in the gateway's entry as Redis holds it."""
    value = store.hget(LOAD_KEY, gateway_id)
    if not value:
        return 0
    _, _, figures = value.partition(b"|")
    return sum(int(row[2]) for row in orjson.loads(figures) if row[0] == url)


@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_a_peers_placements_count_at_this_gateways_next_decision(
    backend: str,
    redis_url: str,
    redis_cluster_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    url = redis_url if backend == "redis" else redis_cluster_url
    engines = start_engines(2, timing=SLOW)
    share = {"share_load": True, "load_share_interval_s": ROUND_S}
    peer, here, holder, messages = stacked_peer_and_bounded_gateway(
        start_gateway, engines, url, share, f"placements-load-{backend}"
    )
    peer_load = director(peer).replicas.shared_load
    here_load = director(here).replicas.shared_load
    assert peer_load is not None and here_load is not None
    queued = director(peer).replicas.get(holder)
    seen = director(here).replicas.get(holder)
    store = redis.Redis.from_url(url) if backend == "redis" else RedisCluster.from_url(url)
    try:
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(_flood, peer, messages, n) for n in range(4)]
            wait_until(lambda: queued.num_prefilling >= 3, what="the peer's prefills queued")
            wait_until(
                lambda: _published_prefilling(store, peer_load.gateway_id, queued.url) >= 3,
                what="the peer's placements in Redis, published as they were made",
            )
            if backend == "cluster":  # the read rides beside a lookup: one lookup brings it
                # not awaited: placed on the holder, it would answer after the peer's queue
                # drained, and the decision below would rightly see no load left there
                other = conversation("placements-load-another")
                futures.append(pool.submit(ask, here, other))
                wait_until(
                    lambda: seen.peer is not None and seen.peer.num_prefilling >= 3,
                    what="the peer's placements read beside a lookup",
                )
            else:  # read ahead of the decision's own lookup, in its round trip
                assert seen.peer is None
            raw = client(here).chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=8
            )
            for f in futures:
                f.result()
    finally:
        store.close()
    where, reason = raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-decision"]
    assert (where, reason) != (holder, "prefix")
    assert where != holder and reason == "load_bound"
    # the rounds ran once each, at the start: the placements' write and the lookups' read
    # carried the peer's load
    assert here_load.rounds == 1 and peer_load.rounds == 1
    assert peer_load.published >= 1 and here_load.rides >= 1
    assert here_load.failed == 0 and peer_load.failed == 0
