"""A router's max sustainable request rate: open-loop rate steps against engines that answer at
once (`loadgen.bench.fast_engine`), so the router, not the engines, is what saturates.

Why open loop and instant engines: a closed loop (C clients, each sending when its last answer
came) measures the peak throughput at whatever latency it takes, and its clients slow down
with the router, hiding a queue. An open loop sends on a fixed schedule whatever happens, so
a router that cannot keep up sees its queue grow and its TTFT climb within a step, which is
what "not sustainable" means in production. With the simulated engines behind it, the
engines' prefill queues would saturate first (they are sized to be ~70% busy at the bench's
trace rate); the stand-ins do no work per request but parse its JSON and stream its tokens.

The steps (`RateOptions`): `start_rps`, then × `factor` each step, at most `max_steps`, each
`step_s` long. Request k of a step is due at `k / rate` (evenly spaced: no bursts the router
is not responsible for). A step is **sustained** when at most `MAX_ERROR_SHARE` of its requests
failed (HTTP errors, no `[DONE]`, not finished within `DRAIN_S` of the step's end) and its p99
TTFT, counted from when each request was due (so a client that falls behind counts too), is
at most `p99_ttft_s`. The first step that is not ends the ramp, and one more step at the
geometric mean of the last sustained and the failed rate narrows the answer (`next_rate`). The
max sustainable rate is the highest sustained step's.

The client is one Python process (this one), so it has a ceiling of its own: the
`client:round_robin` arm (no router, straight at the stand-ins) measures it in the same run,
and an arm whose max is near it is client-bound, not router-bound.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.sim import percentile
from loadgen.traces.readers import Trace
from loadgen.traces.synthesis import PromptSynthesizer

DEFAULT_START_RPS = 20.0
"""Below any router's ceiling here (kvgate's ~6 ms of CPU per agent request: ~160/s a core)."""
DEFAULT_FACTOR = 1.5
DEFAULT_MAX_STEPS = 11
"""20 × 1.5^10 ≈ 1,150 requests/s at the last step: kvgate and sglang-router both held 342/s
(the 8th step) on agent-sized bodies here, and one Python client cannot send much more."""
DEFAULT_STEP_S = 4.0
"""Long enough that a router 10% over its ceiling queues ~0.4 s of work (p99 TTFT past the
bound), short enough that 11 steps and a refinement cost ~1.5 minutes per arm at most."""
DEFAULT_P99_TTFT_S = 0.25
"""An instant engine's TTFT through a router is ~2-10 ms: 250 ms means a queue has built."""
DEFAULT_OUTPUT_TOKENS = 16
"""Streamed tokens per answer, one event each: the relay's per-chunk cost counts, at a quarter
of the replay's 64 so the stand-ins stay cheap."""
_T = TypeVar("_T")
MAX_ERROR_SHARE = 0.01
DRAIN_S = 5.0
"""After a step's last send, requests still open this long are counted as failed."""
NUM_BODIES = 200
"""Distinct prompts cycled through (~12 MB of agent-sized bodies held at once, not the slice's
~120 MB)."""
MAX_IN_FLIGHT = 1024
"""A step never holds more: past it a request is not sent and counts as failed (the router is
far behind; the client must not grow without bound)."""


@dataclass(frozen=True)
class RateOptions:
    start_rps: float = DEFAULT_START_RPS
    factor: float = DEFAULT_FACTOR
    max_steps: int = DEFAULT_MAX_STEPS
    step_s: float = DEFAULT_STEP_S
    p99_ttft_s: float = DEFAULT_P99_TTFT_S
    output_tokens: int = DEFAULT_OUTPUT_TOKENS

    def __post_init__(self) -> None:
        if self.start_rps <= 0 or self.step_s <= 0 or self.p99_ttft_s <= 0:
            raise ValueError("the rate steps' start, duration and p99 bound must be positive")
        if self.factor <= 1:
            raise ValueError("--rate-factor must be above 1")
        if self.max_steps < 0 or self.output_tokens < 1:
            raise ValueError("--rate-steps must be >= 0 and --rate-output-tokens >= 1")


@dataclass
class Step:
    offered_rps: float
    sent: int
    ok: int
    errors: int
    achieved_rps: float
    """Answers completed per second of the step's send window."""
    ttft_p50_s: float
    ttft_p99_s: float
    sustained: bool
    router_cpu_ms_per_request: float | None = None
    engine_cpu_ms_per_request: float | None = None
    first_error: str = ""


@dataclass
class RateResult:
    max_sustained_rps: float | None
    """None: not even the first step was sustained."""
    reached_last_step: bool
    """Every step was sustained: the router's ceiling is above the last one (read it as ≥)."""
    steps: list[Step] = field(default_factory=list)


def sustained(errors: int, sent: int, ttft_p99_s: float, options: RateOptions) -> bool:
    """The step's verdict: few enough failures and a p99 TTFT within the bound."""
    return sent > 0 and errors <= MAX_ERROR_SHARE * sent and ttft_p99_s <= options.p99_ttft_s


def next_rate(steps: Sequence[Step], options: RateOptions) -> float | None:
    """The next step's rate, or None when the ramp is over: × factor while every step held (at
    most `max_steps`), then one step at the geometric mean of the last sustained and the first
    failed rate."""
    if not steps:
        return options.start_rps if options.max_steps > 0 else None
    failed = [i for i, s in enumerate(steps) if not s.sustained]
    if not failed:
        return None if len(steps) >= options.max_steps else steps[-1].offered_rps * options.factor
    if failed[0] != len(steps) - 1:
        return None  # the refinement step has run
    below = [s.offered_rps for s in steps if s.sustained]
    return math.sqrt(max(below) * steps[-1].offered_rps) if below else None


def request_bodies(trace: Trace, options: RateOptions) -> list[bytes]:
    """The slice's first `NUM_BODIES` prompts as the replay sends them (streamed, usage
    included), serialised once, `options.output_tokens` tokens each; the steps cycle through
    them."""
    synth = PromptSynthesizer(trace.block_size)
    return [
        orjson.dumps(
            {
                "model": DEFAULT_MODEL,
                "messages": synth.messages(req),
                "max_tokens": options.output_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        for req in trace.requests[:NUM_BODIES]
    ]


async def _one(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, due: float
) -> float | str:
    """TTFT from `due` to the first body bytes, or what was wrong when the answer is not a
    whole stream."""
    ttft: float | None = None
    tail = b""
    try:
        async with http.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                return f"{resp.status} {(await resp.read())[:120].decode(errors='replace')}"
            async for chunk in resp.content.iter_any():
                if ttft is None:
                    ttft = time.monotonic() - due
                tail = (tail + chunk)[-32:]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"[:160]
    if ttft is None or not (b"[DONE]" in tail or tail.endswith(b"}")):  # or a whole JSON answer
        return "the stream ended without [DONE]"
    return ttft


async def run_step(
    targets: Sequence[str],
    api_key: str | None,
    bodies: Sequence[bytes],
    rate: float,
    options: RateOptions,
    first: int = 0,
) -> tuple[int, int, list[float], float, str]:
    """One open-loop step at `rate`: (sent, errors, TTFTs of the answers, the send window's
    seconds, the first error). Request k carries body `first + k` (mod the bodies) and target
    k mod targets."""
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    urls = [t.rstrip("/") + "/v1/chat/completions" for t in targets]
    num = max(int(rate * options.step_s), 1)
    connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
    ttfts: list[float] = []
    errors = 0
    first_error = ""
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks: list[asyncio.Task[float | str]] = []
        in_flight: set[asyncio.Task[float | str]] = set()
        start = time.monotonic()
        for k in range(num):
            due = start + k / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= MAX_IN_FLIGHT:
                errors += 1
                first_error = first_error or f"{MAX_IN_FLIGHT} requests in flight: not sent"
                continue
            body = bodies[(first + k) % len(bodies)]
            task = asyncio.create_task(_one(http, urls[k % len(urls)], headers, body, due))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            tasks.append(task)
        window = max(time.monotonic() - start, num / rate)
        done, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        outcome = task.result()
        if isinstance(outcome, str):
            errors += 1
            first_error = first_error or outcome
        else:
            ttfts.append(outcome)
    if pending:
        errors += len(pending)
        first_error = first_error or f"not answered within {DRAIN_S:g} s of the step's end"
    return num, errors, ttfts, window, first_error


def _run(step: Coroutine[Any, Any, _T]) -> _T:
    """On uvloop, as the gateway runs: the client's own ceiling is what bounds the last steps."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - installed with the gateway
        return asyncio.run(step)
    return uvloop.run(step)


def ramp(
    targets: Sequence[str],
    api_key: str | None,
    bodies: Sequence[bytes],
    options: RateOptions,
    cpu: Callable[[], tuple[float | None, float]] = lambda: (None, 0.0),
) -> RateResult:
    """Steps until `next_rate` says stop; `cpu()` gives (router, engines) CPU seconds so far, to
    attribute per step."""
    steps: list[Step] = []
    first = 0
    while (rate := next_rate(steps, options)) is not None:
        router0, engines0 = cpu()
        sent, errors, ttfts, window, first_error = _run(
            run_step(targets, api_key, bodies, rate, options, first)
        )
        router1, engines1 = cpu()
        first += sent
        p99 = percentile(ttfts, 0.99) if ttfts else math.inf
        ok = len(ttfts)
        steps.append(
            Step(
                offered_rps=rate,
                sent=sent,
                ok=ok,
                errors=errors,
                achieved_rps=ok / window,
                ttft_p50_s=percentile(ttfts, 0.5) if ttfts else math.inf,
                ttft_p99_s=p99,
                sustained=sustained(errors, sent, p99, options),
                router_cpu_ms_per_request=(
                    (router1 - router0) / max(ok, 1) * 1e3
                    if router0 is not None and router1 is not None
                    else None
                ),
                engine_cpu_ms_per_request=(engines1 - engines0) / max(ok, 1) * 1e3,
                first_error=first_error,
            )
        )
    held = [s.offered_rps for s in steps if s.sustained]
    return RateResult(
        max(held) if held else None,
        bool(steps) and all(s.sustained for s in steps),
        steps,
    )
