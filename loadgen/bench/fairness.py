"""Fair flow control, the noisy neighbour, live through the gateway (issue 43).

Two simulated engines; tenant B sends a B-word prompt every `--b-interval-s` (open loop, the
light tenant); tenant A floods with `--a-clients` closed-loop clients of A-word prompts; every
prompt distinct (no cache helps). Three runs per arm (`--arms`), each on fresh processes: B
alone, A alone, then B under A's flood. Arms: `kvgate:<policy>` (flow control on, the
default), `noflow:<policy>` (off), and the peers `sglang:<policy>` and `vllm:<policy>`
(sglang-router and vllm-router on the same simulated engines; they have no tenants, so both
tenants' requests reach them alike: the baseline a user has today). Printed per arm: B's TTFT
p50/p99 alone and under the flood, A's requests completed within B's window alone and under the
flood, failures and 5xx, and the issue's goal: B's p99 under the flood at most 1.5 × its solo
p99 plus one of A's prefills, A at least 90% of its solo completions, nothing failed, no 5xx.
Times are in engine time (measured × `--time-scale`), so a faster-than-real engine reports what
a real one would.

`--scenario bands`: the noisy neighbour with B in a high band (priority 0) and A in a low one
(priority 5), same weights: B's TTFT under A's flood; then a high-band tenant floods too, and
the low band's share of the queue's dispatches is printed beside its floor
(`floor / (1 + floor)` with two bands backlogged).

`--scenario affinity`: the bounded affinity wait's trade-off. Tenant B runs `--sessions`
closed-loop conversations, each turn its history (`--history-words`) plus every earlier turn
(`--turn-words` each), so a turn's cache is on the replica of its previous turn; tenant A floods
as in the noisy neighbour, so that replica is often full. One run per `--affinity-waits` value
(`flow_affinity_wait_ms`, fresh processes each): B's turns after the first (within the window)
with their hit ratio (the engines' cached tokens over the prompt tokens) and TTFT p50/p99, A's
completions, failures, and the gateway's affinity outcomes (waited / bound / no_wait).

`--scenario weights`: three tenants weighted 1:2:4 in a tenants file, all flooding; the share
of the queue's dispatches within the window (from the admin port's metrics) and of the prompt
tokens each was served (completed requests), beside its weight's share; and the same in every
`--window-s` window sliding by `--window-step-s` (the counters are read that often), the worst
of them against the goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loadgen.bench.peers import Arm, parse_arms, peer_missing, start_router
from loadgen.client import Result, stream_chat
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.engine.timing import DEFAULT_PREFILL_TOKENS_PER_S
from loadgen.harness import processes
from loadgen.runner import percentile
from loadgen.text import words

KEY_A = "sk-bench-flood"
KEY_B = "sk-bench-light"


def add_bench_fairness_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=2, help="simulated engine replicas")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long B sends")
    parser.add_argument("--a-clients", type=int, default=48, help="A's closed-loop clients")
    parser.add_argument("--a-words", type=int, default=8_000, help="words in each A prompt")
    parser.add_argument("--b-words", type=int, default=2_000, help="words in each B prompt")
    parser.add_argument("--b-interval-s", type=float, default=0.5, help="B sends one this often")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="engines run this many times faster"
    )
    parser.add_argument(
        "--arms",
        default="kvgate:cache_aware,noflow:cache_aware",
        help="the noisy neighbour's routers, comma-separated: kvgate:<policy> (flow control "
        "on), noflow:<policy> (off), sglang:<policy>, vllm:<policy> (the peers, no tenants)",
    )
    parser.add_argument(
        "--room-bounds",
        default="",
        help="noisy and bands: run each kvgate arm (bands: the scenario) once per "
        "flow_max_pending_prefill_s value (comma-separated seconds; empty: the gateway's "
        "default), so candidates are compared in one invocation",
    )
    parser.add_argument(
        "--lower-band-room-shares",
        default="",
        help="bands: run the scenario once per flow_lower_band_room_share value (comma-separated "
        "shares above 0 and at most 1, 1: every band gets the whole room bound; a value given "
        "twice runs twice; empty: the gateway's default), for each --room-bounds value",
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=30.0,
        help="weights: also report the shares in every window of this many seconds of the run "
        "(sliding by --window-step-s) and the worst window's deviation from the weights",
    )
    parser.add_argument(
        "--window-step-s",
        type=float,
        default=1.0,
        help="weights: the dispatch counters are read this often, and a window starts at each "
        "reading (the issue's 'any 30 s': the worst of every window this far apart)",
    )
    parser.add_argument(
        "--sessions", type=int, default=8, help="affinity: B's closed-loop conversations"
    )
    parser.add_argument(
        "--history-words", type=int, default=8_000, help="affinity: each conversation's history"
    )
    parser.add_argument("--turn-words", type=int, default=50, help="affinity: words per turn")
    parser.add_argument(
        "--affinity-waits",
        default="0,150,400",
        help="affinity: the flow_affinity_wait_ms values to run, comma-separated",
    )
    parser.add_argument(
        "--scenario",
        choices=("noisy", "weights", "bands", "affinity"),
        default="noisy",
        help="noisy: the noisy neighbour, flow control off and on; weights: three tenants "
        "weighted 1:2:4 (a tenants file), each flooding with --a-clients / 3 clients of "
        "--a-words words: their served prompt tokens against the weights; bands: B in band 0 "
        "under A's flood in band 5, then both bands flooding (the low band's floor); affinity: "
        "conversations beside A's flood at each --affinity-waits value (hit ratio, TTFT)",
    )


@dataclass
class Run:
    b: list[Result]
    a: list[Result]
    """A's requests that finished within B's sending window (`--seconds`)."""

    def failures(self) -> int:
        return sum(1 for r in self.a + self.b if not r.ok)

    def server_errors(self) -> int:
        return sum(1 for r in self.a + self.b if r.status >= 500)


def _body(text: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }


async def _traffic(
    url: str,
    args: argparse.Namespace,
    light: bool,
    flood: bool,
    keys: tuple[str | None, str | None] = (KEY_A, KEY_B),
) -> Run:
    """B's open loop for `--seconds` (its requests then finish) while A's clients loop; A's
    requests count when they finish within B's sending window, the same length in every run."""
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    stop = asyncio.Event()
    a_done: list[Result] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def flooder(i: int) -> None:
            n = 0
            while not stop.is_set():  # bounded: the window ends
                text = f"A{i}.{n} " + words(f"flood{i}.{n}", args.a_words)
                result = await stream_chat(http, url, keys[0], _body(text, args.max_tokens))
                a_done.append(result)
                n += 1

        async def light_one(k: int, at_s: float) -> Result:
            await asyncio.sleep(max(0.0, at_s - time.monotonic()))
            text = f"B{k} " + words(f"light{k}", args.b_words)
            return await stream_chat(http, url, keys[1], _body(text, args.max_tokens))

        flooders = [asyncio.create_task(flooder(i)) for i in range(args.a_clients if flood else 0)]
        if flood:  # let the flood fill the engines' queues before B measures
            await asyncio.sleep(2.0 * args.a_words / DEFAULT_PREFILL_TOKENS_PER_S / args.time_scale)
        start = time.monotonic()
        num_b = int(args.seconds / args.b_interval_s) if light else 0
        b = await asyncio.gather(
            *(light_one(k, start + k * args.b_interval_s) for k in range(num_b))
        )
        if not light:
            await asyncio.sleep(args.seconds)
        stop.set()
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    end = start + args.seconds
    window = [r for r in a_done if start <= r.start_s + r.latency_s <= end]
    return Run(list(b), window)


@contextlib.contextmanager
def _router(
    arm: Arm, engine_urls: Sequence[str], args: argparse.Namespace, room_s: float | None = None
) -> Iterator[tuple[str, tuple[str | None, str | None]]]:
    """The arm's router on the engines: its URL and the keys A and B send (kvgate: a tenant
    each; a peer has no tenants, so none). `room_s`: kvgate's flow_max_pending_prefill_s."""
    if arm.kind in ("kvgate", "noflow"):
        env = {
            "KVGATE_FLOW_CONTROL": "true" if arm.kind == "kvgate" else "false",
            "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(
                DEFAULT_PREFILL_TOKENS_PER_S * args.time_scale
            ),
        }
        if room_s is not None:
            env["KVGATE_FLOW_MAX_PENDING_PREFILL_S"] = f"{room_s:g}"
        serve = ["--tenant", f"a:{KEY_A}", "--tenant", f"b:{KEY_B}", "--log-level", "warning"]
        serve += ["--policy", arm.policy]
        with processes.gateway(engine_urls, serve, env=env) as gw:
            yield gw.url, (KEY_A, KEY_B)
        return
    with start_router(arm, engine_urls, directory_capacity_blocks=1) as router:
        yield router.targets[0], (None, None)


def _run(
    args: argparse.Namespace, arm: Arm, light: bool, flood: bool, room_s: float | None = None
) -> Run:
    engine_args = ["--time-scale", str(args.time_scale), "--max-batch", "256"]
    with (
        processes.engines(args.engines, engine_args) as engines,
        _router(arm, [e.url for e in engines], args, room_s) as (url, keys),
    ):
        return asyncio.run(_traffic(url, args, light, flood, keys))


@dataclass
class Verdict:
    """One arm's noisy neighbour against the issue's goal."""

    b_solo: list[float]
    b_flood: list[float]
    """B's TTFTs (engine time), alone and under A's flood."""
    a_solo: int
    a_flood: int
    failed: int
    server_errors: int
    a_prefill_s: float
    """One of A's prefills (its mean prompt over the engines' prefill rate)."""
    b_share: float = 0.0
    """B's prefill under the flood as a share of the engines' prefill time in the window: A
    can complete at most 1 - this of what it completes on engines it keeps busy alone (the
    engines prefill one request at a time, B's requests are served, every prompt is
    distinct)."""

    @property
    def a_ceiling(self) -> float:
        return 1.0 - self.b_share

    @property
    def bound_s(self) -> float:
        return 1.5 * percentile(self.b_solo, 0.99) + self.a_prefill_s

    def problems(self) -> list[str]:
        out = []
        if not self.b_solo or not self.b_flood:
            return ["B had no answered request"]
        p99 = percentile(self.b_flood, 0.99)
        if p99 > self.bound_s:
            out.append(f"B's p99 {p99:.2f} s > {self.bound_s:.2f} s")
        if self.a_flood < 0.9 * self.a_solo:
            out.append(
                f"A {self.a_flood} < 90% of {self.a_solo} (its ceiling with B served: "
                f"{self.a_ceiling:.0%})"
            )
        if self.failed:
            out.append(f"{self.failed} failed")
        if self.server_errors:
            out.append(f"{self.server_errors} 5xx")
        return out


def _verdict(runs: dict[str, Run], args: argparse.Namespace) -> Verdict:
    scale = args.time_scale
    solo, a_alone, flood = runs["B alone"], runs["A alone"], runs["flood"]
    b_prefill_s = sum(r.prompt_tokens for r in flood.b if r.ok) / DEFAULT_PREFILL_TOKENS_PER_S
    engine_s = args.engines * args.seconds * scale
    a_prompts = [r.prompt_tokens for r in a_alone.a + flood.a if r.ok and r.prompt_tokens]
    a_tokens = sum(a_prompts) / len(a_prompts) if a_prompts else 0.0
    return Verdict(
        b_solo=[r.ttft_s * scale for r in solo.b if r.ok],
        b_flood=[r.ttft_s * scale for r in flood.b if r.ok],
        a_solo=sum(1 for r in a_alone.a if r.ok),
        a_flood=sum(1 for r in flood.a if r.ok),
        failed=sum(run.failures() for run in runs.values()),
        server_errors=sum(run.server_errors() for run in runs.values()),
        a_prefill_s=a_tokens / DEFAULT_PREFILL_TOKENS_PER_S,
        b_share=b_prefill_s / engine_s if engine_s > 0 else 0.0,
    )


WEIGHTS = (1, 2, 4)


def _samples(metrics_url: str, family: str, suffix: str) -> Iterator[Sample]:
    """The samples of one metric family whose name ends in `suffix` (the gateway's admin
    port)."""
    text = httpx.get(metrics_url + "/metrics", timeout=10.0).text
    for found in text_string_to_metric_families(text):
        if found.name == family:
            yield from (s for s in found.samples if s.name.endswith(suffix))


def _queued_dispatches(metrics_url: str) -> dict[str, float]:
    """Requests each tenant had dispatched from the queue so far."""
    out: dict[str, float] = {}
    for sample in _samples(metrics_url, "kvgate_flow_queue_seconds", "_count"):
        tenant = sample.labels["tenant"]
        out[tenant] = out.get(tenant, 0.0) + sample.value
    return out


@dataclass
class Window:
    """One `--window-s` slice of the weights run: its bounds (seconds from the window's start)
    and what each tenant had dispatched from the queue and served in it."""

    start_s: float
    end_s: float
    dispatched: dict[str, float]
    served_tokens: dict[str, float]


def shares(values: Mapping[str, float]) -> dict[str, float]:
    total = sum(values.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in values.items()}


def worst_deviation(observed: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """The largest relative deviation of a tenant's share of `observed` from its weight's share
    (0.1: some tenant got 10% more or less than its weight says); 1.0 when nothing was
    observed."""
    got, due = shares(observed), shares(weights)
    if not sum(observed.values()):
        return 1.0
    return max(abs(got.get(k, 0.0) / d - 1.0) for k, d in due.items() if d > 0)


async def _weighted_flood(
    url: str,
    metrics_url: str,
    args: argparse.Namespace,
    keys: dict[str, str],
    step_s: float | None = None,
) -> tuple[dict[str, list[Result]], dict[str, float], list[tuple[float, dict[str, float], float]]]:
    """Every tenant floods with its closed-loop clients; the requests that finished within the
    window (`--seconds`, after a warm-up as in the noisy run), by tenant, and the requests the
    fair queue dispatched within it (what the policy decides; completions trail them). With
    `step_s`, the dispatch counters are also read at every multiple of it within the run:
    (seconds from the start, each tenant's dispatches so far since the start, the start's
    monotonic time)."""
    timeout = aiohttp.ClientTimeout(total=600)
    stop = asyncio.Event()
    done: dict[str, list[Result]] = {name: [] for name in keys}
    per_tenant = max(args.a_clients // len(keys), 1)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:

        async def flooder(name: str, i: int) -> None:
            n = 0
            while not stop.is_set():  # bounded: the window ends
                text = f"{name}.{i}.{n} " + words(f"{name}{i}.{n}", args.a_words)
                done[name].append(
                    await stream_chat(http, url, keys[name], _body(text, args.max_tokens))
                )
                n += 1

        tasks = [asyncio.create_task(flooder(n, i)) for n in keys for i in range(per_tenant)]
        await asyncio.sleep(2.0 * args.a_words / DEFAULT_PREFILL_TOKENS_PER_S / args.time_scale)
        start = time.monotonic()
        before = await asyncio.to_thread(_queued_dispatches, metrics_url)
        marks: list[tuple[float, dict[str, float]]] = []
        step = step_s if step_s is not None and step_s > 0 else args.seconds
        k = 1
        while k * step < args.seconds - 1e-9:  # bounded: seconds / step_s marks
            await asyncio.sleep(max(start + k * step - time.monotonic(), 0.0))
            counts = await asyncio.to_thread(_queued_dispatches, metrics_url)
            marks.append((k * step, {n: counts.get(n, 0.0) - before.get(n, 0.0) for n in keys}))
            k += 1
        await asyncio.sleep(max(start + args.seconds - time.monotonic(), 0.0))
        after = await asyncio.to_thread(_queued_dispatches, metrics_url)
        marks.append((args.seconds, {n: after.get(n, 0.0) - before.get(n, 0.0) for n in keys}))
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = start + args.seconds
    finished = {
        name: [r for r in results if start <= r.start_s + r.latency_s <= end]
        for name, results in done.items()
    }
    dispatched = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in keys}
    return finished, dispatched, [(at, counts, start) for at, counts in marks]


def windows_of(
    results: Mapping[str, list[Result]],
    marks: Sequence[tuple[float, dict[str, float], float]],
    window_s: float,
) -> list[Window]:
    """Every window of `window_s` between two readings of the cumulative marks (seconds from
    the start, dispatches so far, the start's monotonic time; the start itself reads 0): its
    dispatches (the difference of its ends' marks) and the prompt tokens served in it
    (completions by when they finished). Readings every step give the windows sliding by that
    step: the issue's "over any 30 s" is the worst of them."""
    readings = [(0.0, {name: 0.0 for name in results})] + [(at, c) for at, c, _ in marks]
    start = marks[0][2] if marks else 0.0
    ends = {round(at, 6): counts for at, counts in readings}
    out: list[Window] = []
    for from_s, before in readings:
        after = ends.get(round(from_s + window_s, 6))
        if after is None:
            continue
        to_s = from_s + window_s
        served = {
            name: float(
                sum(
                    r.prompt_tokens
                    for r in rs
                    if r.ok and from_s < r.start_s + r.latency_s - start <= to_s
                )
            )
            for name, rs in results.items()
        }
        dispatched = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in results}
        out.append(Window(from_s, to_s, dispatched, served))
    return out


def _print_windows(
    windows: Sequence[Window], weights: Mapping[str, float], window_s: float
) -> None:
    """The consecutive windows' shares, then the worst of every window (sliding): the issue's
    goal is the share within 10% of the weight's over any `window_s`."""
    names = " / ".join(weights)
    print(
        f"\nper {window_s:g} s window: shares {names} of the queue's dispatches and of the "
        "prompt tokens served, and the largest deviation from a weight's share"
    )

    def line(win: Window) -> str:
        d = worst_deviation(win.dispatched, weights)
        sv = worst_deviation(win.served_tokens, weights)
        cells = [
            " / ".join(f"{v:.1%}" for v in shares(x).values())
            for x in (win.dispatched, win.served_tokens)
        ]
        return (
            f"{win.start_s:>4.0f}-{win.end_s:<4.0f} s  dispatched {cells[0]} ({d:.1%} off), "
            f"served {cells[1]} ({sv:.1%} off)"
        )

    for win in windows:
        if abs(win.start_s / window_s - round(win.start_s / window_s)) < 1e-6:
            print("  " + line(win))
    worst_d = max(windows, key=lambda w: worst_deviation(w.dispatched, weights))
    worst_s = max(windows, key=lambda w: worst_deviation(w.served_tokens, weights))
    print(
        f"worst of {len(windows)} windows of {window_s:g} s (sliding), goal within 10%:\n"
        f"  dispatched {worst_deviation(worst_d.dispatched, weights):.1%} off: {line(worst_d)}\n"
        f"  served {worst_deviation(worst_s.served_tokens, weights):.1%} off: {line(worst_s)}"
    )


def run_weights(args: argparse.Namespace) -> int:
    steps = args.window_s / args.window_step_s if args.window_step_s > 0 else 0.0
    if args.window_s <= 0 or steps < 1 or abs(steps - round(steps)) > 1e-6:
        print(
            f"kvgate bench-fairness: --window-s {args.window_s:g} must be a positive multiple "
            f"of --window-step-s {args.window_step_s:g}"
        )
        return 2
    keys = {f"w{w}": f"sk-bench-weight-{w}" for w in WEIGHTS}
    lines = ["version: 1", "tenants:"]
    for w in WEIGHTS:
        digest = hashlib.sha256(keys[f"w{w}"].encode()).hexdigest()
        lines += [f"  w{w}:", f"    weight: {w}", "    keys:", f"      - sha256: {digest}"]
    env = {
        "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(DEFAULT_PREFILL_TOKENS_PER_S * args.time_scale)
    }
    engine_args = ["--time-scale", str(args.time_scale), "--max-batch", "256"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.yaml"
        path.write_text("\n".join(lines) + "\n")
        serve = ["--tenants-file", str(path), "--log-level", "warning"]
        with (
            processes.engines(args.engines, engine_args) as engines,
            processes.gateway([e.url for e in engines], serve, env=env) as gw,
        ):
            assert gw.metrics_url is not None
            results, dispatched, marks = asyncio.run(
                _weighted_flood(gw.url, gw.metrics_url, args, keys, args.window_step_s)
            )
    served = {name: sum(r.prompt_tokens for r in rs if r.ok) for name, rs in results.items()}
    total = sum(served.values()) or 1
    total_dispatched = sum(dispatched.values()) or 1
    print(
        f"three tenants weighted {':'.join(map(str, WEIGHTS))}, {max(args.a_clients // 3, 1)} "
        f"closed-loop clients each of {args.a_words:,} words, {args.seconds:g} s window, "
        f"{args.engines} engines, flow control on"
    )
    print(
        f"\n{'tenant':<8} {'weight share':>12} {'dispatched share':>16} {'served share':>12} "
        f"{'requests':>8} {'failed':>6}"
    )
    errors = 0
    for w in WEIGHTS:
        name = f"w{w}"
        failed = sum(1 for r in results[name] if not r.ok)
        errors += sum(1 for r in results[name] if r.status >= 500)
        print(
            f"{name:<8} {w / sum(WEIGHTS):>12.1%} {dispatched[name] / total_dispatched:>16.1%} "
            f"{served[name] / total:>12.1%} "
            f"{len(results[name]):>8} {failed:>6}"
        )
    weights = {f"w{w}": float(w) for w in WEIGHTS}
    windows = windows_of(results, marks, args.window_s)
    if windows:
        _print_windows(windows, weights, args.window_s)
    return 1 if errors else 0


BANDS_FLOOR = 0.05
"""The default `flow_floor_share`: the low band's floor with two bands backlogged is
floor / (1 + floor), 4.8% of the dispatches."""


def _tenants_file(path: Path, tenants: dict[str, tuple[str, int]]) -> None:
    """name -> (key, priority), weight 1 each."""
    lines = ["version: 1", "tenants:"]
    for name, (key, priority) in tenants.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines += [
            f"  {name}:",
            f"    priority: {priority}",
            "    keys:",
            f"      - sha256: {digest}",
        ]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class BandsRun:
    """One bands run (fresh processes): B alone and under A's low-band flood, then what each
    band had dispatched from the queue while both flooded."""

    alone: Run
    flood: Run
    dispatched: dict[str, float]


def _bands_once(
    args: argparse.Namespace, room_s: float | None, share: float | None = None
) -> BandsRun:
    """B (band 0, light) alone and under A's flood (band 5), then `hi` (band 0) and `lo` (band
    5) both flooding, on one gateway with flow control on (`room_s`: its
    flow_max_pending_prefill_s, `share`: its flow_lower_band_room_share; None: the default)."""
    scale = args.time_scale
    env = {"KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(DEFAULT_PREFILL_TOKENS_PER_S * scale)}
    if room_s is not None:
        env["KVGATE_FLOW_MAX_PENDING_PREFILL_S"] = f"{room_s:g}"
    if share is not None:
        env["KVGATE_FLOW_LOWER_BAND_ROOM_SHARE"] = f"{share:g}"
    engine_args = ["--time-scale", str(scale), "--max-batch", "256"]
    flood_keys = {"hi": "sk-bench-band-hi", "lo": "sk-bench-band-lo"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.yaml"
        _tenants_file(
            path,
            {
                "a": (KEY_A, 5),
                "b": (KEY_B, 0),
                "hi": (flood_keys["hi"], 0),
                "lo": (flood_keys["lo"], 5),
            },
        )
        serve = ["--tenants-file", str(path), "--log-level", "warning"]
        with (
            processes.engines(args.engines, engine_args) as engines,
            processes.gateway([e.url for e in engines], serve, env=env) as gw,
        ):
            assert gw.metrics_url is not None
            alone = asyncio.run(_traffic(gw.url, args, light=True, flood=False))
            flood = asyncio.run(_traffic(gw.url, args, light=True, flood=True))
            _, dispatched, _ = asyncio.run(
                _weighted_flood(gw.url, gw.metrics_url, args, flood_keys)
            )
    return BandsRun(alone, flood, dispatched)


def _bound_s(alone: Run, flood: Run, scale: float) -> float:
    """The noisy neighbour's bound for B (engine time): 1.5 × its solo p99 plus one of A's
    prefills (A's mean prompt at the engines' rate)."""
    solo = [r.ttft_s * scale for r in alone.b if r.ok]
    a_prompts = [r.prompt_tokens for r in flood.a if r.ok and r.prompt_tokens]
    if not solo or not a_prompts:
        return math.nan
    a_prefill_s = sum(a_prompts) / len(a_prompts) / DEFAULT_PREFILL_TOKENS_PER_S
    return 1.5 * percentile(solo, 0.99) + a_prefill_s


def run_bands(args: argparse.Namespace) -> int:
    """The bands scenario once per `--room-bounds` value and `--lower-band-room-shares` value
    (or once at the defaults): B's TTFT alone and under the low band's flood against the noisy
    neighbour's bound, A's completions, and the low band's share of the dispatches against its
    floor."""
    bounds = _room_bounds(args)
    if bounds is None:
        return 2
    try:
        room_shares = [float(v) for v in args.lower_band_room_shares.split(",") if v.strip()]
    except ValueError:
        room_shares = [math.nan]
    if not all(0 < v <= 1 for v in room_shares):
        print(
            f"kvgate bench-fairness: --lower-band-room-shares {args.lower_band_room_shares!r}: "
            "shares above 0 and at most 1, comma-separated"
        )
        return 2
    scale = args.time_scale
    print(
        f"engines: {args.engines} simulated at {DEFAULT_PREFILL_TOKENS_PER_S:,.0f} prefill "
        f"tokens/s, time scale {scale:g}; B (band 0): {args.b_words:,} words every "
        f"{args.b_interval_s:g} s for {args.seconds:g} s; A (band 5): {args.a_clients} "
        f"closed-loop clients of {args.a_words:,} words; flow control on"
    )
    errors = 0
    floor = BANDS_FLOOR / (1 + BANDS_FLOOR)
    runs = [
        (room_s, share)
        for room_s in ([*bounds] if bounds else [None])
        for share in ([*room_shares] if room_shares else [None])
    ]
    for room_s, share in runs:
        run = _bands_once(args, room_s, share)
        room = "the default room bound" if room_s is None else f"room bound {room_s:g} s"
        room += (
            ", the default lower band's room share"
            if share is None
            else f", lower band's room share {share:g}"
        )
        print(
            f"\n{room}:\n{'run':<24} {'B TTFT p50 s':>12} {'B TTFT p99 s':>12} {'B done':>7} "
            f"{'A done':>7} {'failed':>6} {'5xx':>4}"
        )
        for name, part in (
            ("B alone (band 0)", run.alone),
            ("B under A's band-5 flood", run.flood),
        ):
            ttfts = [r.ttft_s * scale for r in part.b if r.ok]
            errors += part.server_errors()
            print(
                f"{name:<24} {percentile(ttfts, 0.5):>12.2f} {percentile(ttfts, 0.99):>12.2f} "
                f"{len(ttfts):>7} {sum(1 for r in part.a if r.ok):>7} {part.failures():>6} "
                f"{part.server_errors():>4}"
            )
        b_p99 = percentile([r.ttft_s * scale for r in run.flood.b if r.ok] or [math.inf], 0.99)
        bound_s = _bound_s(run.alone, run.flood, scale)
        print(
            f"B's p99 under the flood {b_p99:.2f} s against its bound (1.5 × its solo p99 + one "
            f"of A's prefills) {bound_s:.2f} s: {'met' if b_p99 <= bound_s else 'missed'}"
        )
        total = sum(run.dispatched.values()) or 1
        hi, lo = run.dispatched["hi"], run.dispatched["lo"]
        print(
            f"both bands flooding ({max(args.a_clients // 2, 1)} clients each, "
            f"{args.seconds:g} s): dispatched from the queue: band 0 {hi:.0f} "
            f"({hi / total:.1%}), band 5 {lo:.0f} ({lo / total:.1%}; its floor {floor:.1%})"
        )
    return 1 if errors else 0


async def _conversations(url: str, args: argparse.Namespace) -> tuple[list[Result], list[Result]]:
    """B's conversations beside A's flood: B's turns after each conversation's first and A's
    requests, both finished within the window (after the flood's warm-up)."""
    timeout = aiohttp.ClientTimeout(total=600)
    stop = asyncio.Event()
    a_done: list[Result] = []
    b_done: list[Result] = []
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:

        async def flooder(i: int) -> None:
            n = 0
            while not stop.is_set():  # bounded: the window ends
                text = f"A{i}.{n} " + words(f"flood{i}.{n}", args.a_words)
                a_done.append(await stream_chat(http, url, KEY_A, _body(text, args.max_tokens)))
                n += 1

        async def conversation(i: int) -> None:
            text = f"Conversation {i}. " + words(f"history{i}", args.history_words)
            n = 0
            while not stop.is_set():  # bounded: the window ends
                text += f"\nTurn {n}: " + words(f"c{i}.t{n}", args.turn_words)
                result = await stream_chat(http, url, KEY_B, _body(text, args.max_tokens))
                if n:  # the first turn is cold wherever it goes
                    b_done.append(result)
                n += 1

        tasks = [asyncio.create_task(flooder(i)) for i in range(args.a_clients)]
        tasks += [asyncio.create_task(conversation(i)) for i in range(args.sessions)]
        await asyncio.sleep(2.0 * args.a_words / DEFAULT_PREFILL_TOKENS_PER_S / args.time_scale)
        start = time.monotonic()
        await asyncio.sleep(args.seconds)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = start + args.seconds

    def window(results: list[Result]) -> list[Result]:
        return [r for r in results if start <= r.start_s + r.latency_s <= end]

    return window(b_done), window(a_done)


def _affinity_outcomes(metrics_url: str) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for s in _samples(metrics_url, "kvgate_flow_affinity", "_total")
    }


def run_affinity(args: argparse.Namespace) -> int:
    """B's conversations beside A's flood at each affinity wait (fresh processes each)."""
    try:
        waits = [float(w) for w in args.affinity_waits.split(",") if w.strip()]
    except ValueError:
        print(f"kvgate bench-fairness: --affinity-waits {args.affinity_waits!r}: not numbers")
        return 2
    scale = args.time_scale
    print(
        f"engines: {args.engines} simulated at {DEFAULT_PREFILL_TOKENS_PER_S:,.0f} prefill "
        f"tokens/s, time scale {scale:g}; B: {args.sessions} closed-loop conversations of "
        f"{args.history_words:,} words of history + {args.turn_words} a turn; A: "
        f"{args.a_clients} closed-loop clients of {args.a_words:,} distinct words; "
        f"{args.seconds:g} s window; flow control on"
    )
    print(
        f"\n{'wait ms':>7} {'B turns':>7} {'B hit ratio':>11} {'B TTFT p50 s':>12} "
        f"{'B TTFT p99 s':>12} {'A done':>6} {'failed':>6} {'5xx':>4}  affinity outcomes"
    )
    errors = 0
    engine_args = ["--time-scale", str(scale), "--max-batch", "256"]
    serve = ["--tenant", f"a:{KEY_A}", "--tenant", f"b:{KEY_B}", "--log-level", "warning"]
    for wait in waits:
        env = {
            "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(DEFAULT_PREFILL_TOKENS_PER_S * scale),
            "KVGATE_FLOW_AFFINITY_WAIT_MS": f"{wait:g}",
        }
        with (
            processes.engines(args.engines, engine_args) as engines,
            processes.gateway([e.url for e in engines], serve, env=env) as gw,
        ):
            assert gw.metrics_url is not None
            b, a = asyncio.run(_conversations(gw.url, args))
            outcomes = _affinity_outcomes(gw.metrics_url)
        ok = [r for r in b if r.ok]
        prompt = sum(r.prompt_tokens for r in ok) or 1
        hit = sum(r.engine_cached_tokens for r in ok) / prompt
        ttfts = [r.ttft_s * scale for r in ok]
        failed = sum(1 for r in a + b if not r.ok)
        server = sum(1 for r in a + b if r.status >= 500)
        errors += server
        p50 = percentile(ttfts, 0.5) if ttfts else float("nan")
        p99 = percentile(ttfts, 0.99) if ttfts else float("nan")
        shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items()))
        print(
            f"{wait:>7g} {len(ok):>7} {hit:>11.3f} {p50:>12.2f} {p99:>12.2f} "
            f"{sum(1 for r in a if r.ok):>6} {failed:>6} {server:>4}  {shown}"
        )
    return 1 if errors else 0


def run_bench_fairness(args: argparse.Namespace) -> int:
    if args.scenario == "affinity":
        return run_affinity(args)
    if args.scenario == "weights":
        return run_weights(args)
    if args.scenario == "bands":
        return run_bands(args)
    return run_noisy(args)


def _room_bounds(args: argparse.Namespace) -> list[float] | None:
    """`--room-bounds` as numbers (empty: the gateway's default); None, said, when not."""
    try:
        bounds = [float(b) for b in args.room_bounds.split(",") if b.strip()]
    except ValueError:
        print(f"kvgate bench-fairness: --room-bounds {args.room_bounds!r}: not numbers")
        return None
    if any(b <= 0 for b in bounds):
        print(f"kvgate bench-fairness: --room-bounds {args.room_bounds!r}: must be positive")
        return None
    return bounds


def _variants(arms: Sequence[Arm], bounds: Sequence[float]) -> list[tuple[str, Arm, float | None]]:
    """The noisy neighbour's runs: each arm, a kvgate arm once per room bound (a bound given
    twice runs twice, each its own row: alternated, to see the spread)."""
    repeated = len(set(bounds)) < len(bounds)
    variants: list[tuple[str, Arm, float | None]] = []
    for arm in arms:
        if arm.kind == "kvgate" and bounds:
            variants += [
                (f"{arm.name} room {b:g}s" + (f" #{k + 1}" if repeated else ""), arm, b)
                for k, b in enumerate(bounds)
            ]
        else:
            variants.append((arm.name, arm, None))
    return variants


def run_noisy(args: argparse.Namespace) -> int:
    """The noisy neighbour on each arm: B alone, A alone, B under A's flood."""
    scale = args.time_scale
    try:
        arms = parse_arms(args.arms)
    except ValueError as exc:
        print(f"kvgate bench-fairness: {exc}")
        return 2
    for arm in arms:
        if arm.kind not in ("kvgate", "noflow", "sglang", "vllm") or arm.gateways != 1:
            print(f"kvgate bench-fairness: arm {arm.name!r}: use kvgate, noflow, sglang or vllm")
            return 2
    bounds = _room_bounds(args)
    if bounds is None:
        return 2
    variants = _variants(arms, bounds)
    print(
        f"engines: {args.engines} simulated at {DEFAULT_PREFILL_TOKENS_PER_S:,.0f} prefill "
        f"tokens/s, time scale {scale:g}; B: {args.b_words:,} words every "
        f"{args.b_interval_s:g} s for {args.seconds:g} s; A: {args.a_clients} closed-loop "
        f"clients of {args.a_words:,} words; all prompts distinct"
    )
    verdicts: dict[str, Verdict] = {}
    for name, arm, room_s in variants:
        missing = peer_missing(arm)
        if missing:
            print(f"{name}: skipped, {missing}")
            continue
        runs = {
            "B alone": _run(args, arm, light=True, flood=False, room_s=room_s),
            "A alone": _run(args, arm, light=False, flood=True, room_s=room_s),
            "flood": _run(args, arm, light=True, flood=True, room_s=room_s),
        }
        verdicts[name] = _verdict(runs, args)
    width = max((len(n) for n in verdicts), default=3) + 1
    print(
        f"\n{'arm':<{width}} {'B solo p50/p99 s':>16} {'B flood p50/p99 s':>17} {'A solo':>6} "
        f"{'A flood':>7} {'failed':>6} {'5xx':>4}  goal"
    )
    errors = 0
    for name, v in verdicts.items():
        errors += v.server_errors
        cells = []
        for ttfts in (v.b_solo, v.b_flood):
            cells.append(
                f"{percentile(ttfts, 0.5):.2f} / {percentile(ttfts, 0.99):.2f}" if ttfts else "-"
            )
        problems = v.problems()
        goal = "met" if not problems else "missed: " + "; ".join(problems)
        print(
            f"{name:<{width}} {cells[0]:>16} {cells[1]:>17} {v.a_solo:>6} {v.a_flood:>7} "
            f"{v.failed:>6} {v.server_errors:>4}  {goal} (bound {v.bound_s:.2f} s)"
        )
    return 1 if errors else 0
