"""`kvgate chaos`: run the scenarios (all, or `--scenario X`), `--repeat N` times, one table.

Each scenario starts its own engines, gateways and Redis on free loopback ports, kills real
processes by pid, and returns an `Outcome`. The exit status is 1 when any goal was not met.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from loadgen.chaos.outcome import Outcome, Size

SCENARIOS: dict[str, str] = {
    "redis-killed": "loadgen.chaos.redis_kill",
    "cluster-failover": "loadgen.chaos.cluster_failover",
    "engine-killed": "loadgen.chaos.engine_kill",
    "redis-slow": "loadgen.chaos.redis_slow",
    "gateway-killed": "loadgen.chaos.gateway_kill",
    "gateway-joined": "loadgen.chaos.gateway_join",
    "disk-full": "loadgen.chaos.disk_full",
    "schemathesis": "loadgen.chaos.schema_fuzz",
    "memory": "loadgen.chaos.memory",
}
"""Name -> module; each module has `run(size: Size) -> Outcome` (imported only when chosen)."""
GATEWAY_KILLS = 20
"""Drains and kill -9s per run of `gateway-killed` in `kvgate chaos`."""


def scenario(name: str) -> Callable[[Size], Outcome]:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    run: Callable[[Size], Outcome] = importlib.import_module(SCENARIOS[name]).run
    return run


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario", action="append", choices=sorted(SCENARIOS), help="run only these"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run each scenario N times")
    parser.add_argument(
        "--kills", type=int, default=GATEWAY_KILLS, help="drains and kill -9s in gateway-killed"
    )
    parser.add_argument("--small", action="store_true", help="the test suite's sizes")
    parser.add_argument("--json", type=Path, help="also write every outcome here")


def table(outcomes: list[tuple[str, float, Outcome]]) -> str:
    rows = [("scenario", "goal", "figure", "met", "wall s")]
    for label, wall_s, o in outcomes:
        for i, g in enumerate(o.goals):
            rows.append((label if i == 0 else "", g.name, g.figure, "yes" if g.met else "NO",
                         f"{wall_s:.0f}" if i == 0 else ""))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for label, _, o in outcomes:
        lines += [f"{label}: {k}: {v}" for k, v in o.figures.items()]
    return "\n".join(lines)


def run_chaos(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.kills < 1:
        raise SystemExit("--repeat and --kills must be at least 1")
    names = args.scenario or list(SCENARIOS)
    size = Size(full=not args.small, repeat=args.kills if not args.small else 1)
    print(f"kvgate chaos {' '.join(args.argv[1:])} on {platform.node()} ({platform.machine()})")
    outcomes: list[tuple[str, float, Outcome]] = []
    for name in names:
        for i in range(min(args.repeat, 100)):
            started = time.monotonic()
            outcome = scenario(name)(size)
            label = name if args.repeat == 1 else f"{name} #{i + 1}"
            outcomes.append((label, time.monotonic() - started, outcome))
            print(outcome.describe(), flush=True)
    print()
    print(table(outcomes))
    if args.json:
        rows = [
            {"scenario": label, "wall_s": wall, "goals": [g.__dict__ for g in o.goals],
             "figures": {k: str(v) for k, v in o.figures.items()}}
            for label, wall, o in outcomes
        ]  # fmt: skip
        args.json.write_text(json.dumps(rows, indent=2))
    met = all(o.met for _, _, o in outcomes)
    print("every goal met" if met else "SOME GOALS NOT MET", file=sys.stderr)
    return 0 if met else 1
