"""The gateway's CPU time per request through each front end (a benchmark, not a test):
OpenAI's /v1/chat/completions, Anthropic's /v1/messages and gRPC's Generate, side by side in one
run on one gateway and one engine, with the same conversation content.

    python -m loadgen.bench.apis [--requests 3000] [--concurrency 16] [--stream]

One fast simulated engine and the gateway run in subprocesses (as in `bench_cpu`); the gateway
process's CPU time (user + system from /proc) is read before and after each front end's batch.
Every front end is warmed up first; the figures are compared as ratios to the OpenAI path,
which `bench_cpu` tracks over time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import grpc
import orjson

from loadgen._pb import gateway_pb2 as pb
from loadgen._pb import gateway_pb2_grpc
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes

KEY = "sk-bench"
SYSTEM = "You are terse. " * 20
MAX_TOKENS = 4
WARMUP_REQUESTS = 200

Send = Callable[[int], Awaitable[bool]]
"""Send request number i; True when it succeeded."""


def _openai(http: aiohttp.ClientSession, url: str, stream: bool) -> Send:
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}

    async def send(i: int) -> bool:
        body = {
            "model": DEFAULT_MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"request {i % 50}"},
            ],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }
        path = url + "/v1/chat/completions"
        async with http.post(path, data=orjson.dumps(body), headers=headers) as resp:
            await resp.read()
            return resp.status == 200

    return send


def _anthropic(http: aiohttp.ClientSession, url: str, stream: bool) -> Send:
    headers = {"content-type": "application/json", "x-api-key": KEY}

    async def send(i: int) -> bool:
        body = {
            "model": DEFAULT_MODEL,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": f"request {i % 50}"}],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }
        async with http.post(
            url + "/v1/messages", data=orjson.dumps(body), headers=headers
        ) as resp:
            await resp.read()
            return resp.status == 200

    return send


def _grpc(channel: grpc.aio.Channel, stream: bool) -> Send:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    metadata = (("authorization", f"Bearer {KEY}"),)

    async def send(i: int) -> bool:
        request = pb.GenerateRequest(
            model=DEFAULT_MODEL,
            messages=[
                pb.Message(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text=SYSTEM)]),
                pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text=f"request {i % 50}")]),
            ],
            sampling=pb.Sampling(max_tokens=MAX_TOKENS),
        )
        try:
            if stream:
                async for _ in stub.GenerateStream(request, metadata=metadata):
                    pass
            else:
                await stub.Generate(request, metadata=metadata)
        except grpc.RpcError:
            return False
        return True

    return send


async def _load(
    api: str, gw_url: str, grpc_port: int, n: int, concurrency: int, stream: bool
) -> int:
    """Send n requests through one front end; the number of failures."""
    counter = iter(range(n))
    errors = 0
    async with (
        aiohttp.ClientSession() as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        send = {
            "openai": lambda: _openai(http, gw_url, stream),
            "anthropic": lambda: _anthropic(http, gw_url, stream),
            "grpc": lambda: _grpc(channel, stream),
        }[api]()

        async def worker() -> None:
            nonlocal errors
            for i in counter:
                errors += not await send(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return errors


def run_bench_apis(args: argparse.Namespace) -> int:
    engine_args = ["--time-scale", "1000000", "--max-batch", "1024"]
    grpc_port = processes.free_port()
    apis = ("openai", "anthropic", "grpc")
    rows = []
    with (
        processes.engines(1, engine_args) as engines,
        processes.gateway(
            [engines[0].url],
            ["--tenant", f"bench:{KEY}", "--log-level", "warning", "--grpc-port", str(grpc_port)],
        ) as gw,
    ):
        for api in apis:
            asyncio.run(
                _load(api, gw.url, grpc_port, WARMUP_REQUESTS, args.concurrency, args.stream)
            )
        for api in apis:
            gw_cpu0 = processes.cpu_seconds(gw.pid)
            engine_cpu0 = processes.cpu_seconds(engines[0].pid)
            t0 = time.monotonic()
            errors = asyncio.run(
                _load(api, gw.url, grpc_port, args.requests, args.concurrency, args.stream)
            )
            wall = time.monotonic() - t0
            gw_cpu = processes.cpu_seconds(gw.pid) - gw_cpu0
            engine_cpu = processes.cpu_seconds(engines[0].pid) - engine_cpu0
            rows.append((api, errors, wall, engine_cpu, gw_cpu))
    print(
        f"{args.requests} requests per front end, concurrency {args.concurrency}, "
        f"stream={args.stream}"
    )
    print(
        f"{'front end':<10} {'errors':>6} {'req/s':>7} {'engine ms/req':>14} "
        f"{'gateway ms/req':>15} {'vs openai':>10}"
    )
    base = rows[0][4]
    for api, errors, wall, engine_cpu, gw_cpu in rows:
        print(
            f"{api:<10} {errors:>6} {args.requests / wall:>7.0f} "
            f"{engine_cpu / args.requests * 1e3:>14.3f} {gw_cpu / args.requests * 1e3:>15.3f} "
            f"{gw_cpu / base:>9.2f}x"
        )
    return 1 if any(r[1] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.bench.apis", description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    return run_bench_apis(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
