"""The gateway's CPU time per proxied request, and per relayed SSE chunk (a benchmark, not a test).

Starts one simulated engine and a gateway in subprocesses, sends N chat requests at a fixed
concurrency, and reads the gateway process's CPU time (user + system from /proc) before and
after. Side by side in the same run it measures the same requests sent to the engine directly,
so the engine's share is visible and the machine's noise hits both alike.

`--relay` measures the relay alone: an engine paced so every token is its own SSE event and its
own network read (time scale `RELAY_TIME_SCALE`), the same requests with few and with many
output tokens; the gateway's extra CPU divided by the extra events is its cost per relayed
chunk, with everything a request costs once (parse, route, record) cancelled out. With
`--against TREE` both trees' gateways relay from one paced engine in passes A B B A, each
arm's figure beside the engine's own CPU per chunk (the same code in both arms: the machine's
yardstick), since two separate runs on this shared machine differ by more than a regression.

`--conversations N` measures precise mode's keying against approximate mode's (issue 16): N
agent conversations (each its own ~2,000-token system prompt, ~300-token user turns, the
engine's ~100-token replies appended as an agent appends them) through an approximate gateway
and through a precise one (the model's tokenizer, engines publishing KV events), all up at once
and run in blocks of turns, A B C then C B A, so the machine's drift during the run moves every
arm alike; the first turns (the whole prompt tokenized) and the continuations (turns 2 to
`--turns`) are separate passes, so each is reported per request on its own.

`--floor` measures, in the same passes, the floor under the gateway: a proxy on the gateway's
own stack (`tools.floor`: uvicorn as the gateway configures it, a raw ASGI callable, the
gateway's engine client and its writes to the client) that forwards each request to the same
engine and returns its answer, with no parse, routing, records or metrics. Its CPU per request
is what the stack alone costs; the gateway's over it is what the gateway's own work costs
(issue 41). The two alternate in passes of half the requests, kvgate, floor, floor, kvgate.

`--suite` runs what issue 17 tracks in one go: small and agent-sized prompts, each with and
without streaming, the per-stage costs of an agent-sized body (`tools.stages`), and the
relay. Every run prints what it ran on first, because the same commit measures 0.34 ms on a
quiet machine and twice that on a loaded one: the gateway shares the cores with the engine and
the client, the CPU's clock and cache are shared with whatever else runs, and /proc counts in
10 ms ticks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import orjson

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness import processes
from loadgen.text import words

FAST_ENGINE = ["--time-scale", "1000000", "--max-batch", "1024"]
"""Every token at once: the engine costs the gateway a request, not a wait."""
RELAY_TIME_SCALE = 4
"""A decode step of ~2.6 ms at 16 sequences: each token is its own event and network read."""
RELAY_TOKENS = (8, 136)
"""Output tokens of the relay's two passes: the difference is what the relay alone costs."""
AGENT_PROMPT_BYTES = 50_000
"""The suite's agent-sized system prompt (the trace's ~60 KB bodies)."""
SYSTEM_WORDS, USER_WORDS, REPLY_TOKENS = 2000, 300, 100
"""A conversation's shape (`--conversations`): ~1 token per generated word."""
WARM_CONVERSATIONS = 8
"""Conversations run (3 turns each) before the passes: connections, caches, code."""
CONVERSATION_ENGINE = [*FAST_ENGINE, "--capacity-blocks", str(1 << 18)]
"""KV for 4M tokens: every conversation stays cached, so the engine announces only each turn's
new blocks (an engine that thrashes re-announces whole prompts: event ingest, measured apart by
`tools.precise_cost ingest`, not keying)."""
ARMS = ("approximate", "precise, events off", "precise")
BLOCK_TURNS = 10
"""Turns an arm runs before the next arm's turn (`--conversations`): 300 requests at 30
conversations, so a gateway's caches go cold once in 300 requests, not once a turn."""


@dataclass(slots=True)
class Pass:
    name: str
    errors: int
    wall_s: float
    engine_cpu_s: float
    gateway_cpu_s: float
    events: int
    gateway_system_s: float = 0.0
    """The part of `gateway_cpu_s` spent in the kernel (socket reads and writes, epoll)."""
    ttfts_s: list[float] = field(default_factory=list)
    """Per request, sent to its first body bytes (a streamed answer's first event)."""

    def ttft_ms(self, q: float) -> float:
        """The `q` quantile of `ttfts_s` in ms (nearest rank; 0 with none)."""
        ranked = sorted(self.ttfts_s)
        return ranked[min(len(ranked) - 1, int(q * len(ranked)))] * 1e3 if ranked else 0.0


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
    parser.add_argument(
        "--relay", action="store_true", help="µs of gateway CPU per relayed SSE chunk, alone"
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="precise vs approximate keying on N agent conversations (first turns apart)",
    )
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation")
    parser.add_argument(
        "--against",
        metavar="TREE",
        help="this checkout's gateway and another tree's (a compiled build: `make compile`), "
        "the same engine, passes interleaved A B B A (with --relay: the relay's µs per chunk)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also a bare proxy on the gateway's stack (tools.floor), passes interleaved: "
        "the floor under the gateway's CPU (small or --stream requests only)",
    )
    parser.add_argument(
        "--suite",
        action="store_true",
        help="small and agent-sized, streamed and not, the stages and the relay (issue 17)",
    )


def environment() -> str:
    """What the numbers were measured on (they move with each)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    extras = []
    for name in ("uvloop", "httptools", "hiredis", "orjson", "aiohttp"):
        try:
            extras.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            extras.append(f"{name} absent")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"python {platform.python_version()} ({platform.python_implementation()}), {model}, "
        f"{os.cpu_count()} cores, load average {load}; {'; '.join(extras)}"
    )


def _system_prompt(prompt_bytes: int) -> str:
    return words("bench-cpu", prompt_bytes // 5) if prompt_bytes else "You are terse. " * 20


async def _load(
    url: str,
    key: str | None,
    n: int,
    args: argparse.Namespace,
    max_tokens: int,
    ttfts: list[float] | None = None,
) -> tuple[int, int]:
    """(errors, SSE events received) for `n` requests at `args.concurrency`; each request's
    time to its first body bytes appended to `ttfts` when given."""
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    errors = events = 0
    counter = iter(range(n))
    system = _system_prompt(args.prompt_bytes)

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal errors, events
        for i in counter:
            body = {
                "model": DEFAULT_MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"request {i % 50}"},
                ],
                "max_tokens": max_tokens,
                "stream": args.stream,
            }
            sent = time.perf_counter()
            first = True
            async with http.post(
                url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
            ) as resp:
                async for data in resp.content.iter_any():
                    if first and ttfts is not None:
                        ttfts.append(time.perf_counter() - sent)
                    first = False
                    events += data.count(b"\n\n")
                    if resp.status != 200 and not errors:  # what went wrong, once
                        print(f"  first error: {resp.status} {data[:200]!r}")
                errors += resp.status != 200

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    return errors, events


def _timed(
    name: str,
    url: str,
    key: str | None,
    pids: tuple[int, int | None],
    args: argparse.Namespace,
    max_tokens: int,
) -> Pass:
    engine_pid, gw_pid = pids
    engine_cpu0 = processes.cpu_seconds(engine_pid)
    gw_user0, gw_sys0 = processes.cpu_split(gw_pid) if gw_pid else (0.0, 0.0)
    t0 = time.monotonic()
    ttfts: list[float] = []
    errors, events = asyncio.run(_load(url, key, args.requests, args, max_tokens, ttfts))
    wall = time.monotonic() - t0
    engine_cpu = processes.cpu_seconds(engine_pid) - engine_cpu0
    gw_user, gw_sys = processes.cpu_split(gw_pid) if gw_pid else (0.0, 0.0)
    gw_user, gw_sys = gw_user - gw_user0, gw_sys - gw_sys0
    return Pass(name, errors, wall, engine_cpu, gw_user + gw_sys, events, gw_sys, ttfts)


@contextlib.contextmanager
def _floor(engine_url: str) -> Iterator[processes.Proc]:
    """`tools.floor` on `engine_url`, answering (a subprocess: it runs the gateway's code,
    which loadgen does not import)."""

    def start() -> processes.Proc:
        port = processes.free_port()
        argv = [sys.executable, "-m", "tools.floor", "--port", str(port), "--engine", engine_url]
        popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return processes.Proc(f"floor:{port}", f"http://127.0.0.1:{port}", popen)

    procs = [start()]
    try:
        processes.wait_all(procs, "/readyz", start)
        yield procs[0]
    finally:
        processes.stop(procs)


def _beside_floor(
    args: argparse.Namespace, key: str, engine: processes.Proc, arms: dict[str, processes.Proc]
) -> list[Pass]:
    """Direct to the engine, then the arms (kvgate, the floor: the same requests, its key
    included) in passes of half the requests, A B B A, each arm's two summed."""
    direct = _timed("direct to engine", engine.url, None, (engine.pid, None), args, args.max_tokens)
    half = argparse.Namespace(**{**vars(args), "requests": args.requests // 2})
    names = [*arms, *reversed(arms)]
    timed = [
        _timed(n, arms[n].url, key, (engine.pid, arms[n].pid), half, args.max_tokens) for n in names
    ]
    return [direct, *(_summed(n, [p for p in timed if p.name == n]) for n in arms)]


def _measure(
    args: argparse.Namespace,
    gateway_args: list[str],
    key: str,
    engine_args: list[str] = FAST_ENGINE,
    tokens: tuple[int, ...] = (),
    floor: bool = False,
) -> list[Pass]:
    """Direct to the engine, then through kvgate (one pass per entry of `tokens` when given);
    with `floor`, through kvgate and through the floor in passes of half the requests, A B B A
    (their sums are returned, kvgate's first)."""
    serve = ["--policy", args.policy, "--tenant", f"bench:{key}", "--log-level", "warning"]
    with (
        processes.engines(1, engine_args) as engines,
        processes.gateway([engines[0].url], [*serve, *gateway_args, *args.gateway_arg]) as gw,
        _floor(engines[0].url) if floor else contextlib.nullcontext() as bare,
    ):
        engine = engines[0]
        # warm up both paths (connections, caches, code)
        asyncio.run(_load(gw.url, key, 200, args, args.max_tokens))
        if bare is not None:
            asyncio.run(_load(bare.url, key, 200, args, args.max_tokens))
            return _beside_floor(args, key, engine, {"through kvgate": gw, "floor": bare})
        if tokens:
            return [
                _timed(f"kvgate, {n} tokens", gw.url, key, (engine.pid, gw.pid), args, n)
                for n in tokens
            ]
        return [
            _timed("direct to engine", engine.url, None, (engine.pid, None), args, args.max_tokens),
            _timed("through kvgate", gw.url, key, (engine.pid, gw.pid), args, args.max_tokens),
        ]


@contextlib.contextmanager
def _two_trees(
    args: argparse.Namespace, key: str, engine_args: list[str], warm: argparse.Namespace
) -> Iterator[tuple[processes.Proc, dict[str, processes.Proc], list[str]]]:
    """One engine, and this checkout's gateway (A) and `args.against`'s (B) on it, both up and
    warmed (connections, caches, code) with `warm`'s requests: (the engine, the arms by name,
    the names in the order A B B A)."""
    serve = ["--policy", args.policy, "--tenant", f"bench:{key}", "--log-level", "warning"]
    with (
        processes.engines(1, engine_args) as engines,
        processes.gateway([engines[0].url], [*serve, *args.gateway_arg]) as a,
        processes.gateway([engines[0].url], [*serve, *args.gateway_arg], cwd=args.against) as b,
    ):
        for gw in (a, b):
            asyncio.run(_load(gw.url, key, 200, warm, args.max_tokens))
        yield (
            engines[0],
            {"this checkout": a, args.against: b},
            [
                "this checkout",
                args.against,
                args.against,
                "this checkout",
            ],
        )


def run_against(args: argparse.Namespace, key: str) -> list[Pass]:
    """This checkout's gateway (A) and `args.against`'s (B) on one engine, both up at once, in
    four passes of half the requests each, A B B A: a machine that speeds up or slows down
    during the run moves both arms alike."""
    half = argparse.Namespace(**{**vars(args), "requests": args.requests // 2})
    with _two_trees(args, key, FAST_ENGINE, args) as (engine, arms, names):
        timed = [
            _timed(name, arms[name].url, key, (engine.pid, arms[name].pid), half, args.max_tokens)
            for name in names
        ]
    print(
        f"{args.requests} requests an arm in two passes (A B B A), concurrency "
        f"{args.concurrency}, stream={args.stream}, system prompt {args.prompt_bytes or 300:,} "
        "bytes"
    )
    print(f"{'gateway':<40} {'errors':>6} {'engine ms/req':>14} {'gateway ms/req':>15}")
    merged = []
    for name in dict.fromkeys(names):
        p = _summed(name, [p for p in timed if p.name == name])
        merged.append(p)
        per = 2 * half.requests
        print(
            f"{name:<40} {p.errors:>6} {p.engine_cpu_s / per * 1e3:>14.3f} "
            f"{p.gateway_cpu_s / per * 1e3:>15.3f}"
        )
    print(f"B / A: {merged[1].gateway_cpu_s / merged[0].gateway_cpu_s:.3f}")
    return merged


def _print_passes(args: argparse.Namespace, rows: list[tuple[str, Pass]]) -> None:
    print(
        f"{args.requests} requests, concurrency {args.concurrency}, policy {args.policy}, "
        f"stream={args.stream}, system prompt {args.prompt_bytes or 300:,} bytes, "
        f"max_tokens {args.max_tokens}"
    )
    header = f"{'path':<18} {'directory':<10} {'errors':>6} {'req/s':>8}"
    print(f"{header} {'engine ms/req':>14} {'gateway ms/req':>15}")
    for directory, p in rows:
        shown = directory if p.name == "through kvgate" else "-"
        print(
            f"{p.name:<18} {shown:<10} {p.errors:>6} {args.requests / p.wall_s:>8.0f} "
            f"{p.engine_cpu_s / args.requests * 1e3:>14.3f} "
            f"{p.gateway_cpu_s / args.requests * 1e3:>15.3f}"
        )


def _print_floor(args: argparse.Namespace, kvgate: Pass, floor: Pass) -> None:
    """The floor beside the gateway: ms a request, and its share of the gateway's."""
    gateway_ms = kvgate.gateway_cpu_s / args.requests * 1e3
    floor_ms = floor.gateway_cpu_s / args.requests * 1e3
    share = floor.gateway_cpu_s / kvgate.gateway_cpu_s if kvgate.gateway_cpu_s else 0.0
    print(
        f"floor (the stack alone): {floor_ms:.3f} ms/req, {share:.1%} of kvgate's "
        f"{gateway_ms:.3f}; kvgate over the floor: {gateway_ms - floor_ms:.3f} ms/req "
        f"({1 - share:.1%})"
    )


def _run_passes(args: argparse.Namespace, key: str) -> list[tuple[str, Pass]]:
    if args.floor:  # two arms in halves: an even count, so every row is per the same requests
        args = argparse.Namespace(**{**vars(args), "requests": args.requests - args.requests % 2})
    rows = [("in-process", p) for p in _measure(args, [], key, floor=args.floor)]
    if args.redis:
        from loadgen.harness.redis_servers import redis_server

        with redis_server(port=0) as server:
            redis_rows = _measure(args, ["--redis-url", server.url], key)
        rows += [("redis", p) for p in redis_rows if p.name == "through kvgate"]
    _print_passes(args, rows)
    if args.floor:
        _print_floor(args, rows[1][1], rows[2][1])
    return rows


def run_relay(args: argparse.Namespace, key: str) -> list[Pass]:
    """The relay's cost per chunk: the difference of two paced passes (module docstring)."""
    relay = argparse.Namespace(**{**vars(args), "stream": True})
    engine = ["--time-scale", str(RELAY_TIME_SCALE), "--max-batch", "1024"]
    short, long = _measure(relay, [], key, engine, RELAY_TOKENS)
    print(f"relay: {args.requests} streamed requests, concurrency {args.concurrency}, paced engine")
    for p in (short, long):
        print(
            f"  {p.name:<18} errors {p.errors}, {p.events:,} events, "
            f"gateway {p.gateway_cpu_s / args.requests * 1e3:.3f} ms/req"
        )
    chunks = long.events - short.events
    per_chunk = (long.gateway_cpu_s - short.gateway_cpu_s) / max(chunks, 1) * 1e6
    system = (long.gateway_system_s - short.gateway_system_s) / max(chunks, 1) * 1e6
    print(
        f"  gateway CPU per relayed chunk: {per_chunk:.1f} µs ({chunks:,} chunks more; "
        f"user {per_chunk - system:.1f}, system {system:.1f})"
    )
    return [short, long]


def _per_chunk(short: Pass, long: Pass) -> tuple[float, float, float]:
    """(gateway, its system part, engine) CPU µs per chunk: the long pass less the short one
    over the chunks between them. The engine's is the machine's yardstick: it runs the same code
    in every arm, so an arm's gateway over engine is the figure a loaded machine moves least."""
    chunks = max(long.events - short.events, 1)
    return (
        (long.gateway_cpu_s - short.gateway_cpu_s) / chunks * 1e6,
        (long.gateway_system_s - short.gateway_system_s) / chunks * 1e6,
        (long.engine_cpu_s - short.engine_cpu_s) / chunks * 1e6,
    )


def _summed(name: str, passes: list[Pass]) -> Pass:
    return Pass(
        name,
        sum(p.errors for p in passes),
        sum(p.wall_s for p in passes),
        sum(p.engine_cpu_s for p in passes),
        sum(p.gateway_cpu_s for p in passes),
        sum(p.events for p in passes),
        sum(p.gateway_system_s for p in passes),
    )


def run_relay_against(args: argparse.Namespace, key: str) -> list[Pass]:
    """The relay's cost per chunk of this checkout's gateway (A) and `args.against`'s (B) on
    one paced engine, both up at once, in passes A B B A of half the requests each (a short and
    a long pass every time, in turn short-long and long-short): a machine that speeds up or
    slows down during the run moves both arms alike (issue 41: a regression read apart on a
    busy machine was ~3x, within the drift of two separate runs)."""
    relay = argparse.Namespace(**{**vars(args), "stream": True, "requests": args.requests // 2})
    engine_args = ["--time-scale", str(RELAY_TIME_SCALE), "--max-batch", "1024"]
    with _two_trees(args, key, engine_args, relay) as (engine, arms, names):
        timed: dict[str, dict[int, list[Pass]]] = {n: {t: [] for t in RELAY_TOKENS} for n in arms}
        for i, name in enumerate(names):
            gw = arms[name]
            for n in RELAY_TOKENS if i % 2 == 0 else RELAY_TOKENS[::-1]:
                p = _timed(f"{name}, {n} tokens", gw.url, key, (engine.pid, gw.pid), relay, n)
                timed[name][n].append(p)
    print(
        f"relay: {2 * relay.requests} streamed requests an arm in two passes of each length "
        f"(A B B A), concurrency {args.concurrency}, paced engine"
    )
    print(
        f"{'gateway':<40} {'errors':>6} {'µs/chunk':>9} {'system':>7} {'engine':>7} {'gw/eng':>7}"
    )
    merged, ratios = [], []
    for name in arms:
        short, long = (_summed(f"{name}, {n} tokens", timed[name][n]) for n in RELAY_TOKENS)
        gateway, system, engine_us = _per_chunk(short, long)
        ratios.append((gateway, gateway / max(engine_us, 1e-9)))
        print(
            f"{name:<40} {short.errors + long.errors:>6} {gateway:>9.1f} {system:>7.1f} "
            f"{engine_us:>7.1f} {ratios[-1][1]:>7.3f}"
        )
        merged += [short, long]
    print(
        f"B / A: {ratios[1][0] / ratios[0][0]:.3f} per chunk, "
        f"{ratios[1][1] / ratios[0][1]:.3f} over the engine's"
    )
    return merged


def _suite(args: argparse.Namespace, key: str) -> list[Pass]:
    passes: list[Pass] = []
    for prompt_bytes in (0, AGENT_PROMPT_BYTES):
        for stream in (False, True):
            shaped = argparse.Namespace(
                **{**vars(args), "prompt_bytes": prompt_bytes, "stream": stream}
            )
            passes += [p for _, p in _run_passes(shaped, key)]
    # the stages run on the gateway's own code, which loadgen does not import
    subprocess.run([sys.executable, "-m", "tools.stages"], check=True)
    passes += run_relay(args, key)
    return passes


async def _turn(
    url: str, key: str, conversations: list[list[dict[str, object]]], turn: int, concurrency: int
) -> tuple[int, int]:
    """One turn of every conversation (a user message, then the engine's reply appended):
    (errors, prompt tokens)."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    errors = tokens = 0
    pending = iter(range(len(conversations)))

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal errors, tokens
        for c in pending:
            messages = conversations[c]
            messages.append({"role": "user", "content": words(f"cpu-c{c}-u{turn}", USER_WORDS)})
            body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": REPLY_TOKENS}
            async with http.post(
                url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
            ) as resp:
                answer = await resp.read()
            if resp.status != 200:
                errors += 1
                messages.append({"role": "assistant", "content": "(error)"})
                continue
            parsed = orjson.loads(answer)
            tokens += parsed["usage"]["prompt_tokens"]
            messages.append(
                {"role": "assistant", "content": parsed["choices"][0]["message"]["content"]}
            )

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return errors, tokens


@dataclass(slots=True)
class _Arm:
    """One arm of `--conversations`: its engine, its gateway and its conversations so far."""

    name: str
    url: str
    engine_pid: int
    gateway_pid: int
    conversations: list[list[dict[str, object]]]


@contextlib.contextmanager
def _conversation_arm(args: argparse.Namespace, key: str, arm: str) -> Iterator[_Arm]:
    """An engine and a gateway of the arm (`ARMS`: approximate; precise keys with the
    prediction only, the keying alone; precise with KV events), warmed, its conversations not
    started."""
    serve = ["--policy", args.policy, "--tenant", f"bench:{key}", "--log-level", "warning"]
    engine_args = CONVERSATION_ENGINE
    with contextlib.ExitStack() as stack:
        env: dict[str, str] | None = None
        if arm == "precise":
            procs, events = stack.enter_context(processes.engines_with_events(1, engine_args))
            extra, env = processes.precise_gateway_args(events, str(MODEL_DIR))
        else:
            procs = stack.enter_context(processes.engines(1, engine_args))
            extra = ["--tokenizer-dir", str(MODEL_DIR)] if arm.startswith("precise") else []
        engine = procs[0]
        gw = stack.enter_context(
            processes.gateway([engine.url], [*serve, *extra, *args.gateway_arg], env=env)
        )

        def system(name: str) -> list[dict[str, object]]:
            return [{"role": "system", "content": words(name, SYSTEM_WORDS)}]

        warm = [system(f"cpu-warm{c}") for c in range(WARM_CONVERSATIONS)]
        for turn in range(3):
            asyncio.run(_turn(gw.url, key, warm, turn, args.concurrency))
        conversations = [system(f"cpu-c{c}") for c in range(args.conversations)]
        yield _Arm(arm, gw.url, engine.pid, gw.pid, conversations)


def _interleaved_passes(args: argparse.Namespace, key: str) -> list[Pass]:
    """(first turns, continuations) of every arm, all arms up at once, run in blocks of
    `BLOCK_TURNS` turns, the arms in order in one block and in reverse in the next (A B C,
    C B A, ...): a machine that speeds up or slows down during the run moves every arm alike,
    and a gateway's caches go cold only once a block. Each arm's CPU is read over the whole
    pass, so what its gateway does in the background (ingesting its engine's events) counts,
    and so does what every gateway does idle while the others run (~3 ms/s, the same scrapes
    and probes in every arm)."""
    with contextlib.ExitStack() as stack:
        arms = [stack.enter_context(_conversation_arm(args, key, arm)) for arm in ARMS]
        passes: list[list[Pass]] = [[] for _ in arms]
        for name, turns in (("first turns", range(1)), ("continuations", range(1, args.turns))):
            engine0 = [processes.cpu_seconds(a.engine_pid) for a in arms]
            gateway0 = [processes.cpu_seconds(a.gateway_pid) for a in arms]
            errors, tokens = [0] * len(arms), [0] * len(arms)
            t0 = time.monotonic()
            blocks = [turns[i : i + BLOCK_TURNS] for i in range(0, len(turns), BLOCK_TURNS)]
            for b, block in enumerate(blocks):
                order = range(len(arms)) if b % 2 == 0 else reversed(range(len(arms)))
                for j in order:
                    a = arms[j]
                    for turn in block:
                        e, t = asyncio.run(
                            _turn(a.url, key, a.conversations, turn, args.concurrency)
                        )
                        errors[j], tokens[j] = errors[j] + e, tokens[j] + t
            wall = time.monotonic() - t0
            for j, a in enumerate(arms):
                passes[j].append(
                    Pass(
                        f"{a.name}: {name}",
                        errors[j],
                        wall,
                        processes.cpu_seconds(a.engine_pid) - engine0[j],
                        processes.cpu_seconds(a.gateway_pid) - gateway0[j],
                        tokens[j],  # prompt tokens, in the events field
                    )
                )
        return [p for arm_passes in passes for p in arm_passes]


def run_conversations(args: argparse.Namespace, key: str) -> list[Pass]:
    passes = _interleaved_passes(args, key)
    n = args.conversations
    print(
        f"{n} conversations x {args.turns} turns, concurrency {args.concurrency}; "
        f"system {SYSTEM_WORDS} words, user turns {USER_WORDS} words, replies {REPLY_TOKENS} tokens"
    )
    print(
        f"{'arm, pass':<28} {'requests':>8} {'errors':>6} {'tokens/req':>10} "
        f"{'engine ms/req':>14} {'gateway ms/req':>15}"
    )
    for p in passes:
        requests = n if "first" in p.name else n * (args.turns - 1)
        print(
            f"{p.name:<34} {requests:>8} {p.errors:>6} {p.events / requests:>10,.0f} "
            f"{p.engine_cpu_s / requests * 1e3:>14.3f} {p.gateway_cpu_s / requests * 1e3:>15.3f}"
        )
    approx_first, approx_cont = passes[:2]
    for i, arm in enumerate(ARMS[1:], 1):
        first, cont = passes[2 * i : 2 * i + 2]
        first_ms = (first.gateway_cpu_s - approx_first.gateway_cpu_s) / n * 1e3
        cont_ms = (cont.gateway_cpu_s - approx_cont.gateway_cpu_s) / (n * (args.turns - 1)) * 1e3
        per_token_us = first_ms * 1e3 / (first.events / n)
        print(
            f"{arm} - approximate: first turns {first_ms:+.3f} ms/req ({per_token_us:.2f} µs "
            f"per prompt token), continuations {cont_ms:+.3f} ms/req"
        )
    return passes


def run_bench_cpu(args: argparse.Namespace) -> int:
    key = "sk-bench"
    if args.floor and (args.conversations or args.suite or args.relay or args.against):
        print("kvgate bench-cpu: --floor goes with small or --stream requests only")
        return 2
    print(f"on: {environment()}")
    if args.conversations:
        passes = run_conversations(args, key)
    elif args.suite:
        passes = _suite(args, key)
    elif args.relay:
        passes = run_relay_against(args, key) if args.against else run_relay(args, key)
    elif args.against:
        passes = run_against(args, key)
    else:
        passes = [p for _, p in _run_passes(args, key)]
    print(f"after: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if any(p.errors for p in passes) else 0
