"""Conversation affinity through the gateway (issue 40): after every engine's cache and the
directory are wiped, a conversation's next turn goes back to the replica its previous turn
went to, not wherever the load tie-break sends it (the real openai SDK, 4 engines on loopback).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from cachemap.tokenizer import ModelTokenizer
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words
from tests.clients import director
from tests.clients import openai_client as client
from tests.conftest import metrics_url
from tests.e2e.test_gateway import SYSTEM, ask
from tests.e2e.test_precise import chat, direct, indexed, join, precise_settings, salt_of
from tests.loadgen.test_kv_events import events_config, free_ports
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


def _grown(i: int, tag: str) -> list[dict[str, Any]]:
    """The bench's agent-session shape: one user message that every turn extends (the agent's
    reply and a tool result appended to it). Its length is chosen so the chat template's end
    of turn and generation prompt fall in its last full 16-token block, as they do in most of
    the bench's prompts (whose lengths are multiples of 4 tokens): turn 2 shares turn 1's text
    but not that block."""
    tokenizer = ModelTokenizer(MODEL_DIR)
    for n in itertools.count(2000):
        messages = [SYSTEM, {"role": "user", "content": words(f"{tag}{i}", n)}]
        if tokenizer.count(tokenizer.render_chat(messages)) % 16 < 3:
            return messages
    raise AssertionError("unreachable")


def _appended(i: int, tag: str, reply: str) -> list[dict[str, Any]]:
    return [
        *_grown(i, tag),
        {"role": "assistant", "content": reply},
        {"role": "user", "content": words(f"{tag}-next{i}", 100)},
    ]


@pytest.mark.parametrize("shape", ["grown", "appended"])
def test_precise_mode_finds_the_home_though_the_last_blocks_differ(
    shape: str,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """Precise mode keys the engines' 16-token blocks of the rendered chat: the previous
    prompt's last blocks (the end of its turn, the generation prompt) are not in the next
    prompt's chain. The home was recorded under the very last one, so a continuation evicted
    everywhere found no home and went where the tie-break sent it (the live bench's agent
    sessions: 54 of 66 continuations). Each first turn is sent to a chosen engine (its blocks
    put there beforehand, as another turn would), not where the tie-break would send it."""
    base = free_ports(4)
    engines = [start_engines(1, kv_events=events_config(base + i))[0] for i in range(4)]
    ports = {e.url: base + i for i, e in enumerate(engines)}
    gateway = start_gateway(engines, **precise_settings(ports, admin_keys=[ADMIN_KEY]))
    join([gateway], engines)
    c, salt = client(gateway), salt_of(gateway)
    turns: list[tuple[list[dict[str, Any]], str]] = []
    for i in range(CONVERSATIONS):
        first, there = _grown(i, shape), engines[i % len(engines)]
        direct(there, chat(first), salt)
        wait_until(indexed(gateway, there.url, 100), what="the first turn indexed")
        reply, where = ask(c, first)
        assert where == there.url
        if shape == "grown":
            text = first[1]["content"] + reply.choices[0].message.content
            second = [SYSTEM, {"role": "user", "content": text + words(f"tool{i}", 100)}]
        else:
            second = _appended(i, shape, reply.choices[0].message.content)
        turns.append((second, where))
        httpx.post(there.url + "/reset_prefix_cache")  # the next conversation starts anywhere
    wiped = httpx.post(
        metrics_url(gateway) + "/reset_prefix_cache",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert wiped.status_code == 200 and set(wiped.json().values()) == {200}
    stayed = []
    for messages, where in turns:
        reply, again = ask(c, messages)
        usage = reply.usage
        assert usage.engine_cached_tokens < usage.prompt_tokens / 2  # type: ignore[union-attr]
        stayed.append(again == where)
    assert all(stayed), stayed
