"""Adapter affinity in the pure router (router.adapters) and the gateway's residency mirror
(gateway.fleet.adapters): resident first, then the prefix under the adapter, never a thrash."""

from __future__ import annotations

import random

from gateway.fleet.adapters import AdapterMirror
from router.adapters import FULL, LOADABLE, RESIDENT
from router.registry import build_policy
from router.types import Replica, RouteRequest

REPLICAS = [Replica(r) for r in ("a", "b", "c", "d")]


def decide(slots: dict[str, int], overlap: dict[str, int] | None = None, **load: float) -> str:
    replicas = [Replica(r.id, pending_prefill_tokens=load.get(r.id, 0.0)) for r in REPLICAS]
    req = RouteRequest(8, 2048, overlap or {}, tokens_per_block=256, adapter_slots=slots)
    decision = build_policy("cache_aware").decide(req, replicas, random.Random(1))
    assert decision is not None
    return decision.replica


def test_a_resident_adapter_wins_over_a_longer_prefix_elsewhere() -> None:
    assert decide({"b": RESIDENT}, {"a": 8}) == "b"


def test_among_loadable_replicas_the_prefix_under_the_adapter_decides() -> None:
    slots = {"a": FULL, "b": LOADABLE, "c": LOADABLE, "d": FULL}
    assert decide(slots, {"c": 6, "d": 8}) == "c"  # d holds more, but loading there thrashes


def test_a_full_replica_is_chosen_only_when_every_replica_is_full() -> None:
    full = dict.fromkeys("abcd", FULL)
    assert decide(full, {"d": 8}) == "d"  # nowhere without a thrash: the prefix still counts


def test_a_busy_resident_replica_spreads_its_adapter_to_a_loadable_one() -> None:
    slots = {"a": RESIDENT, "b": LOADABLE, "c": FULL, "d": FULL}
    assert decide(slots, {}, a=1_000_000.0) == "b"  # a is past the load bound
    assert decide(slots, {}, a=1_000.0) == "a"  # within it, residency holds


def test_the_base_model_ranks_as_without_adapters() -> None:
    for seed in range(5):
        req = RouteRequest(8, 2048, {"c": 3}, tokens_per_block=256)
        plain = build_policy("cache_aware").decide(req, REPLICAS, random.Random(seed))
        assert plain is not None and plain.replica == "c"


def test_the_mirror_keeps_max_lora_adapters_least_recent_first_and_knows_busy_ones() -> None:
    mirror = AdapterMirror()
    assert mirror.slots("x", 0.0) == LOADABLE  # nothing known: no limit
    mirror.observe(2, [], [], 0.0)
    mirror.touch("x", 1.0)
    mirror.touch("y", 2.0)
    assert mirror.slots("x", 2.0) == RESIDENT
    assert mirror.slots("z", 2.5, busy_s=2.0) == FULL  # x sent 1.5 s ago: in use
    assert mirror.slots("z", 3.5, busy_s=2.0) == LOADABLE  # x idle for 2.5 s: its slot
    mirror.observe(2, ["x"], [], 3.5)  # the engine says x runs: most recent now
    assert list(mirror.recent) == ["y", "x"]
    assert mirror.slots("z", 10.0, busy_s=2.0) == LOADABLE  # y idle and not in use
    mirror.observe(2, ["x"], ["y"], 10.0)
    assert mirror.slots("z", 10.0, busy_s=0.1) == FULL  # both in use: loading z would thrash
    assert list(mirror.recent) == ["y", "x"]  # the waiting one before the running one
    mirror.touch("z", 11.0)  # sent anyway (every replica was full): the least recent goes
    assert list(mirror.recent) == ["x", "z"]
