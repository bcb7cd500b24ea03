"""`kvgate bench-adapters`: LoRA adapters routed by residency against routers blind to them
(issue 42, item 9).

Every arm starts `--engines` fresh simulated engines serving `--adapters` LoRA adapters
(`--lora-modules`, `--max-loras`, a cold load costing `--lora-load-s`) and replays the same
open-loop schedule through its router: `--requests` requests at `--rate` per second (Poisson,
seeded), each from one of `--tenants` tenants for one adapter, uniformly. A (tenant, adapter)
pair has its own system prompt (`--system-words`); each request adds a question of its own, so
a hit is the pair's system prompt cached under its adapter (the tenants' salts keep them apart
in kvgate; their prompts differ for every router).

    arm                 router
    kvgate:cache_aware  kvgate serve (lora_adapters set): residency, then the prefix
    kvgate:round_robin  kvgate serve --policy round_robin: blind to adapters and prefixes
    sglang:cache_aware  sglang-router (its prefix tree on the text; adapters not modelled)
    vllm:cache_aware    vllm-router (the same)

Printed per arm: errors, the hit ratio (engine cached tokens / prompt tokens), adapter loads
per 1,000 requests (the engines' own count, /server_info `lora_loads`), TTFT p50 / p99 in
engine seconds (measured × `--time-scale`), and the load average before the arm.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass

import aiohttp
import httpx

from loadgen.bench.peers import Arm, peer_missing, start_router
from loadgen.client import Result, stream_chat
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.runner import percentile
from loadgen.text import words

ARMS = ("kvgate:cache_aware", "kvgate:round_robin", "sglang:cache_aware", "vllm:cache_aware")


def add_bench_adapters_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=4, help="simulated engine replicas")
    parser.add_argument("--adapters", type=int, default=3, help="LoRA adapters every engine lists")
    parser.add_argument("--tenants", type=int, default=2, help="tenants, each using every adapter")
    parser.add_argument("--max-loras", type=int, default=2, help="each engine's adapter slots")
    parser.add_argument(
        "--lora-load-s", type=float, default=0.2, help="a cold load, in engine seconds"
    )
    parser.add_argument("--requests", type=int, default=600, help="requests per arm")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    parser.add_argument(
        "--system-words", type=int, default=1500, help="words of each system prompt"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="engines run this many times faster"
    )
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed")


@dataclass
class Outcome:
    arm: str
    results: list[Result]
    loads: int
    load_average: float
    skipped: str = ""

    def line(self, time_scale: float) -> str:
        if self.skipped:
            return f"{self.arm:20s} skipped: {self.skipped}"
        ok = [r for r in self.results if r.ok]
        prompt = sum(r.prompt_tokens for r in ok) or 1
        cached = sum(r.engine_cached_tokens for r in ok)
        ttft = sorted(r.ttft_s * time_scale for r in ok)
        per_k = 1000.0 * self.loads / max(len(self.results), 1)
        return (
            f"{self.arm:20s} errors {len(self.results) - len(ok):3d}  hit {cached / prompt:.3f}  "
            f"loads/1k {per_k:6.1f}  TTFT p50 {percentile(ttft, 0.5):.3f} s  "
            f"p99 {percentile(ttft, 0.99):.3f} s  (load avg {self.load_average:.1f})"
        )


def _schedule(args: argparse.Namespace) -> list[tuple[float, int, int, int]]:
    """(send at s, tenant, adapter, request number), the same for every arm."""
    rng = random.Random(args.seed)
    at, out = 0.0, []
    for n in range(args.requests):
        at += rng.expovariate(args.rate)
        out.append((at, rng.randrange(args.tenants), rng.randrange(args.adapters), n))
    return out


def _adapter(i: int) -> str:
    return f"lora-{i}"


def _key(tenant: int) -> str:
    return f"sk-bench-adapters-{tenant}"


async def _replay(urls: tuple[str, ...], api_key: bool, args: argparse.Namespace) -> list[Result]:
    systems = {
        (t, a): f"Tenant {t} adapter {a}. " + words(f"system{t}.{a}", args.system_words)
        for t in range(args.tenants)
        for a in range(args.adapters)
    }
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        start = time.monotonic()

        async def one(at_s: float, tenant: int, adapter: int, n: int) -> Result:
            await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
            body = {
                "model": _adapter(adapter),
                "messages": [
                    {"role": "system", "content": systems[tenant, adapter]},
                    {"role": "user", "content": f"Question {n}: " + words(f"q{n}", 30)},
                ],
                "max_tokens": args.max_tokens,
            }
            url = urls[n % len(urls)]
            return await stream_chat(http, url, _key(tenant) if api_key else None, body)

        return list(await asyncio.gather(*(one(*s) for s in _schedule(args))))


def _run_arm(arm: Arm, args: argparse.Namespace) -> Outcome:
    load_average = os.getloadavg()[0]
    missing = peer_missing(arm)
    if missing:
        return Outcome(arm.name, [], 0, load_average, missing)
    modules = [f"{_adapter(i)}=/adapters/{_adapter(i)}" for i in range(args.adapters)]
    engine_args = [
        "--time-scale",
        str(args.time_scale),
        "--max-loras",
        str(args.max_loras),
        "--lora-load-s",
        str(args.lora_load_s),
        "--lora-modules",
        *modules,
    ]
    env = {
        "KVGATE_LORA_ADAPTERS": "{"
        + ",".join(f'"{_adapter(i)}": "{DEFAULT_MODEL}"' for i in range(args.adapters))
        + "}",
        "KVGATE_SEED": "0",
    }
    with processes.engines(args.engines, engine_args) as engines:
        urls = [e.url for e in engines]
        if arm.kind == "kvgate":
            serve = ["--policy", arm.policy, "--log-level", "warning"]
            for t in range(args.tenants):
                serve += ["--tenant", f"t{t}:{_key(t)}"]
            with processes.gateway(urls, serve, env=env) as gw:
                results = asyncio.run(_replay((gw.url,), True, args))
        else:
            with start_router(arm, urls, 0) as router:
                results = asyncio.run(_replay(router.targets, False, args))
        loads = sum(int(httpx.get(u + "/server_info").json()["lora_loads"]) for u in urls)
    return Outcome(arm.name, results, loads, load_average)


def run_bench_adapters(args: argparse.Namespace) -> int:
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise SystemExit(f"kvgate bench-adapters: unknown arm(s) {unknown}; choose from {ARMS}")
    print(
        f"{args.adapters} adapters x {args.tenants} tenants on {args.engines} engines, "
        f"--max-loras {args.max_loras}, cold load {args.lora_load_s} s; {args.requests} "
        f"requests at {args.rate}/s, system prompts of {args.system_words} words"
    )
    for name in names:
        kind, _, policy = name.partition(":")
        outcome = _run_arm(Arm(kind, policy), args)
        print(outcome.line(args.time_scale), flush=True)
    return 0
