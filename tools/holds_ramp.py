"""Fan-out holds over Redis under an open-loop ramp, on this tree and another checkout, in one run.

    python -m tools.holds_ramp TREE:WORKERS[,TREE:WORKERS...] [NAME=DIR ...]

    python -m tools.holds_ramp base:1,here:1,here:1m base=/tmp/base

Each arm: 4 instant stand-in engines (`loadgen.bench.fast_engine`), a fresh redis-server, one
`kvgate serve --workers N --redis-url ...` with the gateway's code from the named tree (`here`
is this checkout; a workers count ending in `m`, `here:1m`, runs over the in-process directory
instead), then `kvgate bench`'s open-loop steps (`loadgen.bench.rate.run_step`: the slice's
first 200 agent-sized prompts, 16 streamed tokens each) at 20, 30, 45, 68 and 101 req/s, 4 s
each, whatever each step's verdict. One markdown row per arm: per step the requests not
answered (or failed) within 5 s of the step's end, the p99 TTFT of the answered ones, and the
pod's fan-out counters from its merged /metrics (held siblings; released by the leader's
landing, by its failure, by the hold's timeout; seconds held in all), and what the ramp cost
Redis per request sent: its commands (scripts' own calls included, `INFO commandstats`), of them
SETs, and its CPU (`INFO cpu`, user + system).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from loadgen.bench import peers
from loadgen.bench.fast_engine import fast_engines
from loadgen.bench.rate import RateOptions, _run, request_bodies, run_step
from loadgen.harness import processes
from loadgen.harness.redis_servers import RedisServer, redis_server
from loadgen.sim import percentile
from loadgen.traces.readers import read_trace
from tools.workers_ab import CAPACITY_BLOCKS, holds

HERE = str(Path(__file__).resolve().parent.parent)
RATES = (20.0, 30.0, 45.0, 68.0, 101.0)


def redis_load(redis: RedisServer) -> tuple[int, int, float]:
    """Redis's commands run so far (scripts' calls included), of them SETs, and its CPU s."""
    calls = sets = 0
    for line in redis.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            n = int(line.split("calls=", 1)[1].split(",", 1)[0])
            calls += n
            sets += n if line.startswith("cmdstat_set:") else 0
    cpu = dict(line.split(":", 1) for line in redis.cli("INFO", "cpu").splitlines() if ":" in line)
    return calls, sets, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def arm(tree: str, workers: str, bodies: list[bytes]) -> str:
    directory = CAPACITY_BLOCKS * 16 * 4 // peers.BLOCK_BYTES * int(peers.DEFAULT_DIRECTORY_SCALE)
    env = {"KVGATE_DIRECTORY_CAPACITY_BLOCKS": str(directory), "KVGATE_SEED": "0"}
    options = RateOptions()
    steps: list[str] = []
    with fast_engines(4) as stand_ins, redis_server(port=0) as redis:
        args = ["--policy", "cache_aware", "--tenant", f"bench:{peers.BENCH_KEY}"]
        args += ["--log-level", "warning", "--workers", workers.removesuffix("m")]
        if not workers.endswith("m"):
            args += ["--redis-url", redis.url]
        gw = processes.start_gateway(processes.free_port(), stand_ins.urls, args, env, cwd=tree)
        try:
            processes.wait_ready(gw.url, "/readyz", gw.popen, processes.STARTUP_TIMEOUT_S)
            metrics = str(gw.metrics_url)
            processes.wait_ready(metrics, "/metrics", gw.popen, processes.STARTUP_TIMEOUT_S)
            first = 0
            calls0, sets0, cpu0 = redis_load(redis)
            for rate in RATES:
                sent, errors, ttfts, _, _ = _run(
                    run_step([gw.url], peers.BENCH_KEY, bodies, rate, options, first)
                )
                first += sent
                p99 = percentile(ttfts, 0.99) * 1e3 if ttfts else float("nan")
                steps.append(f"{errors} ({p99:.0f} ms)")
            page = httpx.get(metrics + "/metrics", timeout=10.0).text
            calls1, sets1, cpu1 = redis_load(redis)
        finally:
            processes.stop([gw])
    h = holds(page)
    return (
        f"| {workers} | {' | '.join(steps)} "
        f"| {h.holds:.0f} / {h.landed:.0f} / {h.leader_failed:.0f} / {h.timeouts:.0f} "
        f"/ {h.held_s:.1f} | {(calls1 - calls0) / first:.1f} | {(sets1 - sets0) / first:.1f} "
        f"| {(cpu1 - cpu0) / first * 1e3:.3f} |"
    )


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    trees = {"here": HERE} | dict(a.split("=", 1) for a in argv[1:])
    trace = read_trace(str(peers.DEFAULT_TRACE), start=peers.DEFAULT_START, limit=200)
    bodies = request_bodies(trace, RateOptions())
    rates = " | ".join(f"{r:.0f}/s: unanswered (p99)" for r in RATES)
    print(
        f"| tree | workers | {rates} | holds / landed / leader failed / timeouts / s held "
        "| Redis commands/req | Redis SETs/req | Redis CPU ms/req |"
    )
    print("| --- " + "| ---: " * (len(RATES) + 5) + "|")
    for item in argv[0].split(","):
        name, _, workers = item.partition(":")
        print(f"| {name} " + arm(trees[name], workers, bodies), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
