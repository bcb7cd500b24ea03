"""The simulated engine's own CPU time per request, KV events off and on (a benchmark).

Starts two engines in subprocesses, identical but for `--kv-events-config`, and sends both the
same streamed chat requests (a shared system prompt and a distinct tail each, so every request
stores blocks and, past the cache's capacity, evicts some), alternating off / on rounds so the
machine's noise hits both alike. A subscriber in this process reads the events engine's stream,
so the PUB socket really sends. CPU is user + system from /proc around each round.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import aiohttp
import orjson
import zmq

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.text import words


def add_bench_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="per arm and round")
    parser.add_argument("--rounds", type=int, default=2, help="off/on rounds, alternating")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--prompt-words", type=int, default=1500, help="system prompt words")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument(
        "--capacity-blocks", type=int, default=4096, help="the engine's KV cache, in blocks"
    )
    parser.add_argument(
        "--encoding", default="vllm", choices=("vllm", "vllm-array", "sglang"), help="events"
    )


async def _load(url: str, n: int, offset: int, args: argparse.Namespace) -> int:
    system = words("bench-engine", args.prompt_words)
    counter = iter(range(offset, offset + n))
    errors = 0

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal errors
        for i in counter:
            body = {
                "model": DEFAULT_MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(i, 60)},
                ],
                "max_tokens": args.max_tokens,
                "stream": True,
            }
            async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as r:
                await r.read()
                errors += r.status != 200

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    return errors


class _Counter(threading.Thread):
    """A SUB socket counting the batches an engine publishes, until stopped."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.batches = 0
        self.bytes = 0
        self.stopping = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{self.port}")
        self.ready.set()
        try:
            while not self.stopping.is_set():
                if sub.poll(100):
                    frames = sub.recv_multipart()
                    self.batches += 1
                    self.bytes += len(frames[-1])
        finally:
            sub.close(linger=0)


def run_bench_engine(args: argparse.Namespace) -> int:
    events_port = processes.free_port()
    common = [
        "--time-scale",
        "1000000",
        "--max-batch",
        "1024",
        "--capacity-blocks",
        str(args.capacity_blocks),
    ]
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{events_port}",
        "encoding": args.encoding,
    }
    on_args = [*common, "--kv-events-config", orjson.dumps(config).decode()]
    counter = _Counter(events_port)
    counter.start()
    counter.ready.wait(5)
    totals = {"off": [0.0, 0.0, 0.0], "on": [0.0, 0.0, 0.0]}  # cpu s, wall s, errors
    with processes.engines(1, common) as off, processes.engines(1, on_args) as on:
        arms = {"off": off[0], "on": on[0]}
        for proc in arms.values():  # warm up: connections, code, the prompt's blocks
            asyncio.run(_load(proc.url, 200, 10**6, args))
        for round_ in range(args.rounds):
            for name in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                proc = arms[name]
                cpu0, t0 = processes.cpu_seconds(proc.pid), time.monotonic()
                errors = asyncio.run(_load(proc.url, args.requests, round_ * args.requests, args))
                totals[name][0] += processes.cpu_seconds(proc.pid) - cpu0
                totals[name][1] += time.monotonic() - t0
                totals[name][2] += errors
    counter.stopping.set()
    counter.join(2)
    n = args.requests * args.rounds
    print(
        f"{n} streamed chat requests per arm ({args.rounds} alternating rounds), concurrency "
        f"{args.concurrency}, system prompt {args.prompt_words} words + 60, max_tokens "
        f"{args.max_tokens}, {args.capacity_blocks} blocks, events encoding {args.encoding}"
    )
    print(f"{'KV events':<10} {'errors':>6} {'req/s':>8} {'engine CPU ms/req':>18}")
    for name, (cpu, wall, failed) in totals.items():
        print(f"{name:<10} {failed:>6.0f} {n / wall:>8.0f} {cpu / n * 1e3:>18.3f}")
    off_ms, on_ms = totals["off"][0] / n * 1e3, totals["on"][0] / n * 1e3
    print(
        f"events on / off: {on_ms / off_ms:.3f}x; the subscriber read {counter.batches:,} "
        f"batches ({counter.bytes / max(counter.batches, 1):,.0f} bytes each on average)"
    )
    return 1 if totals["off"][2] or totals["on"][2] or not counter.batches else 0
