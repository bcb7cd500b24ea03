"""Redis slowed: a stalling TCP proxy between the gateway and Redis delays every reply by
`STALL_S`, far past the per-call deadline, then stops stalling.

The request path makes at most `CALLS_ON_PATH` Redis calls before the first token (the lookup,
and a fan-out leader's marker), each bounded by `redis_deadline_s` (`DEADLINE_S` here); once the
breaker opens it makes none. Goal: the TTFT penalty (median and worst, stalled minus before)
stays within `CALLS_ON_PATH` x deadline + `SLACK_S`, no request fails, and the TTFT after the
stall ends is back to before's. Requests run one at a time (TTFT is not queueing).
"""

from __future__ import annotations

import asyncio
import statistics

import aiohttp

from loadgen.chaos.billed import KEY
from loadgen.chaos.outcome import Outcome, Size
from loadgen.client import Result, stream_chat
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.harness.redis_servers import redis_server
from loadgen.harness.stall_proxy import StallProxy
from loadgen.text import words

DEADLINE_S = 0.05
CALLS_ON_PATH = 2
SLACK_S = 0.05
"""Scheduling noise on a shared 2-core machine."""
STALL_S = 2.0


async def _phase(url: str, tag: str, n: int) -> list[Result]:
    results = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            messages = [
                {"role": "system", "content": words(f"slow/{i % 4}", 300)},
                {"role": "user", "content": words(f"slow/{tag}/{i}", 30)},
            ]
            body = {"model": DEFAULT_MODEL, "max_tokens": 2, "stream": True, "messages": messages,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            results.append(await stream_chat(session, url, KEY, body, tag))
    return results


def run(size: Size) -> Outcome:
    n = size.pick(12, 60)
    env = {"KVGATE_REDIS_DEADLINE_S": str(DEADLINE_S)}
    phases: dict[str, list[Result]] = {}
    with (
        redis_server(port=0) as redis,
        StallProxy(redis.port) as proxy,
        processes.engines(2) as engines,
    ):
        gateway = processes.start_gateway(
            processes.free_port(), [e.url for e in engines],
            ["--tenant", f"acme:{KEY}", "--log-level", "error", "--redis-url", proxy.url], env=env,
        )  # fmt: skip
        try:
            processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
            asyncio.run(_phase(gateway.url, "warm", 4))
            phases["before"] = asyncio.run(_phase(gateway.url, "before", n))
            proxy.delay_s = STALL_S
            phases["stalled"] = asyncio.run(_phase(gateway.url, "stalled", n))
            proxy.delay_s = 0.0
            phases["after"] = asyncio.run(_phase(gateway.url, "after", n))
        finally:
            processes.stop([gateway])
        stalled_chunks = proxy.stalled_chunks
    return _judge(phases, stalled_chunks)


def _judge(phases: dict[str, list[Result]], stalled_chunks: int) -> Outcome:
    out = Outcome("redis-slow")
    every = [r for rs in phases.values() for r in rs]
    failed = sum(1 for r in every if not r.ok)
    out.goal("failed requests", failed == 0, f"{failed} of {len(every)}")
    ttft = {p: [r.ttft_s for r in rs if r.ok] for p, rs in phases.items()}
    base = statistics.median(ttft["before"])
    bound = CALLS_ON_PATH * DEADLINE_S + SLACK_S
    median = statistics.median(ttft["stalled"]) - base
    worst = max(ttft["stalled"]) - base
    out.goal(
        "TTFT penalty, median",
        median <= bound,
        f"{median * 1e3:.0f} ms (bound {bound * 1e3:.0f} ms)",
    )
    out.goal(
        "TTFT penalty, worst", worst <= bound, f"{worst * 1e3:.0f} ms (bound {bound * 1e3:.0f} ms)"
    )
    out.goal("Redis replies stalled", stalled_chunks > 0, f"{stalled_chunks} delayed {STALL_S:g} s")
    out.figures["TTFT median before / stalled / after ms"] = " / ".join(
        f"{statistics.median(ttft[p]) * 1e3:.0f}" for p in ("before", "stalled", "after")
    )
    return out
