"""Placement under cache pressure, live: real simulated engines with a small KV publishing
their events over real ZMQ, a precise gateway building each replica's eviction frontier from
them. A new conversation goes where it evicts a cold conversation's blocks, not a hot
session's — which `cache_aware`, blind to what a placement evicts, gets wrong."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from loadgen.text import words
from tests.e2e.test_precise import (
    chat,
    direct,
    indexed,
    parts_of,
    precise_fleet,
    salt_of,
    via,
)
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
__all__ = ["precise_fleet"]  # the fixture, used by name
CAPACITY = 48
"""KV blocks of 16 tokens per engine: room for one ~30-block conversation and a bit more."""
HOT_S, HALF_LIFE_S = 0.5, 0.05
"""The displacement's hot horizon and half-life, shrunk so the test need not wait 15 s: a
conversation idle for 1 s weighs 2^-10 of a live one."""

SYSTEM = {"role": "system", "content": "You are terse." + words("frontier-system", 60)}
HOT = [SYSTEM, {"role": "user", "content": words("frontier-hot", 420)}]
COLD = [
    {"role": "system", "content": "You are verbose." + words("frontier-other", 60)},
    {"role": "user", "content": words("frontier-cold", 420)},
]
NEW = [SYSTEM, {"role": "user", "content": words("frontier-new", 520)}]
"""Shares the hot session's system prompt: the longest cached prefix is on the hot replica."""


def cached(response: dict[str, object]) -> int:
    usage = response["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("policy", ["cache_pressure", "cache_aware"])
def test_a_new_conversation_evicts_the_cold_conversation_not_the_hot_session(
    policy: str,
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (x, y), (gateway,) = precise_fleet(
        2,
        capacity_blocks=CAPACITY,
        gateway_overrides={
            "policy": policy,
            "displacement_hot_s": HOT_S,
            "displacement_half_life_s": HALF_LIFE_S,
            "metrics_interval_s": 0.05,
        },
    )
    states = parts_of(gateway).replicas.states
    wait_until(
        lambda: all((m := states[e.url].metrics) and m.num_gpu_blocks == CAPACITY for e in (x, y)),
        what="the engines' capacity scraped",
    )
    salt = salt_of(gateway)
    direct(x, chat(COLD), salt)  # X: a conversation nobody has used since
    wait_until(indexed(gateway, x.url, 20), what="X's blocks indexed")
    index = parts_of(gateway).keying.precise.index  # type: ignore[union-attr]
    if index.track_recency:  # cache_aware reads no age: nothing to wait for
        wait_until(  # the cold conversation ages past the hot horizon
            lambda: index.eviction_runs(x.url, 1, time.time())[0][1] >= 2 * HOT_S,
            what="X's conversation cold",
        )
    hot = direct(y, chat(HOT), salt)  # Y: a session in use now
    wait_until(indexed(gateway, y.url, 20), what="Y's blocks indexed")
    hot_cached = direct(y, chat(HOT), salt)
    assert cached(hot_cached) >= 16 * 20  # the session's blocks are all on Y

    placed = via(gateway, chat(NEW))
    matched_on_y = int(placed.headers["x-kvgate-matched-blocks"])
    step = chat([*HOT, hot["choices"][0]["message"], {"role": "user", "content": "next"}])
    after = direct(y, step, salt)
    if policy == "cache_pressure":
        # the frontier: on Y it would evict the session's live blocks, on X only cold ones
        assert placed.headers["x-kvgate-replica"] == x.url
        assert cached(after) >= cached(hot_cached)  # the session's next step finds them all
        frontiers = parts_of(gateway).director.frontiers
        assert frontiers is not None and frontiers.num_built >= 2
    else:
        # the longest prefix (the shared system prompt) wins, and the session pays for it
        assert placed.headers["x-kvgate-replica"] == y.url and matched_on_y > 0
        assert cached(after) < cached(hot_cached)
        assert parts_of(gateway).director.frontiers is None
