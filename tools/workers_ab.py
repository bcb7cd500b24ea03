"""`--workers 1` against `--workers 2`, on this tree and another checkout, side by side in one run.

    python -m tools.workers_ab REQUESTS TREE:WORKERS[,TREE:WORKERS...] [NAME=DIR ...]

    python -m tools.workers_ab 400 base:1,here:1,base:2,here:2 base=/tmp/base
    python -m tools.workers_ab rate here:1,here:2,here:3,here:4

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

`--profile=PATH` (with a request count): py-spy records every arm's pod — the supervisor and
its workers — through the replay (`--subprocesses --format raw --nonblocking`, to PATH.<arm
number>), and a table per arm gives each process's samples (non-idle, at 100 Hz; workers by
pid: worker 0 is started first, so usually the lowest) and the share of them in the pod view
(gateway.fleet.podview, `ReplicaSet.adopt`, worker 0's sends), the lookup lane
(cachemap.redis.lookups), the Redis client, the relay, discovery and the rest.

`rate` instead of a request count: each arm's pod in front of 4 instant stand-ins
(`loadgen.bench.fast_engine`, as `kvgate bench`'s max-rate ramp), the bench's open-loop ramp
(`loadgen.bench.rate.ramp`, its default steps); one row per arm: the max sustainable rate, and
per step the achieved rate and the pod's process-tree CPU per request.
"""

from __future__ import annotations

import asyncio
import collections
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadgen.bench import peers
from loadgen.bench.fast_engine import fast_engines
from loadgen.bench.rate import RateOptions, ramp, request_bodies
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


PROFILE_PARTS = (
    ("pod view", ("podview.py", "adopt (gateway/fleet/replicas.py", "_publish (gateway/fleet")),
    ("lookup lane", ("cachemap/redis/lookups.py",)),
    ("redis client", ("redis/asyncio/", "redis/_parsers", "cachemap/redis/")),
    ("relay", ("gateway/pipeline/relayed.py", "gateway/pipeline/upstream.py", "relay")),
    ("discovery", ("gateway/fleet/discovery.py",)),
)
"""(part, frames that put a sample in it): the first part whose frame appears in a stack."""


def profile_shares(path: str) -> str:
    """Each process's samples in a py-spy raw file and the share of each `PROFILE_PARTS`."""
    samples: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # "process <supervisor>:...;process <worker>:...;frames": the innermost names it
        chain = re.findall(r"process (\d+):", stack)
        if not chain:
            continue
        process = ("supervisor " if len(chain) == 1 else "worker ") + chain[-1]
        part = next((n for n, marks in PROFILE_PARTS if any(m in stack for m in marks)), "other")
        samples[process][part] += int(count)
    rows = []
    for process, parts in sorted(samples.items()):
        total = sum(parts.values())
        shares = " | ".join(
            f"{parts[n] / total:.1%}" for n in [*(n for n, _ in PROFILE_PARTS), "other"]
        )
        rows.append(f"| {process} | {total} | {shares} |")
    head = " | ".join([*(n for n, _ in PROFILE_PARTS), "other"])
    rule = "| --- " + "| ---: " * (len(PROFILE_PARTS) + 2) + "|"
    return "\n".join([f"| process | samples | {head} |", rule, *rows])


def arm(requests: int, tree: str, workers: str, profile: str | None = None) -> str:
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
            spy = None
            if profile is not None:
                spy = subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "py-spy"),
                        *("record", "--pid", str(gw.pid), "--subprocesses", "--format", "raw"),
                        *("--nonblocking", "--output", profile),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            rows, wall = asyncio.run(replay(trace, options))
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(60)
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


def rate_arm(tree: str, workers: str, bodies: list[bytes]) -> str:
    """The pod (over a fresh redis-server) in front of instant stand-ins, ramped open loop."""
    directory = CAPACITY_BLOCKS * 16 * 4 // peers.BLOCK_BYTES * int(peers.DEFAULT_DIRECTORY_SCALE)
    env = {"KVGATE_DIRECTORY_CAPACITY_BLOCKS": str(directory), "KVGATE_SEED": "0"}
    with fast_engines(4) as stand_ins, redis_server(port=0) as redis:
        args = ["--policy", "cache_aware", "--tenant", f"bench:{peers.BENCH_KEY}"]
        args += ["--log-level", "warning", "--workers", workers, "--redis-url", redis.url]
        gw = processes.start_gateway(processes.free_port(), stand_ins.urls, args, env, cwd=tree)
        try:
            processes.wait_ready(gw.url, "/readyz", gw.popen, processes.STARTUP_TIMEOUT_S)
            result = ramp(
                [gw.url],
                peers.BENCH_KEY,
                bodies,
                RateOptions(),
                lambda: (processes.tree_cpu_seconds(gw.pid), 0.0),
            )
        finally:
            processes.stop([gw])
    best = result.max_sustained_rps
    steps = ", ".join(
        f"{s.offered_rps:.0f}{'' if s.sustained else '✗'}: {s.achieved_rps:.0f}/s "
        f"{s.router_cpu_ms_per_request or 0.0:.2f} ms"
        for s in result.steps
    )
    return f"| {workers} | {'none' if best is None else f'{best:.0f}'} | {steps} |"


def main(argv: list[str]) -> int:
    profile = next((a.split("=", 1)[1] for a in argv if a.startswith("--profile=")), None)
    argv = [a for a in argv if not a.startswith("--profile=")]
    if len(argv) < 2:
        print(__doc__)
        return 2
    trees = {"here": HERE} | dict(a.split("=", 1) for a in argv[2:])
    if argv[0] == "rate":
        trace = read_trace(str(peers.DEFAULT_TRACE), start=peers.DEFAULT_START, limit=200)
        bodies = request_bodies(trace, RateOptions())
        print(
            "| tree | workers | max sustained req/s | steps: offered (✗ not sustained): "
            "achieved, pod CPU per request |"
        )
        print("| --- | ---: | ---: | --- |")
        for item in argv[1].split(","):
            name, _, workers = item.partition(":")
            print(f"| {name} " + rate_arm(trees[name], workers, bodies), flush=True)
        return 0
    print(
        "| tree | workers | errors | hit ratio | TTFT mean / p99 s | gateway CPU ms/req "
        "| lookups answered locally / all | late reads | write-backs | blocks written back "
        "| holds / landed / timeouts / s held |"
    )
    print("| --- " + "| ---: " * 10 + "|")
    profiles = []
    for number, item in enumerate(argv[1].split(",")):
        name, _, workers = item.partition(":")
        out = None if profile is None else f"{profile}.{number}"
        print(f"| {name} " + arm(int(argv[0]), trees[name], workers, out), flush=True)
        if out is not None:
            profiles.append(f"\narm {number} ({item}), {out}:\n\n" + profile_shares(out))
    print("\n".join(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
