"""Redis SIGKILLed mid-run and restarted empty, conversations going on throughout.

The scenario is `kvgate bench-redis-reset` (loadgen/bench/redis_reset.py) without waiting for
the gateway to route on Redis again: the rounds after the restart start at once. Goals: no
request fails (counted by the client), the hit ratio in the first seconds after the restart is
no lower than before the kill (within `DIP_TOLERANCE`), no conversation changes replica.
"""

from __future__ import annotations

import argparse

from loadgen.bench.redis_reset import add_bench_redis_reset_arguments, run_arm
from loadgen.chaos.outcome import Outcome, Size, ratio

DIP_TOLERANCE = 0.05
"""Hit ratio points the rounds after may sit below the rounds before: the new turns' own
suffixes vary by a few tokens from round to round."""


def run(size: Size) -> Outcome:
    parser = argparse.ArgumentParser()
    add_bench_redis_reset_arguments(parser)
    options = (
        "--engines 4 --conversations 20 --rounds-before 3 --rounds-after 8"
        if size.full
        else "--engines 3 --conversations 6 --rounds-before 1 --rounds-after 2"
    )
    f = run_arm(parser.parse_args(options.split()), None)
    phases = ("cold", "before", "outage", "after")
    requests = sum(f[p]["requests"] for p in phases)
    failed = sum(f[p]["failed"] for p in phases)
    before, after = f["before"]["hit_ratio"], f["window"]["hit_ratio"]
    out = Outcome("redis-killed")
    out.goal("failed requests", failed == 0, f"{failed} of {requests}")
    dip = before is not None and after is not None and after >= before - DIP_TOLERANCE
    out.goal("no dip after (first 2 s vs before)", dip, f"{ratio(after)} vs {ratio(before)}")
    out.goal("conversations moved", f["moved"] == 0, f"{f['moved']} of {f['conversations']}")
    out.figures["hit ratio before / outage / first 2 s / later"] = " / ".join(
        ratio(f[p]["hit_ratio"]) for p in ("before", "outage", "window", "later")
    )
    return out
