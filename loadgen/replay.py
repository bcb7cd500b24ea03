"""`kvgate replay`: a trace, open loop, through any OpenAI-compatible URL, measured.

Open loop: request i is sent at start + arrival_i / time_scale whatever happened to the ones
before it (a router that falls behind sees its queue grow, as in production), unless
`max_concurrency` requests are already in flight, in which case it waits for a slot and the
wait is recorded (`client_wait_s`). Every request streams (`stream_options.include_usage`);
TTFT is measured from the send to the first SSE data event, end-to-end to the last byte, and
`cached_tokens` comes from the response's usage (kvgate's `engine_cached_tokens` when present,
else `prompt_tokens_details.cached_tokens`). The same replay works against kvgate, another
router, or one engine directly.

`time_scale` K means K times faster than the trace: arrival gaps are divided by K (engines run
K times faster too, when started with `--time-scale K`), and the summary reports TTFT both as
measured and in trace seconds (× K).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.client import Result, stream_chat
from loadgen.runner import run_phases
from loadgen.sim import percentile
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import Trace, read_trace
from loadgen.traces.synthesis import PromptSynthesizer
from loadgen.workloads import Phase, agent_day, agent_session

DEFAULT_MODEL = "kvgate-sim-8b"
DEFAULT_MAX_CONCURRENCY = 512
"""In-flight requests at most: far above what the trace needs at moderate load (Little's law:
~3.4 req/s × ~10 s ≈ 35 for the conversation trace at real time), so the loop stays open."""
DEFAULT_OVERLOAD_RETRIES = 2
"""The openai and anthropic SDKs' `max_retries`: a client told "retry later" does."""
DEFAULT_TIMEOUT_S = 900.0
"""Per request: a long prompt behind a long queue on a slow engine can take minutes."""


@dataclass
class Row:
    index: int
    arrival_s: float
    """In trace seconds, relative to the first request replayed."""
    sent_s: float
    """Wall seconds since the replay started."""
    client_wait_s: float
    ok: bool
    status: int
    ttft_s: float
    e2e_s: float
    input_tokens: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    tenant: str | None
    error: str = ""
    label: str = ""
    target: str = ""
    """The base URL the request was sent to."""
    retries: int = 0
    """Answers of "retry later" (429, 503, 529) retried, as the SDKs do (`overload_retries`)."""


@dataclass
class ReplaySummary:
    requests: int
    errors: int
    input_tokens: int
    cached_tokens: int
    hit_ratio: float
    """Cached tokens / input tokens (the engine's prompt_tokens) over the successful requests."""
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    time_scale: float
    ttft_mean_trace_s: float
    ttft_p50_trace_s: float
    ttft_p99_trace_s: float
    wall_s: float
    max_client_wait_s: float


def summarise(rows: Sequence[Row], time_scale: float, wall_s: float) -> ReplaySummary:
    ok = [r for r in rows if r.ok]
    prompt = sum(r.prompt_tokens or r.input_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    mean = statistics.fmean(ttfts) if ttfts else 0.0
    p50, p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    return ReplaySummary(
        requests=len(rows),
        errors=len(rows) - len(ok),
        input_tokens=prompt,
        cached_tokens=cached,
        hit_ratio=cached / prompt if prompt else 0.0,
        ttft_mean_s=mean,
        ttft_p50_s=p50,
        ttft_p99_s=p99,
        e2e_mean_s=statistics.fmean(e2es) if e2es else 0.0,
        e2e_p99_s=percentile(e2es, 0.99),
        time_scale=time_scale,
        ttft_mean_trace_s=mean * time_scale,
        ttft_p50_trace_s=p50 * time_scale,
        ttft_p99_trace_s=p99 * time_scale,
        wall_s=wall_s,
        max_client_wait_s=max((r.client_wait_s for r in rows), default=0.0),
    )


@dataclass(frozen=True)
class ReplayOptions:
    target: str | tuple[str, ...]
    """One base URL, or several: the client then spreads requests over them round robin (the
    baseline with no router at all)."""
    api_keys: tuple[str, ...] = ()
    """One key for every request, or one per tenant (tenant-i uses key i mod len)."""
    time_scale: float = 1.0
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    model: str = DEFAULT_MODEL
    max_output_tokens: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    progress: bool = True
    label: str = "replay"
    rotation: Callable[[], Sequence[str]] | None = None
    """When given, read as each request is sent: the targets in rotation at that moment (a
    Service's ready endpoints, as the bench restarts a gateway); else `targets`."""
    in_flight: dict[str, int] | None = None
    """When given, kept current: the requests sent to each target and not yet finished (the
    bench waits for a gateway's to reach 0 once it is out of rotation, before stopping it)."""
    overload_retries: int = DEFAULT_OVERLOAD_RETRIES
    """A 429 / 503 / 529 is retried this many times after its Retry-After, as the openai and
    anthropic SDKs do (`loadgen.client.stream_chat`); 0: a refusal is an error at once."""

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if not self.targets:
            raise ValueError("give at least one target URL")
        for url in self.targets:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"target {url!r} must start with http:// or https://")

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,) if isinstance(self.target, str) else tuple(self.target)


def _key_for(tenant: str | None, keys: Sequence[str]) -> str | None:
    if not keys:
        return None
    if tenant is None or len(keys) == 1:
        return keys[0]
    return keys[int(tenant.rsplit("-", 1)[-1]) % len(keys)]


async def replay(trace: Trace, options: ReplayOptions) -> tuple[list[Row], float]:
    """Send every request of `trace` at its scaled arrival time; return the rows (in trace
    order) and the wall time of the whole replay."""
    synth = PromptSynthesizer(trace.block_size)
    rows: list[Row | None] = [None] * len(trace.requests)
    slots = asyncio.Semaphore(options.max_concurrency)
    connector = aiohttp.TCPConnector(limit=options.max_concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    progress = _Progress(len(trace.requests), options.label, options.progress)
    loop = asyncio.get_running_loop()
    targets = options.targets

    async def one(i: int, body: dict[str, Any], due: float, start: float) -> None:
        req = trace.requests[i]
        async with slots:
            sent = loop.time()
            now = options.rotation() if options.rotation is not None else targets
            target = now[i % len(now)]
            counts = options.in_flight
            if counts is not None:
                counts[target] = counts.get(target, 0) + 1
            try:
                result = await stream_chat(
                    http,
                    target,
                    _key_for(req.tenant, options.api_keys),
                    body,
                    str(i),
                    overload_retries=options.overload_retries,
                )
            finally:
                if counts is not None:
                    counts[target] -= 1
        rows[i] = Row(
            index=i,
            arrival_s=req.arrival_s,
            sent_s=sent - start,
            client_wait_s=max(sent - due, 0.0),
            ok=result.ok,
            status=result.status,
            ttft_s=result.ttft_s,
            e2e_s=result.latency_s,
            input_tokens=req.input_length,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.engine_cached_tokens,
            output_tokens=result.completion_tokens,
            tenant=req.tenant,
            error=result.error,
            target=target,
            retries=result.retries,
        )
        progress.advance(result.ok)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        tasks: list[asyncio.Task[None]] = []
        start = loop.time()
        with progress:
            for req in trace.requests:
                body: dict[str, Any] = {"model": options.model, "messages": synth.messages(req)}
                output = req.output_length
                if options.max_output_tokens is not None:
                    output = min(output, options.max_output_tokens)
                body["max_tokens"] = max(output, 1)
                due = start + req.arrival_s / options.time_scale
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req.index, body, due, start)))
            await asyncio.gather(*tasks)
        wall = loop.time() - start
    done = [r for r in rows if r is not None]
    assert len(done) == len(rows), "every request has a row"
    return done, wall


class _Progress:
    """A rich progress bar (requests done, errors), or nothing when disabled."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.enabled = enabled and total > 0
        self.errors = 0
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("errors {task.fields[errors]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._progress.add_task(label, total=total, errors=0)

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._progress.stop()

    def advance(self, ok: bool) -> None:
        self.errors += not ok
        if self.enabled:
            self._progress.update(self._task, advance=1, errors=self.errors)


# -- reports --------------------------------------------------------------------------------
def write_results(
    out_dir: Path,
    rows: Sequence[Row],
    summary: ReplaySummary,
    meta: dict[str, Any],
    plot: bool = False,
) -> list[Path]:
    """results.json (rows + summary), summary.md, and with `plot` two PNGs."""
    import orjson

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "summary.md"]
    payload = {"meta": meta, "summary": asdict(summary), "rows": [asdict(r) for r in rows]}
    written[0].write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    written[1].write_text(markdown_summary(summary, meta))
    if plot:
        written += plot_results(out_dir, rows, summary)
    return written


def markdown_summary(summary: ReplaySummary, meta: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"# Replay of {meta.get('trace', '?')} through {meta.get('target', '?')}",
        "",
        f"`{meta.get('command', '')}`",
        "",
        "| requests | errors | hit ratio | TTFT mean s | TTFT p50 s | TTFT p99 s | "
        "e2e mean s | time scale | TTFT mean (trace s) | TTFT p99 (trace s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {s.requests} | {s.errors} | {s.hit_ratio:.1%} | {s.ttft_mean_s:.3f} | "
        f"{s.ttft_p50_s:.3f} | {s.ttft_p99_s:.3f} | {s.e2e_mean_s:.3f} | {s.time_scale:g} | "
        f"{s.ttft_mean_trace_s:.3f} | {s.ttft_p99_trace_s:.3f} |",
        "",
        f"{s.input_tokens:,} input tokens, {s.cached_tokens:,} cached; wall {s.wall_s:.1f} s; "
        f"longest client-side wait for a concurrency slot {s.max_client_wait_s:.3f} s.",
        "",
    ]
    return "\n".join(lines)


def plot_results(out_dir: Path, rows: Sequence[Row], summary: ReplaySummary) -> list[Path]:
    """ttft_cdf.png (TTFT in trace seconds) and hit_ratio.png (per minute of trace time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.ok]
    ttfts = sorted(r.ttft_s * summary.time_scale for r in ok)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], drawstyle="steps-post")
    ax.set_xlabel("TTFT (trace seconds)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF (p99 {summary.ttft_p99_trace_s:.2f} s)")
    ax.grid(True, alpha=0.3)
    cdf = out_dir / "ttft_cdf.png"
    fig.savefig(cdf, dpi=100, bbox_inches="tight")
    plt.close(fig)

    window_s = 60.0
    buckets: dict[int, list[int]] = {}
    for r in ok:
        b = buckets.setdefault(int(r.arrival_s // window_s), [0, 0])
        b[0] += r.cached_tokens
        b[1] += r.prompt_tokens or r.input_tokens
    xs = sorted(buckets)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [x * window_s / 60 for x in xs], [buckets[x][0] / max(buckets[x][1], 1) for x in xs], "o-"
    )
    ax.set_xlabel("trace time (minutes)")
    ax.set_ylabel("hit ratio (cached / input tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(f"hit ratio per minute (overall {summary.hit_ratio:.1%})")
    ax.grid(True, alpha=0.3)
    hit = out_dir / "hit_ratio.png"
    fig.savefig(hit, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [cdf, hit]


# -- the command ----------------------------------------------------------------------------
WORKLOADS = ("workload:agent-day", "workload:agent-session")


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        nargs="?",
        default=str(CONVERSATION_TRACE),
        help="a trace (Mooncake or Qwen-Bailian JSONL, agent session files merged at offsets: "
        "a.json@0,b.json@30, or agent-sessions[:sessions=N,concurrency=C,...]: many concurrent "
        "agent sessions as `kvgate sim` builds them), or a closed-loop workload: "
        + ", ".join(WORKLOADS)
        + "; default: the shipped Mooncake conversation trace",
    )
    parser.add_argument(
        "--target",
        required=True,
        action="append",
        help="base URL: kvgate, a router or an engine; repeat it for client-side round robin",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="bearer key; repeat it to give each tenant (--tenants) its own",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="K times faster than real")
    parser.add_argument("--limit", type=int, default=None, help="at most N requests")
    parser.add_argument("--start", type=int, default=0, help="first trace line (0-based)")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=DEFAULT_MAX_CONCURRENCY,
        help="requests in flight at most",
    )
    parser.add_argument("--out", default=None, help="directory for results.json and summary.md")
    parser.add_argument("--plot", action="store_true", help="also write PNG plots into --out")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name sent")
    parser.add_argument(
        "--block-size", type=int, default=None, help="tokens per hash id (default: the format's)"
    )
    parser.add_argument("--tenants", type=int, default=0, help="assign conversations to N tenants")
    parser.add_argument("--max-output-tokens", type=int, default=None, help="cap output lengths")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = parser.add_argument_group("workload:agent-session")
    group.add_argument("--session-steps", type=int, default=50, help="steps per agent session")
    group.add_argument("--gap-every", type=int, default=0, help="a long gap every N steps")
    group.add_argument("--gap-s", type=float, default=0.0, help="the gap, in trace seconds")
    group.add_argument("--fanout-every", type=int, default=0, help="subagents every N steps")
    group.add_argument("--fanout", type=int, default=0, help="subagents started in parallel")


def workload_rows(results: Sequence[Result], time_scale: float) -> list[Row]:
    """A closed-loop run's results as replay rows (arrival = when the client sent it)."""
    t0 = min((r.start_s for r in results), default=0.0)
    return [
        Row(
            index=i,
            arrival_s=(r.start_s - t0) * time_scale,
            sent_s=r.start_s - t0,
            client_wait_s=0.0,
            ok=r.ok,
            status=r.status,
            ttft_s=r.ttft_s,
            e2e_s=r.latency_s,
            input_tokens=r.prompt_tokens,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.engine_cached_tokens,
            output_tokens=r.completion_tokens,
            tenant=None,
            error=r.error,
            label=r.label,
        )
        for i, r in enumerate(results)
    ]


def _workload_phases(args: argparse.Namespace) -> list[Phase]:
    if args.trace == "workload:agent-day":
        return agent_day()
    return agent_session(
        steps=args.session_steps,
        gap_every=args.gap_every,
        gap_s=args.gap_s,
        fanout_every=args.fanout_every,
        fanout=args.fanout,
    )


def run_replay_command(args: argparse.Namespace) -> int:
    from loadgen.console import report_console

    console = report_console()
    try:
        options = ReplayOptions(
            target=tuple(t.rstrip("/") for t in args.target),
            api_keys=tuple(args.api_key),
            time_scale=args.time_scale,
            max_concurrency=args.max_concurrency,
            model=args.model,
            max_output_tokens=args.max_output_tokens,
            progress=not args.no_progress,
        )
        if args.plot and not args.out:
            raise ValueError("--plot writes into --out DIR; pass --out")
        if args.trace.startswith("workload:"):
            if args.trace not in WORKLOADS:
                raise ValueError(f"unknown workload {args.trace!r}; choose {', '.join(WORKLOADS)}")
            if len(options.targets) != 1:
                raise ValueError("a closed-loop workload takes one --target")
            phases = _workload_phases(args)
        else:
            trace = read_trace(
                args.trace,
                block_size=args.block_size,
                start=args.start,
                limit=args.limit,
                num_tenants=args.tenants,
            )
    except (OSError, ValueError) as exc:
        console.print(f"[red]kvgate replay: {exc}[/]")
        return 2
    if args.trace.startswith("workload:"):
        started = time.monotonic()
        key = options.api_keys[0] if options.api_keys else None
        results = asyncio.run(
            run_phases(
                phases, options.targets[0], key, options.model, time_scale=options.time_scale
            )
        )
        rows, wall = workload_rows(results, options.time_scale), time.monotonic() - started
    else:
        rows, wall = asyncio.run(replay(trace, options))
    summary = summarise(rows, options.time_scale, wall)
    command = shlex.join(["kvgate", *getattr(args, "argv", [])])
    meta = {"trace": str(args.trace), "target": " ".join(options.targets), "command": command}
    console.print(markdown_summary(summary, meta))
    if args.out:
        for path in write_results(Path(args.out), rows, summary, meta, args.plot):
            console.print(f"wrote {path}")
    first_error = next((r.error for r in rows if not r.ok), "")
    if first_error:
        console.print(f"[red]{summary.errors} requests failed; the first: {first_error}[/]")
    return 1 if summary.errors else 0
