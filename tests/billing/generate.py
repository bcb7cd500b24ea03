"""Writes docs/billing.md#agent-session's 50-step session as `kvgate billing simulate` workloads.

    python -m tests.billing.generate      # rewrites tests/billing/session_*.jsonl

Step k sends C_k = 12,000 + 1,500(k−1) tokens: the task (12,000) and, for every earlier step,
its output (400) and its tool result (1,100); one automatic breakpoint on the last segment;
gaps of 60 s between starts, or 8 minutes before steps 6, 11, …, 46 in the gap scenarios;
pings (max_tokens 0) at the previous start + 4.5 minutes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
NUM_STEPS = 50
TASK_TOKENS = 12_000
OUTPUT_TOKENS = 400
TOOL_TOKENS = 1_100
SHORT_GAP_S = 60
LONG_GAP_S = 480
PING_AFTER_S = 270
GAP_STEPS = frozenset(range(6, 47, 5))
"""The nine 8-minute gaps come before steps 6, 11, …, 46 (after every fifth step)."""

SCENARIOS: dict[str, dict[str, Any]] = {
    "uncached": {"ttl": None, "gaps": False, "pings": False},
    "warm_5m": {"ttl": "5m", "gaps": False, "pings": False},
    "expiries": {"ttl": "5m", "gaps": True, "pings": False},
    "1h": {"ttl": "1h", "gaps": True, "pings": False},
    "pings": {"ttl": "5m", "gaps": True, "pings": True},
}


def segments(step: int, ttl: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"id": "task", "tokens": TASK_TOKENS}]
    for j in range(1, step):
        out.append({"id": f"output-{j}", "tokens": OUTPUT_TOKENS})
        out.append({"id": f"tool-{j}", "tokens": TOOL_TOKENS})
    if ttl is not None:
        out[-1]["cache_control"] = {"ttl": ttl}
    return out


def session(
    ttl: str | None, gaps: bool, pings: bool, gap_steps: frozenset[int] = GAP_STEPS
) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    t = 0
    for step in range(1, NUM_STEPS + 1):
        if step > 1:
            long = gaps and step in gap_steps
            if long and pings:
                lines.append(
                    {
                        "t": t + PING_AFTER_S,
                        "tenant": "agent",
                        "segments": segments(step - 1, ttl),
                        "output_tokens": 0,
                        "max_tokens": 0,
                    }
                )
            t += LONG_GAP_S if long else SHORT_GAP_S
        lines.append(
            {
                "t": t,
                "tenant": "agent",
                "segments": segments(step, ttl),
                "output_tokens": OUTPUT_TOKENS,
                "max_tokens": OUTPUT_TOKENS,
            }
        )
    return lines


def render(name: str) -> str:
    return "".join(
        json.dumps(line, separators=(",", ":")) + "\n" for line in session(**SCENARIOS[name])
    )


def main() -> None:
    for name in SCENARIOS:
        (HERE / f"session_{name}.jsonl").write_text(render(name))


if __name__ == "__main__":
    main()
