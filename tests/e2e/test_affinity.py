"""Conversation affinity through the gateway (issue 40): after every engine's cache and the
directory are wiped, a conversation's next turn goes back to the replica its previous turn
went to, not wherever the load tie-break sends it (the real openai SDK, 4 engines on loopback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import metrics_url
from tests.e2e.test_gateway import SYSTEM, ask
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

ADMIN_KEY = "sk-admin-affinity"
CONVERSATIONS = 6


def _second_turns_stay(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    **overrides: Any,
) -> list[bool]:
    engines = start_engines(4)
    gateway = start_gateway(engines, admin_keys=[ADMIN_KEY], **overrides)
    c = client(gateway)
    turns: list[tuple[list[dict[str, Any]], str]] = []
    for i in range(CONVERSATIONS):
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": words(f"t{i}", 2000)}]
        reply, where = ask(c, messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": words(f"next{i}", 100)},
        ]
        turns.append((messages, where))
    # every engine's prefix cache and the directory's entries for it: evicted everywhere
    wiped = httpx.post(
        metrics_url(gateway) + "/reset_prefix_cache",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert wiped.status_code == 200 and set(wiped.json().values()) == {200}
    stayed = []
    for messages, where in turns:
        reply, again = ask(c, messages)
        usage = reply.usage
        # at most the shared system prompt, which an earlier conversation cached again
        assert usage.engine_cached_tokens < usage.prompt_tokens / 2  # type: ignore[union-attr]
        stayed.append(again == where)
    return stayed


def test_a_conversation_evicted_everywhere_goes_back_to_its_replica(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    # approximate mode takes it when asked (precise mode's default: affinity_weight_for)
    assert all(_second_turns_stay(start_engines, start_gateway, affinity_weight=1.0))


def test_without_affinity_the_tie_break_scatters_them(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    assert not all(_second_turns_stay(start_engines, start_gateway, affinity_weight=0.0))


@pytest.mark.redis
@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_another_gateway_sends_the_turn_home_through_the_shared_directory(
    backend: str,
    redis_url: str,
    redis_cluster_url: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """Turn 1 through gateway A, every cache wiped, turn 2 through gateway B, whose own table
    never saw the conversation: only Redis knows its home."""
    url = redis_url if backend == "redis" else redis_cluster_url
    shared = {
        "redis_url": url,
        "redis_deadline_s": 0.5,
        "redis_write_deadline_s": 5.0,
        "affinity_weight": 1.0,  # approximate mode: asked for
    }
    engines = start_engines(4)
    a = start_gateway(engines, admin_keys=[ADMIN_KEY], **shared)
    b = start_gateway(engines, **shared)
    turns: list[tuple[list[dict[str, Any]], str]] = []
    for i in range(CONVERSATIONS):
        messages: list[dict[str, Any]] = [
            SYSTEM,
            {"role": "user", "content": words(f"{backend}-s{i}", 2000)},
        ]
        reply, where = ask(client(a), messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": words(f"{backend}-n{i}", 100)},
        ]
        turns.append((messages, where))
    wait_until(lambda: director(a).directory.idle, what="the homes reached Redis")
    wiped = httpx.post(
        metrics_url(a) + "/reset_prefix_cache", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert wiped.status_code == 200 and set(wiped.json().values()) == {200}
    stayed = [ask(client(b), messages)[1] == where for messages, where in turns]
    assert all(stayed)
    assert director(b).directory.stats.fallbacks == 0
