"""What an idle gateway burns on background work: health probes and engine-metric scrapes, with
4, 16 and 64 replicas (a benchmark, not a test).

The replicas are cheap stand-ins, all in one process (a thread of this one, its own event loop):
each port answers `/health`, `/v1/models` and a `/metrics` page the size of vLLM's (~600
lines, mostly histogram buckets the gateway does not read), so what is measured is the
gateway's side of the work. The gateway is a real `kvgate serve` over every port; after it is
ready and `settle_s` has passed, its CPU time (user + system, /proc) over `seconds` of no
traffic is the figure, in % of one core and in ms per replica per second.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes

NUM_BUCKETS = 560
"""Histogram bucket lines on the stand-in's /metrics: vLLM's page is ~600 lines, almost all
of them buckets of its latency histograms."""


def metrics_families() -> dict[str, list[str]]:
    """A vLLM-shaped /metrics page by family: those the gateway reads, then histograms."""
    labels = f'model_name="{DEFAULT_MODEL}",engine="0"'
    families: dict[str, list[str]] = {}
    for name, kind, value in (
        ("vllm:num_requests_running", "gauge", 0),
        ("vllm:num_requests_waiting", "gauge", 0),
        ("vllm:kv_cache_usage_perc", "gauge", 0.0),
        ("vllm:prefix_cache_queries", "counter", 1000),
        ("vllm:prefix_cache_hits", "counter", 400),
        ("process_start_time_seconds", "gauge", 1.7e9),
    ):
        sample = name + ("_total" if kind == "counter" else "")
        families[sample] = [
            f"# HELP {name} x",
            f"# TYPE {name} {kind}",
            f"{sample}{{{labels}}} {value}",
        ]
    for i in range(NUM_BUCKETS):
        histogram = f"vllm:latency_{i // 40}_seconds_bucket"
        line = f'{histogram}{{{labels},le="{0.001 * 2 ** (i % 40)}"}} {i}'
        families.setdefault(histogram, []).append(line)
    return families


def metrics_page(names: Sequence[str] = ()) -> bytes:
    """The page, or only the families with a sample named in `names` (prometheus_client's
    `name[]` query, which vLLM's /metrics honours)."""
    wanted = set(names)
    lines = [
        line
        for sample, block in metrics_families().items()
        if not wanted or sample in wanted
        for line in block
    ]
    return ("\n".join(lines) + "\n").encode()


@dataclass
class StandInLog:
    """What the stand-ins were asked (`hits` by path, `port_hits` by port and path) and which
    paths (`failing`) or ports (`down`) answer 503."""

    hits: Counter[str] = field(default_factory=Counter)
    failing: set[str] = field(default_factory=set)
    port_hits: Counter[tuple[int, str]] = field(default_factory=Counter)
    down: set[int] = field(default_factory=set)


def _stand_in_app(log: StandInLog) -> web.Application:
    page = metrics_page()
    models = orjson.dumps({"data": [{"id": DEFAULT_MODEL, "max_model_len": 32768}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def listed(_: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        body = metrics_page(names) if names else page
        return web.Response(body=body, content_type="text/plain")

    @web.middleware
    async def logged(request: web.Request, handler: Handler) -> web.StreamResponse:
        log.hits[request.path] += 1
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        port = int(sockname[1]) if sockname else 0
        log.port_hits[port, request.path] += 1
        if request.path in log.failing or port in log.down:
            return web.Response(status=503)
        return await handler(request)

    app = web.Application(middlewares=[logged])
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", listed)
    app.router.add_get("/metrics", metrics)
    return app


@contextmanager
def stand_ins(num: int, log: StandInLog | None = None) -> Iterator[list[str]]:
    """`num` stand-in replicas on free loopback ports, served from one thread."""
    log = log if log is not None else StandInLog()
    ports: list[int] = []
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        runner = web.AppRunner(_stand_in_app(log), access_log=None)
        await runner.setup()
        handler = runner.server
        assert handler is not None
        try:
            for _ in range(num):  # port 0: the kernel picks a free one (no race)
                server = await loop.create_server(handler, "127.0.0.1", 0)
                ports.append(server.sockets[0].getsockname()[1])
        finally:
            ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        if not ready.wait(30) or len(ports) < num:
            raise RuntimeError(f"the stand-in replicas did not start ({len(ports)} of {num})")
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def idle_cpu(num: int, seconds: float, settle_s: float, gateway_args: list[str]) -> float:
    """The idle gateway's CPU seconds per second with `num` replicas (its workers' too)."""
    serve = ["--policy", "cache_aware", "--log-level", "warning", *gateway_args]
    with stand_ins(num) as urls, processes.gateway(urls, serve) as gw:
        time.sleep(settle_s)  # not synchronisation: the first rounds and imports are not idle
        cpu0, t0 = processes.tree_cpu_seconds(gw.pid), time.monotonic()
        time.sleep(seconds)
        return (processes.tree_cpu_seconds(gw.pid) - cpu0) / (time.monotonic() - t0)


def add_bench_idle_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="4,16,64", help="comma-separated fleet sizes")
    parser.add_argument("--seconds", type=float, default=20.0, help="idle time measured")
    parser.add_argument("--settle", type=float, default=5.0, help="idle time skipped first")
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra serve flags")


def run_bench_idle(args: argparse.Namespace) -> int:
    from loadgen.bench.cpu import environment

    print(f"on: {environment()}")
    page = len(metrics_page())
    print(f"idle gateway over {args.seconds:g} s, stand-in replicas ({page:,} B of /metrics)")
    print(f"{'replicas':>8} {'% of one core':>14} {'ms/replica/s':>13}")
    for num in (int(n) for n in args.replicas.split(",")):
        share = idle_cpu(num, args.seconds, args.settle, args.gateway_arg)
        print(f"{num:>8} {share * 100:>14.2f} {share * 1e3 / num:>13.3f}")
    return 0
