"""Precise and approximate never disagree for worse (issue 40, item 3): on every shipped
workload, at a fleet KV of 5% to 50% of its unique blocks, precise mode's hit ratio is at least
approximate's minus half a point, for `cache_aware` and `cache_pressure` alike.

A parametrized sweep of small slices (each a few seconds of virtual-time simulation): the
Mooncake conversation and synthetic traces, the agent-session generator (64-token blocks, 512-
token blocks with human pauses that get sessions evicted everywhere, vLLM's 16-token blocks)
and the hot spine. (The sample files of loadgen/traces/samples are format examples of a few
requests: at these fractions their replicas hold one block each.)

The property holds everywhere since issue 40's round 7 (`KNOWN_GAPS` is empty: a gap found
again is held to its measured size there, so a change that widens it fails). Under load the
simulator's issue-shaped trace measures it (docs/precise.md): not a property of this sweep."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest

from loadgen.sim import APPROXIMATE, PRECISE, SimConfig, run_policies
from loadgen.traces import CONVERSATION_TRACE, SYNTHETIC_TRACE
from loadgen.traces.readers import Trace, hot_spine_trace, read_trace
from loadgen.traces.sessions import agent_sessions_trace

TOLERANCE = 0.005
"""Half a point of hit ratio: a random tie-break may land either way on a small slice."""

WORKLOADS: dict[str, Callable[[], Trace]] = {
    "mooncake-conversation": lambda: read_trace(CONVERSATION_TRACE, start=2000, limit=250),
    "mooncake-synthetic": lambda: read_trace(SYNTHETIC_TRACE, limit=250),
    "agent-sessions": lambda: agent_sessions_trace(
        "agent-sessions:sessions=10,concurrency=4,steps=12,start=6000,tool=1500"
    ),
    "agent-sessions-paused-512": lambda: agent_sessions_trace(
        "agent-sessions:sessions=12,concurrency=5,steps=15,start=6000,tool=1500,block=512,"
        "gap_every=5,gap=300"
    ),
    "agent-sessions-16": lambda: agent_sessions_trace(
        "agent-sessions:sessions=6,concurrency=3,steps=8,start=3000,tool=800,block=16"
    ),
    "hot-spine": lambda: hot_spine_trace("hot-spine:rate=20,seconds=5"),
}

KNOWN_GAPS: dict[tuple[str, str, float], float] = {}
"""(policy, workload, KV) -> how far below approximate precise mode may read there, measured.
Closed in issue 40's round 7: `cache_aware` on the paused sessions at 10%, 0.81 points below
approximate at its default (no affinity: its stale prediction keeps that trace's conversations
home), +2.49 points once a return evicted everywhere leaves an outweighed home
(`router.scorers.outweighed_home`). Closed in round 4: the 16-token sessions at 10%
(`cache_pressure` 0.78 points when measured, 0.39 since round 3) and the synthetic slice at 5%
(`cache_pressure` 0.84 points, the whole of approximate's few hits: with the simulator modelling
the gateway's speculative entries, precise reads 0.35 points above approximate; 0.41 with round
5's defaults)."""


@cache
def _trace(name: str) -> Trace:
    return WORKLOADS[name]()


@pytest.mark.parametrize("capacity_frac", [0.05, 0.10, 0.25, 0.50])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_precise_is_never_worse_than_approximate(workload: str, capacity_frac: float) -> None:
    trace = _trace(workload)
    config = SimConfig(num_replicas=4, capacity_frac=capacity_frac)
    # cache_pressure in approximate mode has no frontier: it is cache_aware, not run twice
    _, (approximate_run,) = run_policies(trace, ["cache_aware"], config, (APPROXIMATE,))
    _, precise_runs = run_policies(trace, ["cache_aware", "cache_pressure"], config, (PRECISE,))
    by_label = {r.label: r for r in precise_runs}
    approximate = approximate_run.hit_ratio
    for policy in ("cache_aware@precise", "cache_pressure@precise"):
        precise = by_label[policy].hit_ratio
        tolerance = KNOWN_GAPS.get((policy, workload, capacity_frac), TOLERANCE)
        assert precise >= approximate - tolerance, (
            f"{workload} at {capacity_frac:.0%} KV: {policy} {precise:.2%} against "
            f"approximate {approximate:.2%}"
        )
