"""The gateway's CPU time per proxied request (a benchmark, not a test).

Starts one fast simulated engine and a gateway in subprocesses, sends N small streaming chat
requests at a fixed concurrency, and reads the gateway process's CPU time (user + system from
/proc) before and after. Side by side in the same run it measures the same requests sent to the
engine directly, so the engine's share is visible and the machine's noise hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import orjson

from loadgen import processes
from loadgen.engine import DEFAULT_MODEL


def add_bench_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra serve flags")


async def _load(url: str, key: str | None, n: int, concurrency: int, stream: bool) -> int:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    errors = 0
    counter = iter(range(n))

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal errors
        for i in counter:
            body = {
                "model": DEFAULT_MODEL,
                "messages": [
                    {"role": "system", "content": "You are terse. " * 20},
                    {"role": "user", "content": f"request {i % 50}"},
                ],
                "max_tokens": 4,
                "stream": stream,
            }
            async with http.post(
                url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
            ) as resp:
                await resp.read()
                errors += resp.status != 200

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return errors


def run_bench_cpu(args: argparse.Namespace) -> int:
    engine_args = ["--time-scale", "1000000", "--max-batch", "1024"]
    key = "sk-bench"
    with (
        processes.engines(1, engine_args) as engines,
        processes.gateway(
            [engines[0].url],
            [
                "--policy",
                args.policy,
                "--tenant",
                f"bench:{key}",
                "--log-level",
                "warning",
                *args.gateway_arg,
            ],
        ) as gw,
    ):
        # warm up both paths (connections, caches, code)
        asyncio.run(_load(gw.url, key, 200, args.concurrency, args.stream))
        rows = []
        for name, url, auth, pid in (
            ("direct to engine", engines[0].url, None, None),
            ("through kvgate", gw.url, key, gw.pid),
        ):
            engine_cpu0 = processes.cpu_seconds(engines[0].pid)
            gw_cpu0 = processes.cpu_seconds(pid) if pid else 0.0
            t0 = time.monotonic()
            errors = asyncio.run(_load(url, auth, args.requests, args.concurrency, args.stream))
            wall = time.monotonic() - t0
            engine_cpu = processes.cpu_seconds(engines[0].pid) - engine_cpu0
            gw_cpu = (processes.cpu_seconds(pid) - gw_cpu0) if pid else 0.0
            rows.append((name, errors, wall, engine_cpu, gw_cpu))
    print(
        f"{args.requests} requests, concurrency {args.concurrency}, policy {args.policy}, "
        f"stream={args.stream}"
    )
    print(f"{'path':<18} {'errors':>6} {'req/s':>8} {'engine ms/req':>14} {'gateway ms/req':>15}")
    for name, errors, wall, engine_cpu, gw_cpu in rows:
        print(
            f"{name:<18} {errors:>6} {args.requests / wall:>8.0f} "
            f"{engine_cpu / args.requests * 1e3:>14.3f} {gw_cpu / args.requests * 1e3:>15.3f}"
        )
    return 1 if any(r[1] for r in rows) else 0
