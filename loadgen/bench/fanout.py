"""Fan-out and hot prefixes, measured live through the gateway on simulated engines (issue #5).

Part 1 — holding: (a) the agent working day whose three subagents share a plan the main agent
just wrote (system + project file, cached, then a 1,500-token plan, not yet), sent in parallel;
(b) a fresh fan-out: eight subagents sharing a 6,000-token context no replica holds yet. Prefill
tokens the engines computed, with and without holding.

Part 2 — a hot spine: requests at a fixed rate, all sharing an S-token system prompt with
distinct short suffixes, faster than one replica can prefill; max/mean engine busy seconds,
TTFT p50/p99 and the hit ratio, with and without overflow.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aiohttp

from loadgen.bench.engine_work import busy_seconds, engine_totals, imbalance
from loadgen.client import Result, stream_chat
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.engine.timing import DEFAULT_DECODE_S_PER_TOKEN, DEFAULT_PREFILL_TOKENS_PER_S
from loadgen.harness import processes
from loadgen.runner import percentile, run_phases
from loadgen.text import words
from loadgen.workloads import Phase, agent_day_with_plan, fanout_burst

KEY = "sk-bench"


def add_bench_fanout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=4, help="simulated engine replicas")
    parser.add_argument("--rate", type=float, default=60.0, help="hot-spine requests per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="hot-spine duration")
    parser.add_argument(
        "--system-tokens", type=int, default=4000, help="tokens of the shared system prompt"
    )
    parser.add_argument("--suffix-tokens", type=int, default=300, help="tokens each request adds")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="engines run this many times faster"
    )
    parser.add_argument("--skip-hold", action="store_true", help="skip the fan-out hold arm")
    parser.add_argument("--skip-hot", action="store_true", help="skip the hot-prefix overflow arm")


def _engine_args(args: argparse.Namespace) -> list[str]:
    return ["--time-scale", str(args.time_scale), "--max-batch", "256"]


def run_hold(args: argparse.Namespace, hold: bool, phases: list[Phase]) -> dict[str, float]:
    env = {
        "KVGATE_FANOUT_HOLD": "true" if hold else "false",
        "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(DEFAULT_PREFILL_TOKENS_PER_S * args.time_scale),
    }
    serve = ["--tenant", f"bench:{KEY}", "--log-level", "warning"]
    with (
        processes.engines(args.engines, _engine_args(args)) as engines,
        processes.gateway([e.url for e in engines], serve, env=env) as gw,
    ):
        results = asyncio.run(run_phases(phases, gw.url, KEY, DEFAULT_MODEL, max_tokens=32))
        totals = [engine_totals(e.url) for e in engines]
    prompt = sum(t.prompt_tokens for t in totals)
    cached = sum(t.cached_tokens for t in totals)
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if not r.ok),
        "computed": prompt - cached,
        "prompt": prompt,
        "hit_ratio": cached / prompt if prompt else 0.0,
    }


async def _open_loop(url: str, args: argparse.Namespace) -> list[Result]:
    system = {
        "role": "system",
        "content": "You are a support agent." + words("spine", args.system_tokens),
    }
    n = int(args.rate * args.seconds)
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(i: int) -> Result:
            await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
            body = {
                "model": DEFAULT_MODEL,
                "messages": [
                    system,
                    {"role": "user", "content": words(f"q{i}", args.suffix_tokens)},
                ],
                "max_tokens": args.max_tokens,
            }
            return await stream_chat(http, url, KEY, body, f"q{i}")

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def run_hot(args: argparse.Namespace, overflow: bool) -> dict[str, float]:
    env = {
        "KVGATE_OVERFLOW": "true" if overflow else "false",
        "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(DEFAULT_PREFILL_TOKENS_PER_S * args.time_scale),
    }
    serve = ["--tenant", f"bench:{KEY}", "--log-level", "warning"]
    with (
        processes.engines(args.engines, _engine_args(args)) as engines,
        processes.gateway([e.url for e in engines], serve, env=env) as gw,
    ):
        # one warm-up request puts the spine on one replica, as in production
        asyncio.run(_warm(gw.url, args))
        before = [engine_totals(e.url) for e in engines]
        results = asyncio.run(_open_loop(gw.url, args))
        after = [engine_totals(e.url) for e in engines]
    busy = busy_seconds(before, after, DEFAULT_PREFILL_TOKENS_PER_S, DEFAULT_DECODE_S_PER_TOKEN)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * args.time_scale for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.engine_cached_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "imbalance": imbalance(busy),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "busy": busy,  # type: ignore[dict-item]
    }


async def _warm(url: str, args: argparse.Namespace) -> None:
    system = {
        "role": "system",
        "content": "You are a support agent." + words("spine", args.system_tokens),
    }
    async with aiohttp.ClientSession() as http:
        body = {
            "model": DEFAULT_MODEL,
            "messages": [system, {"role": "user", "content": "hi"}],
            "max_tokens": 1,
        }
        await stream_chat(http, url, KEY, body)


def run_bench_fanout(args: argparse.Namespace) -> int:
    errors = 0
    print(
        f"engines: {args.engines} simulated, time scale {args.time_scale:g} "
        f"(prefill {DEFAULT_PREFILL_TOKENS_PER_S:,.0f} tokens/s, "
        f"decode {DEFAULT_DECODE_S_PER_TOKEN * 1e3:.0f} ms/token at scale 1)"
    )
    if not args.skip_hold:
        print(
            f"\n{'workload':<34} {'holding':<8} {'requests':>8} {'errors':>6} "
            f"{'prefilled':>10} {'hit ratio':>9}"
        )
        for name, phases in (
            ("agent day, subagents share a plan", agent_day_with_plan()),
            ("fresh fan-out, 8 x 6,000 shared", fanout_burst()),
        ):
            for hold in (True, False):
                r = run_hold(args, hold, phases)
                errors += int(r["errors"])
                print(
                    f"{name:<34} {'on' if hold else 'off':<8} {r['requests']:>8.0f} "
                    f"{r['errors']:>6.0f} {r['computed']:>10,.0f} {r['hit_ratio']:>9.1%}"
                )
    if not args.skip_hot:
        print(
            f"\nhot spine: {args.rate:g} requests/s for {args.seconds:g} s, "
            f"{args.system_tokens} shared + {args.suffix_tokens} own tokens each"
        )
        print(
            f"{'overflow':<8} {'requests':>8} {'errors':>6} {'imbalance':>9} "
            f"{'TTFT p50 s':>10} {'TTFT p99 s':>10} {'hit ratio':>9}  busy s per engine"
        )
        for overflow in (True, False):
            r = run_hot(args, overflow)
            errors += int(r["errors"])
            busy: Any = r["busy"]
            print(
                f"{'on' if overflow else 'off':<8} {r['requests']:>8.0f} {r['errors']:>6.0f} "
                f"{r['imbalance']:>9.2f} {r['ttft_p50_s']:>10.3f} {r['ttft_p99_s']:>10.3f} "
                f"{r['hit_ratio']:>9.1%}  " + " ".join(f"{b:.1f}" for b in busy)
            )
    return 1 if errors else 0
