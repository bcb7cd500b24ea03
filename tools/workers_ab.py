"""`--workers 1` against `--workers 2`, on this tree and another checkout, side by side in one run.

    python -m tools.workers_ab REQUESTS TREE:WORKERS[,TREE:WORKERS...] [NAME=DIR ...]

    python -m tools.workers_ab 400 base:1,here:1,base:2,here:2 base=/tmp/base

Each arm is what `kvgate bench`'s `workers1` / `workers2` arms run (fresh simulated engines of
bench point 1, a fresh redis-server, one `kvgate serve --workers N --redis-url ...`, the replay
of `REQUESTS` requests from line 4,000 at time scale 4), with the gateway's code taken from the
named tree (`here` is this checkout; another, e.g. an older commit exported with `git archive`,
runs through `processes.start_gateway(cwd=)`). A workers count ending in `m` (`here:1m`) runs
the same gateway over its in-process directory (no Redis), for comparison. One markdown row per
arm: errors, hit ratio, TTFT, the gateway's process-tree CPU per request, the directory's
counters from the pod's merged /metrics (lookups answered locally of all lookups, late reads,
write-backs, blocks written back) and its fan-out holds (held siblings, released by their
leader's landing / by their timeout, seconds held in all).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadgen.bench import peers
from loadgen.harness import processes
from loadgen.harness.redis_servers import redis_server
from loadgen.replay import ReplayOptions, replay, summarise
from loadgen.traces.readers import read_trace

HERE = str(Path(__file__).resolve().parent.parent)
TIME_SCALE = 4.0
CAPACITY_BLOCKS = 69184
"""Bench point 1's engine KV (capacity frac 0.25 of the 2,000-request slice), per engine."""


def counter(page: str, name: str, label: str = "") -> float:
    """The sum of a counter's samples over the pod's workers (its `worker` labels), of those
    whose labels contain `label` (e.g. `reason="timeout"`) when given."""
    total = 0.0
    for line in page.splitlines():
        head = line.split("{")[0].split(" ")[0]
        if head == name and label in line.split(" ")[0]:
            total += float(line.split()[-1])
    return total


@dataclass(frozen=True)
class Holds:
    """A pod's fan-out holds from its /metrics page: how many, how each was released, seconds."""

    holds: float
    landed: float
    leader_failed: float
    timeouts: float
    held_s: float


def holds(page: str) -> Holds:
    released = "kvgate_fanout_releases_total"
    return Holds(
        counter(page, "kvgate_fanout_holds_total"),
        counter(page, released, 'reason="landed"'),
        counter(page, released, 'reason="leader_failed"'),
        counter(page, released, 'reason="timeout"'),
        counter(page, "kvgate_fanout_hold_seconds_sum"),
    )


def arm(requests: int, tree: str, workers: str) -> str:
    trace = read_trace(str(peers.DEFAULT_TRACE), start=peers.DEFAULT_START, limit=requests)
    directory = CAPACITY_BLOCKS * 16 * 4 // peers.BLOCK_BYTES * int(peers.DEFAULT_DIRECTORY_SCALE)
    setup = peers.Setup(trace, 4, CAPACITY_BLOCKS, directory, 13000.0, 0.0058, TIME_SCALE, 64)
    env = {"KVGATE_DIRECTORY_CAPACITY_BLOCKS": str(directory), "KVGATE_SEED": "0"}
    with processes.engines(4, setup.engine_args()) as engines, redis_server(port=0) as redis:
        args = ["--policy", "cache_aware", "--tenant", f"bench:{peers.BENCH_KEY}"]
        args += ["--log-level", "warning", "--workers", workers.removesuffix("m")]
        if not workers.endswith("m"):
            args += ["--redis-url", redis.url]
        urls = [e.url for e in engines]
        gw = processes.start_gateway(processes.free_port(), urls, args, env, cwd=tree)
        try:
            processes.wait_ready(gw.url, "/readyz", gw.popen, processes.STARTUP_TIMEOUT_S)
            metrics = str(gw.metrics_url)
            processes.wait_ready(metrics, "/metrics", gw.popen, processes.STARTUP_TIMEOUT_S)
            cpu0 = processes.tree_cpu_seconds(gw.pid)
            options = ReplayOptions(
                gw.url,
                (peers.BENCH_KEY,),
                time_scale=TIME_SCALE,
                max_output_tokens=64,
                progress=False,
            )
            rows, wall = asyncio.run(replay(trace, options))
            cpu_ms = (processes.tree_cpu_seconds(gw.pid) - cpu0) / len(rows) * 1e3
            page = httpx.get(metrics + "/metrics", timeout=10.0).text
        finally:
            processes.stop([gw])
    s = summarise(rows, TIME_SCALE, wall)
    local = counter(page, "kvgate_directory_fallbacks_total")
    lookups = counter(page, "kvgate_directory_lookups_total")
    late = counter(page, "kvgate_directory_late_reads_total")
    backs = counter(page, "kvgate_directory_write_backs_total")
    blocks = counter(page, "kvgate_directory_written_back_blocks_total")
    h = holds(page)
    return (
        f"| {workers} | {s.errors} | {s.hit_ratio:.3f} | {s.ttft_mean_s:.3f} / "
        f"{s.ttft_p99_s:.3f} | {cpu_ms:.2f} | {local:.0f} / {lookups:.0f} | {late:.0f} "
        f"| {backs:.0f} | {blocks:,.0f} "
        f"| {h.holds:.0f} / {h.landed:.0f} / {h.timeouts:.0f} / {h.held_s:.1f} |"
    )


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    trees = {"here": HERE} | dict(a.split("=", 1) for a in argv[2:])
    print(
        "| tree | workers | errors | hit ratio | TTFT mean / p99 s | gateway CPU ms/req "
        "| lookups answered locally / all | late reads | write-backs | blocks written back "
        "| holds / landed / timeouts / s held |"
    )
    print("| --- " + "| ---: " * 10 + "|")
    for item in argv[1].split(","):
        name, _, workers = item.partition(":")
        print(f"| {name} " + arm(int(argv[0]), trees[name], workers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
