"""What billing costs the gateway (a benchmark, not a test).

Side by side in one run, the same streaming requests through a gateway without billing, with
billing on a local WAL (fsync'd, group-committed), and with the WAL shipped to an AOF Redis
(`appendfsync always`): the gateway's CPU per request from /proc and the throughput, as ratios
to the gateway without billing. (The gateway is reached only over the wire; the pricing engine
alone is `kvgate billing bench`.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from loadgen.bench.cpu import Pass, _measure
from loadgen.engine.server import DEFAULT_MODEL

AOF = ("--appendonly", "yes", "--appendfsync", "always")


def add_bench_billing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=3000, help="requests measured")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis-store run")
    parser.add_argument(
        "--max-tokens", type=int, default=4, help="output tokens per request (default: 4)"
    )
    parser.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="a shared system prompt of this size (0: ~300 bytes, as bench-cpu)",
    )


def run_bench_billing(args: argparse.Namespace) -> int:
    key = "sk-bench"
    measure = argparse.Namespace(
        requests=args.requests,
        concurrency=args.concurrency,
        stream=args.stream,
        policy="cache_aware",
        gateway_arg=[],
        max_tokens=args.max_tokens,
        prompt_bytes=args.prompt_bytes,
    )
    rows: list[tuple[str, Pass]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-billing-") as tmp:
        base = {"billing_model_map": {DEFAULT_MODEL: "gpt-5.6"}}
        configs: list[tuple[str, dict[str, object] | None]] = [
            ("no billing", None),
            ("billing, local WAL", {**base, "billing_wal_dir": str(Path(tmp) / "wal-local")}),
        ]
        redis_ctx = None
        if not args.no_redis:
            from loadgen.harness.redis_servers import redis_server

            redis_ctx = redis_server(port=0, extra=AOF)
            server = redis_ctx.__enter__()
            configs.append(
                (
                    "billing, WAL → AOF Redis",
                    {
                        **base,
                        "billing_wal_dir": str(Path(tmp) / "wal-redis"),
                        "billing_redis_url": server.url,
                    },
                )
            )
        try:
            for name, config in configs:
                gateway_args: list[str] = []
                if config is not None:
                    path = Path(tmp) / f"{len(rows)}.yaml"
                    path.write_text(json.dumps(config))  # JSON is YAML
                    gateway_args = ["--config", str(path)]
                through = [
                    p for p in _measure(measure, gateway_args, key) if p.name == "through kvgate"
                ]
                rows.append((name, through[0]))
        finally:
            if redis_ctx is not None:
                redis_ctx.__exit__(None, None, None)
    print(
        f"{args.requests} requests per configuration, concurrency {args.concurrency}, "
        f"stream={args.stream}"
    )
    print(
        f"{'gateway':<26} {'errors':>6} {'req/s':>8} {'gateway ms/req':>15} {'× no billing':>13}"
        f" {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"
    )
    base_cpu = rows[0][1].gateway_cpu_s / args.requests
    for name, p in rows:
        per = p.gateway_cpu_s / args.requests
        print(
            f"{name:<26} {p.errors:>6} {args.requests / p.wall_s:>8.0f} {per * 1e3:>15.3f} "
            f"{per / base_cpu:>13.2f} {p.ttft_ms(0.5):>12.2f} {p.ttft_ms(0.99):>12.2f}"
        )
    print("TTFT: sent to the first body bytes (with --stream, the first event: billing writes")
    print("the stream's open WAL entry before it goes out)")
    print("(the pricing engine alone, in-process: kvgate billing bench)")
    return 1 if any(p.errors for _, p in rows) else 0
