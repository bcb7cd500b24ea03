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

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.text import words


def add_bench_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=5000, help="requests measured")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--policy", default="cache_aware", help="routing policy")
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra serve flags")
    parser.add_argument(
        "--redis", action="store_true", help="also measure with the Redis directory (started here)"
    )
    parser.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="a shared system prompt of this size (agent-sized: ~50,000); default 300 bytes",
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")


async def _load(url: str, key: str | None, n: int, args: argparse.Namespace) -> int:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    errors = 0
    counter = iter(range(n))
    system = (
        words("bench-cpu", args.prompt_bytes // 5) if args.prompt_bytes else "You are terse. " * 20
    )

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal errors
        for i in counter:
            body = {
                "model": DEFAULT_MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"request {i % 50}"},
                ],
                "max_tokens": args.max_tokens,
                "stream": args.stream,
            }
            async with http.post(
                url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
            ) as resp:
                await resp.read()
                errors += resp.status != 200

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    return errors


def _measure(
    args: argparse.Namespace, gateway_args: list[str], key: str
) -> list[tuple[str, int, float, float, float]]:
    engine_args = ["--time-scale", "1000000", "--max-batch", "1024"]
    serve = ["--policy", args.policy, "--tenant", f"bench:{key}", "--log-level", "warning"]
    with (
        processes.engines(1, engine_args) as engines,
        processes.gateway([engines[0].url], [*serve, *gateway_args, *args.gateway_arg]) as gw,
    ):
        # warm up both paths (connections, caches, code)
        asyncio.run(_load(gw.url, key, 200, args))
        rows = []
        for name, url, auth, pid in (
            ("direct to engine", engines[0].url, None, None),
            ("through kvgate", gw.url, key, gw.pid),
        ):
            engine_cpu0 = processes.cpu_seconds(engines[0].pid)
            gw_cpu0 = processes.cpu_seconds(pid) if pid else 0.0
            t0 = time.monotonic()
            errors = asyncio.run(_load(url, auth, args.requests, args))
            wall = time.monotonic() - t0
            engine_cpu = processes.cpu_seconds(engines[0].pid) - engine_cpu0
            gw_cpu = (processes.cpu_seconds(pid) - gw_cpu0) if pid else 0.0
            rows.append((name, errors, wall, engine_cpu, gw_cpu))
    return rows


def run_bench_cpu(args: argparse.Namespace) -> int:
    key = "sk-bench"
    rows = [(n, "in-process", *rest) for n, *rest in _measure(args, [], key)]
    if args.redis:
        from loadgen.harness.redis_servers import redis_server

        with redis_server(port=0) as server:
            redis_rows = _measure(args, ["--redis-url", server.url], key)
        rows += [(n, "redis", *rest) for n, *rest in redis_rows if n == "through kvgate"]
    print(
        f"{args.requests} requests, concurrency {args.concurrency}, policy {args.policy}, "
        f"stream={args.stream}, system prompt {args.prompt_bytes or 300:,} bytes, "
        f"max_tokens {args.max_tokens}"
    )
    header = f"{'path':<18} {'directory':<10} {'errors':>6} {'req/s':>8}"
    print(f"{header} {'engine ms/req':>14} {'gateway ms/req':>15}")
    for name, directory, errors, wall, engine_cpu, gw_cpu in rows:
        shown = directory if name == "through kvgate" else "-"
        print(
            f"{name:<18} {shown:<10} {errors:>6} {args.requests / wall:>8.0f} "
            f"{engine_cpu / args.requests * 1e3:>14.3f} {gw_cpu / args.requests * 1e3:>15.3f}"
        )
    return 1 if any(r[2] for r in rows) else 0
