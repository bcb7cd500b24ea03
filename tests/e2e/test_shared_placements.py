"""Placements agreed across gateways (issue 39 item 3): a request's placement reaches Redis at
routing time, so another gateway sends the same conversation where it went before the engine
has answered (or written) anything."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import MODEL, metrics_url
from tests.e2e.test_shared_directory import SHARED, ask, conversation
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

ADMIN_KEY = "sk-admin-placements"


def test_a_placement_in_flight_sends_the_next_turn_there_from_another_gateway(
    redis_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    # each engine's first generation request hangs: gateway A's turn has no first token (so
    # no record) while gateway B routes the conversation's next turn
    engines = start_engines(4, hang_first_bytes=1)
    # A gives up on the hung engine after a while (its client would otherwise hold it open);
    # no fan-out holds: a turn that leads a flight is announced by its markers, and a sibling
    # at B waits for its KV (tests/e2e/test_fanout_shared.py)
    shared = {**SHARED, "fanout_hold": False}
    a = start_gateway(engines, redis_url=redis_url, first_byte_timeout_s=1.5, **shared)
    b = start_gateway(engines, redis_url=redis_url, **shared)
    messages = conversation("placed-in-flight")
    hung: list[BaseException] = []

    def first_turn() -> None:
        try:
            client(a).chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        except openai.APIStatusError as exc:
            hung.append(exc)

    thread = threading.Thread(target=first_turn)
    thread.start()
    try:
        wait_until(
            lambda: sum(director(a).stats.decisions.values()) == 1 and director(a).directory.idle,
            what="A placed the first turn and wrote its placement",
        )
        placed = [s.id for s in director(a).replicas.states.values() if s.num_inflight]
        assert len(placed) == 1
        assert director(a).stats.decisions and not director(b).stats.decisions
        follow_up = [
            *messages,
            {"role": "assistant", "content": "working on it"},
            {"role": "user", "content": words("placed-in-flight/turn2", 80)},
        ]
        _, where, matched = ask(b, follow_up)  # the hung engine's second request: answered
        assert where == placed[0]
        assert matched > 0  # B matched A's placement, not a consistent hash's agreement
        assert director(b).directory.stats.fallbacks == 0
    finally:
        thread.join()
    assert hung, "the first turn's engine was to hang until its client left"


def test_the_conversations_home_comes_in_the_lookups_round_trip(
    redis_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """Affinity weighed (issue 39 item 2): gateway B finds the home gateway A recorded, every
    engine's cache wiped, without a second call to Redis for it."""
    shared = {**SHARED, "affinity_weight": 1.0, "admin_keys": [ADMIN_KEY]}
    engines = start_engines(4)
    a, b = (start_gateway(engines, redis_url=redis_url, **shared) for _ in range(2))
    turns = []
    for i in range(3):
        messages = conversation(f"home-in-lookup-{i}")
        reply, where, _ = ask(a, messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": words(f"home-in-lookup-{i}/next", 80)},
        ]
        turns.append((messages, where))
    wait_until(lambda: director(a).directory.idle, what="the homes reached Redis")
    wiped = httpx.post(
        metrics_url(a) + "/reset_prefix_cache", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert wiped.status_code == 200 and set(wiped.json().values()) == {200}
    assert [ask(b, messages)[1] for messages, _ in turns] == [where for _, where in turns]
    stats = director(b).directory.stats
    assert stats.shared_lookups >= 3 and stats.fallbacks == 0
    assert stats.home_round_trips == 0
