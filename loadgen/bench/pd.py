"""`kvgate bench-pd`: a prefill/decode fleet behind kvgate and behind the peers' own P/D modes.

Each arm gets fresh simulated engines — `--prefill` instances with `kv_role: kv_producer` and
`--decode` instances with `kv_role: kv_consumer` (vLLM's NixlConnector protocol,
`loadgen.engine.disagg`) — its router, and one open-loop replay of the same trace slice:

    kvgate              kvgate serve --engine P... --decode-engine D...   (docs/disaggregation.md)
    kvgate:sglang       the same with KVGATE_PD_PROTOCOL=sglang, its engines in SGLang's mode
    vllm:cache_aware    vllm-router --vllm-pd-disaggregation --prefill P... --decode D...
                        --policy cache_aware
    vllm:round_robin    the same, --policy round_robin
    sglang:cache_aware  python -m sglang_router.launch_router --pd-disaggregation
                        --prefill P BOOTSTRAP_PORT... --decode D... --policy cache_aware
                        (its engines in SGLang's mode, `--disaggregation-mode prefill|decode`:
                        the bootstrap port is each prefill engine's HTTP port)

That the peers complete requests against the fleet is itself the check that the engine speaks
the protocol. Figures per arm: the prefill pool's hit ratio (its engines' own prefix-cache
counters), TTFT mean and p99, TPOT p99 (each request's mean time between output tokens after
the first: (e2e - TTFT) / (output - 1), the inter-token latency a client sees, p99 over
requests), the decode pool's imbalance (the busiest decode instance's output tokens over the
mean) and the KV bytes pulled per request (the decode instances' `vllm:nixl_bytes_transferred`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadgen.bench.peers import (
    BENCH_KEY,
    ENGINE_BLOCK_SIZE,
    READY_TIMEOUT_S,
    _vllm_router_binary,
    _wait_for_model,
)
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.replay import ReplayOptions, replay
from loadgen.sim import percentile
from loadgen.traces.readers import read_trace

ARMS = ("kvgate", "kvgate:sglang", "vllm:cache_aware", "vllm:round_robin", "sglang:cache_aware")
SGLANG_FLEET_ARMS = ("kvgate:sglang", "sglang:cache_aware")
"""Arms whose engines run in SGLang's `--disaggregation-mode` (kvgate with `pd_protocol:
sglang`, and sglang-router), the others in vLLM's NixlConnector roles."""
DEFAULT_TRACE = "agent-sessions:sessions=24,concurrency=8"
DEFAULT_REQUESTS = 300
DEFAULT_TIME_SCALE = 4.0
DEFAULT_CAPACITY_BLOCKS = 4096
"""Per engine: 64k tokens of KV, a few agent sessions' worth, so the prefill pick matters."""
DEFAULT_MAX_OUTPUT_TOKENS = 64
DEFAULT_PREFILL_TOKENS_PER_S = 26_000.0
"""Twice the engine's default: two prefill instances then prefill as fast as `kvgate bench`'s
four whole engines, so the pool is not saturated by construction on the same slice."""
DIRECTORY_TOKENS_PER_BLOCK = 40
"""Engine tokens per entry of kvgate's directory on this bench's agent-session text (a 256-byte
block of prompt: 54,000 prompt tokens matched 1,365 blocks in a `bench-pd` access log)."""
PRODUCER_CONFIG = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
CONSUMER_CONFIG = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'


@dataclass(frozen=True)
class PdResult:
    arm: str
    requests: int
    errors: int
    prefill_hit_ratio: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    decode_imbalance: float
    transfer_bytes_per_request: float
    note: str = ""


def _counters(url: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        value = sum(s.value for s in family.samples if not s.name.endswith("_created"))
        totals[family.name] = totals.get(family.name, 0.0) + value
    return totals


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@contextlib.contextmanager
def _fleet(
    num_prefill: int, num_decode: int, engine_args: Sequence[str], sglang: bool
) -> Iterator[tuple[list[processes.Proc], list[processes.Proc]]]:
    ports = [processes.free_port() for _ in range(num_prefill + num_decode)]

    def role(prefill: bool) -> list[str]:
        if sglang:
            return ["--disaggregation-mode", "prefill" if prefill else "decode"]
        return ["--kv-transfer-config", PRODUCER_CONFIG if prefill else CONSUMER_CONFIG]

    procs = [
        processes.start_engine(port, [*engine_args, *role(i < num_prefill)])
        for i, port in enumerate(ports)
    ]
    try:
        processes.wait_all(procs, "/health", None)
        yield procs[:num_prefill], procs[num_prefill:]
    finally:
        processes.stop(procs)


@contextlib.contextmanager
def _router(
    arm: str,
    prefill: Sequence[str],
    decode: Sequence[str],
    prefill_tokens_per_s: float,
    directory_capacity_blocks: int | None,
) -> Iterator[tuple[str, str | None]]:
    """The arm's router: (its URL, the API key it wants). kvgate is told the engines' prefill
    speed in wall seconds (flow control sizes its room by it); its directory keeps the default
    `directory_capacity_blocks` (65,536 entries, an H100's KV several times over), which the
    gateway caps at each engine's reported KV (`vllm:cache_config_info`), unless
    `--directory-scale` sets it by hand. Before the gateway capped it, the default against
    4,096-block engines never forgot a prefix the prefill instance had evicted, continuations
    kept matching it, and every request went to one prefill instance (issue 42: hit ratio
    27.7% against round robin's 40.9%)."""
    if arm.startswith("kvgate"):
        args = ["--tenant", f"bench:{BENCH_KEY}", "--log-level", "warning"]
        args += [a for d in decode for a in ("--decode-engine", d)]
        env = {
            "KVGATE_SEED": "0",
            "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": f"{prefill_tokens_per_s:g}",
            "KVGATE_PD_PROTOCOL": "sglang" if arm == "kvgate:sglang" else "vllm",
        }
        if directory_capacity_blocks is not None:
            env["KVGATE_DIRECTORY_CAPACITY_BLOCKS"] = str(directory_capacity_blocks)
        with processes.gateway(prefill, args, env=env) as gw:
            yield gw.url, BENCH_KEY
        return
    port = processes.free_port()
    if arm.startswith("sglang:"):
        command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        # the simulated prefill's bootstrap server is its HTTP port
        command += [a for p in prefill for a in ("--prefill", p, p.rpartition(":")[2])]
    else:
        binary = _vllm_router_binary()
        assert binary is not None, "checked before"
        command = [binary, "--vllm-pd-disaggregation"]
        command += [a for p in prefill for a in ("--prefill", p)]
    level = "warn" if arm.startswith("sglang:") else "warning"  # each router's own spelling
    command += ["--log-level", level, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-port", str(processes.free_port())]
    command += [a for d in decode for a in ("--decode", d)]
    command += ["--policy", arm.partition(":")[2]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    popen = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    proc = processes.Proc(arm, f"http://127.0.0.1:{port}", popen)
    try:
        _wait_for_model(proc.url, popen, READY_TIMEOUT_S)
        yield proc.url, None
    finally:
        processes.stop([proc])


WARMUP_REQUESTS = 4
"""Untimed requests through each arm before its replay (and before its counters are read): a
cold fleet's first requests (connections, the engines' and the router's first-call costs) held
the replay's first burst back for seconds at load 20, in kvgate's arm alone (its routers
start the same engines; vllm-router and sglang-router probe their workers before they serve)."""


def _warm_up(url: str, key: str | None) -> None:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    for i in range(WARMUP_REQUESTS):
        body = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": f"warm up {i}"}],
            "max_tokens": 2,
        }
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        answer.raise_for_status()


def run_arm(arm: str, args: argparse.Namespace) -> PdResult:
    trace = read_trace(args.trace, start=args.start, limit=args.requests)
    engine_args = [
        "--time-scale",
        f"{args.time_scale:g}",
        "--capacity-blocks",
        str(args.capacity_blocks),
        "--prefill-tokens-per-s",
        f"{args.prefill_tokens_per_s:g}",
    ]
    with contextlib.ExitStack() as stack:
        sglang = arm in SGLANG_FLEET_ARMS
        prefill, decode = stack.enter_context(
            _fleet(args.prefill, args.decode, engine_args, sglang)
        )
        url, key = stack.enter_context(
            _router(
                arm,
                [p.url for p in prefill],
                [d.url for d in decode],
                args.prefill_tokens_per_s * args.time_scale,
                directory_capacity_blocks(args),
            )
        )
        _warm_up(url, key)
        before = [_counters(e.url) for e in (*prefill, *decode)]
        options = ReplayOptions(
            url,
            (key,) if key else (),
            time_scale=args.time_scale,
            max_output_tokens=args.max_output_tokens,
            label=arm,
        )
        rows, _ = asyncio.run(replay(trace, options))
        after = [_counters(e.url) for e in (*prefill, *decode)]
    n_p = len(prefill)

    def deltas(name: str, pool: slice) -> list[float]:
        return [_delta(b, a, name) for b, a in zip(before[pool], after[pool], strict=True)]

    queries = sum(deltas("vllm:prefix_cache_queries", slice(0, n_p)))
    hits = sum(deltas("vllm:prefix_cache_hits", slice(0, n_p)))
    generated = deltas("vllm:generation_tokens", slice(n_p, None))
    pulled = sum(deltas("vllm:nixl_bytes_transferred", slice(n_p, None)))
    ok = [r for r in rows if r.ok]
    ttfts = [r.ttft_s * 1e3 for r in ok]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    mean_generated = statistics.fmean(generated) if generated else 0.0
    return PdResult(
        arm,
        len(rows),
        len(rows) - len(ok),
        hits / queries if queries else 0.0,
        statistics.fmean(ttfts) if ttfts else math.nan,
        percentile(ttfts, 0.99) if ttfts else math.nan,
        percentile(tpots, 0.99) if tpots else math.nan,
        max(generated) / mean_generated if mean_generated else math.nan,
        pulled / max(len(ok), 1),
        next((r.error[:120] for r in rows if not r.ok), ""),
    )


def directory_capacity_blocks(args: argparse.Namespace) -> int | None:
    """kvgate's directory entries per engine: `--directory-scale` times an engine's KV (None:
    the gateway's default, capped at each engine's reported KV)."""
    if args.directory_scale is None:
        return None
    tokens = int(args.capacity_blocks) * ENGINE_BLOCK_SIZE
    scale = float(args.directory_scale)
    return max(math.ceil(tokens / DIRECTORY_TOKENS_PER_BLOCK * scale), 1)


def markdown(results: Sequence[PdResult]) -> str:
    lines = [
        "| arm | requests | errors | prefill hit ratio | TTFT mean ms | TTFT p99 ms | "
        "TPOT p99 ms | decode imbalance | KV MB pulled/request |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.arm} | {r.requests} | {r.errors} | {r.prefill_hit_ratio:.1%} | "
            f"{r.ttft_mean_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.tpot_p99_ms:.1f} | "
            f"{r.decode_imbalance:.2f} | {r.transfer_bytes_per_request / 1e6:.1f} |"
        )
    return "\n".join(lines)


def add_bench_pd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", default=DEFAULT_TRACE, help="a trace file or agent-sessions spec"
    )
    parser.add_argument("--start", type=int, default=0, help="first request of the slice")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="slice length")
    parser.add_argument("--prefill", type=int, default=2, help="prefill instances")
    parser.add_argument("--decode", type=int, default=2, help="decode instances")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="compression")
    parser.add_argument(
        "--capacity-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS, help="KV blocks per engine"
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help="every engine's simulated prefill speed",
    )
    parser.add_argument(
        "--directory-scale",
        type=float,
        default=None,
        help="kvgate's directory capacity as a multiple of each engine's KV, at "
        f"{DIRECTORY_TOKENS_PER_BLOCK} tokens an entry (default: the gateway's own, "
        "directory_capacity_blocks capped at each engine's reported KV)",
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=DEFAULT_MAX_OUTPUT_TOKENS, help="output cap"
    )
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated: {', '.join(ARMS)}"
    )


def run_bench_pd(args: argparse.Namespace) -> int:
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"kvgate bench-pd: unknown arms {unknown}; known: {', '.join(ARMS)}", file=sys.stderr)
        return 2
    results: list[PdResult] = []
    for arm in arms:
        if arm.startswith("vllm:") and _vllm_router_binary() is None:
            print(f"{arm}: vllm-router is not installed (pip install -e '.[bench]')")
            continue
        if arm.startswith("sglang:") and importlib.util.find_spec("sglang_router") is None:
            print(f"{arm}: sglang-router is not installed (pip install -e '.[bench]')")
            continue
        results.append(run_arm(arm, args))
        print(markdown(results[-1:]).splitlines()[-1], flush=True)
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"\n{args.prefill} prefill + {args.decode} decode, {args.trace} from {args.start}, "
        f"{args.requests} requests, time scale {args.time_scale:g}, "
        f"load average {' '.join(loadavg)}"
    )
    print(markdown(results))
    for r in results:
        if r.note:
            print(f"{r.arm}: first error: {r.note}")
    return 0
