"""The agent-sessions trace generator (loadgen.traces.sessions)."""

from __future__ import annotations

import itertools

import pytest

from loadgen.traces.sessions import agent_sessions_trace


def test_sessions_grow_their_prefix_and_share_only_the_system_prompt() -> None:
    trace = agent_sessions_trace("agent-sessions:sessions=3,steps=4,start=4000,tool=200,output=56")
    assert trace.block_size == 64 and len(trace.requests) == 12
    by_session: dict[str, list[tuple[float, int, tuple[int, ...]]]] = {}
    for r in trace.requests:
        assert r.conversation is not None
        by_session.setdefault(r.conversation, []).append((r.arrival_s, r.input_length, r.hash_ids))
    assert len(by_session) == 3
    system_blocks = (2_700 + 200) // 64
    for steps in by_session.values():
        assert [length for _, length, _ in steps] == [4000, 4256, 4512, 4768]
        for (t0, _, a), (t1, length, b) in itertools.pairwise(steps):
            assert t1 > t0 and b[: len(a)] == a and len(b) == length // 64
    firsts = [steps[0][2] for steps in by_session.values()]
    assert all(f[:system_blocks] == tuple(range(system_blocks)) for f in firsts)
    own = [set(f[system_blocks:]) for f in firsts]
    assert not (own[0] & own[1]) and not (own[1] & own[2])
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    assert trace.requests[0].arrival_s == 0.0


def test_the_defaults_reach_past_100k_tokens_and_the_same_spec_gives_the_same_trace() -> None:
    spec = "agent-sessions:sessions=2,seed=3"
    a, b = agent_sessions_trace(spec), agent_sessions_trace(spec)
    assert a.requests == b.requests
    assert max(r.input_length for r in a.requests) == 12_000 + 49 * 2_100
    assert agent_sessions_trace("agent-sessions:sessions=2,seed=4").requests != a.requests


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("agent-sessions:users=3", "option 'users' unknown; use sessions, concurrency"),
        ("agent-sessions:steps=x", "steps='x': not a number"),
        ("agent-sessions:interval=0", "interval must be positive"),
        ("agent-sessions:system=20000", "0 <= system <= start"),
    ],
)
def test_bad_options_are_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        agent_sessions_trace(spec)


def test_replay_and_bench_read_the_spec_as_a_trace_sliced_and_shifted() -> None:
    """`read_trace` (what `kvgate replay` and `kvgate bench` open) builds the sessions from a
    spec: the simulator's requests from `start`, `limit` of them, arrivals from 0."""
    from loadgen.traces.readers import read_trace

    spec = "agent-sessions:sessions=3,steps=4,start=4000,tool=200,output=56"
    whole = agent_sessions_trace(spec)
    sliced = read_trace(spec, start=2, limit=5, num_tenants=2)
    assert [r.hash_ids for r in sliced.requests] == [r.hash_ids for r in whole.requests[2:7]]
    assert [r.index for r in sliced.requests] == list(range(5))
    assert sliced.requests[0].arrival_s == 0.0 and sliced.block_size == 64
    assert {r.tenant for r in sliced.requests} <= {"tenant-0", "tenant-1"}
    with pytest.raises(ValueError, match="blocks are 64 tokens"):
        read_trace(spec, block_size=16)


def test_gaps_pause_every_nth_step_and_leave_the_trace_unchanged_when_off() -> None:
    spec = "agent-sessions:sessions=1,steps=7,start=4000,tool=200,output=56,interval=10"
    plain = agent_sessions_trace(spec)
    assert agent_sessions_trace(spec + ",gap_every=0,gap=900").requests == plain.requests
    gapped = agent_sessions_trace(spec + ",gap_every=3,gap=900")
    waits = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(gapped.requests)]
    # before steps 4 and 7 (1-based) the session waits 900 s ±50%, else 10 s ±50%
    assert [i for i, w in enumerate(waits) if w >= 450] == [2, 5]
    assert all(5 <= w <= 15 for i, w in enumerate(waits) if i not in (2, 5))
    assert [r.hash_ids for r in gapped.requests] == [r.hash_ids for r in plain.requests]
    with pytest.raises(ValueError, match="gap_every >= 0 and gap >= 0"):
        agent_sessions_trace("agent-sessions:gap=-1")
