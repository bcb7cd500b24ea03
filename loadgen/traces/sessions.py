"""Many concurrent agent sessions as a trace: loadgen's 50-step session (`loadgen.workloads.
agent_session`) scaled out, for the simulator's placement-under-cache-pressure runs (issue 16).

Session s starts at s × spacing (+ jitter) and sends `steps` requests; step k's prompt is

    start + (k − 1) × (output + tool) tokens

(the previous prompt, the agent's reply and a tool result: the prefix only grows), so with the
defaults a session grows from 12,000 to 114,900 tokens. The first `system` tokens (tools and
system prompt) are the same hash ids in every session, the rest are the session's own. Steps
follow each other every `interval` seconds (±50%, seeded), open loop: the time an agent takes
for a reply and a tool call, whatever the fleet does. The spacing makes `concurrency` sessions
run at once on average (spacing = a session's duration / concurrency, its duration being
steps × interval plus its gaps).

Optional long gaps, as `loadgen.workloads.agent_session`'s: before every `gap_every`-th step the
session waits `gap` seconds (±50%, seeded) instead of `interval` — a human reviewing, a long
build — long enough for the fleet to evict it everywhere before it comes back (gap_every = 0,
the default: no gaps, the trace is unchanged).

`spec` is "agent-sessions" or "agent-sessions:sessions=160,concurrency=24,..." (any subset of
`SESSION_DEFAULTS`). The same spec gives the same trace (one seeded generator).
"""

from __future__ import annotations

import random

from loadgen.traces.agent import AGENT_BLOCK_SIZE
from loadgen.traces.readers import Trace, TraceRequest
from loadgen.workloads import (
    SESSION_OUTPUT_TOKENS,
    SESSION_START_TOKENS,
    SESSION_STEPS,
    SYSTEM_TOKENS,
    TOOLS_TOKENS,
)

SESSIONS_PREFIX = "agent-sessions"
SESSION_DEFAULTS: dict[str, float] = {
    "sessions": 160,
    "concurrency": 24,
    "steps": SESSION_STEPS,
    "start": SESSION_START_TOKENS,
    "tool": 1_700,
    "output": SESSION_OUTPUT_TOKENS,
    "system": SYSTEM_TOKENS + TOOLS_TOKENS,
    "interval": 10.0,
    "block": AGENT_BLOCK_SIZE,
    "seed": 0,
    "gap_every": 0,
    "gap": 0.0,
}
"""Tool results of 1,700 tokens (loadgen's session has 1,100) so 50 steps reach 100k+ tokens;
a step every ~10 s: a 400-token reply at ~15 ms per token and a short tool call."""


def _options(spec: str) -> dict[str, float]:
    values = dict(SESSION_DEFAULTS)
    _, _, options = spec.partition(":")
    for item in filter(None, options.split(",")):
        name, _, value = item.partition("=")
        if name not in values:
            raise ValueError(
                f"agent-sessions option {name!r} unknown; use {', '.join(SESSION_DEFAULTS)}"
            )
        try:
            values[name] = float(value)
        except ValueError:
            raise ValueError(f"agent-sessions option {name}={value!r}: not a number") from None
    for name in ("sessions", "concurrency", "steps", "start", "output", "interval", "block"):
        if values[name] <= 0:
            raise ValueError(f"agent-sessions option {name} must be positive")
    if values["gap_every"] < 0 or values["gap"] < 0:
        raise ValueError("agent-sessions needs gap_every >= 0 and gap >= 0")
    if values["tool"] < 0 or not 0 <= values["system"] <= values["start"]:
        raise ValueError("agent-sessions needs tool >= 0 and 0 <= system <= start")
    return values


def agent_sessions_trace(spec: str = SESSIONS_PREFIX) -> Trace:
    """The sessions of `spec` merged into one trace in arrival order (module docstring)."""
    v = _options(spec)
    rng = random.Random(int(v["seed"]))
    block = int(v["block"])
    steps, interval = int(v["steps"]), v["interval"]
    gap_every, gap = int(v["gap_every"]), v["gap"]
    num_gaps = (steps - 1) // gap_every if gap_every else 0
    spacing = (steps * interval + num_gaps * (gap - interval)) / v["concurrency"]
    shared = int(v["system"]) // block
    growth = int(v["output"]) + int(v["tool"])
    next_id = shared
    rows: list[tuple[float, int, int, tuple[int, ...], str]] = []
    for s in range(int(v["sessions"])):
        t = s * spacing + rng.uniform(0.0, spacing)
        ids: list[int] = list(range(shared))
        for k in range(steps):
            length = int(v["start"]) + k * growth
            new = max(length // block - len(ids), 0)
            ids.extend(range(next_id, next_id + new))
            next_id += new
            rows.append((t, s, length, tuple(ids), f"agent-session/{s}"))
            pause = gap if gap_every and (k + 1) % gap_every == 0 else interval
            t += pause * rng.uniform(0.5, 1.5)
    rows.sort(key=lambda row: (row[0], row[1]))
    t0 = rows[0][0]
    requests = [
        TraceRequest(i, t - t0, length, int(v["output"]), hash_ids, conversation=conversation)
        for i, (t, _, length, hash_ids, conversation) in enumerate(rows)
    ]
    return Trace(spec, block, requests)
