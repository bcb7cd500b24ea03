"""A discrete-event simulation of a fleet behind kvgate, in virtual time.

It runs the code the gateway runs — `router.registry.build_policy` decides, over a
`cachemap.memory.MemoryIndex` whose clock is the simulation's — in front of N engines driven by
the engine's own timing model (`loadgen.engine.timing.EngineCore`, `PrefixCache`). It works at the
trace's block granularity: block i of a request is its hash id i, and block hashes are the
chain of `cachemap.keys.chain_hashes` over the ids (8 bytes each), rooted at the tenant's scope,
so the directory and the engines key the same prefixes the way the gateway would.

The loop, per event in time order (engine events before an arrival at the same instant):

    arrival ──▶ index.lookup(hashes) ──▶ policy.decide(RouteRequest, replica snapshots)
            ──▶ replica.num_inflight += 1, pending_prefill_tokens += estimated uncached
            ──▶ engine.submit(job)
    first token ──▶ index.record(replica, hashes); pending_prefill_tokens -= estimate   (as the
                    gateway does when the first streamed event arrives)
    finished ──▶ replica.num_inflight -= 1

References computed in the same run, over the same requests in arrival order:
- ideal: one unlimited cache that sees every request (the single-cache ideal);
- lru_reference: one LRU cache with the whole fleet's capacity that sees every request — the
  best engines that evict LRU can do together.
A request's hit is its longest cached prefix of blocks, capped at its input length (the
Mooncake trace's accounting: the last block is usually partial).

Invariants (checked by the tests): for every request cached + uncached = input; the ideal hit
ratio bounds every policy's; the same seed gives the same result.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from cachemap.directory import DEFAULT_TTL_S
from cachemap.keys import BlockHash, affinity_key, chain_hashes, root_hash
from cachemap.memory import MemoryIndex
from cachemap.rates import PrefixRates
from loadgen.engine.kvpool import BlockPool
from loadgen.engine.timing import (
    DEFAULT_DECODE_S_PER_CONTEXT_TOKEN,
    DEFAULT_DECODE_S_PER_SEQ,
    DEFAULT_DECODE_S_PER_TOKEN,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_TOKENS_PER_S,
    FIRST_TOKEN,
    EngineCore,
    Job,
    PrefixCache,
    TimingModel,
    add_decode_arguments,
    decode_from_args,
    describe_decode,
)
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import (
    Trace,
    TraceRequest,
    hot_spine_trace,
    read_trace,
)
from router.filters import DEFAULT_DECODE_TOKEN_WEIGHT
from router.overflow import OverflowConfig
from router.plan import HotPrefix, plan
from router.registry import POLICIES, RouterConfig, build_policy
from router.types import Replica, RouteRequest

DEFAULT_NUM_REPLICAS = 8
DEFAULT_CAPACITY_FRAC = 0.25
"""KV capacity of the whole fleet as a share of the trace's unique blocks: a quarter makes
eviction matter (the issue's operating point)."""
DEFAULT_DIRECTORY_SCALE = 8.0
"""The directory holds 8x each engine's KV, as the gateway's default directory capacity is
sized (`cachemap.directory.DEFAULT_REPLICA_CAPACITY_BLOCKS`): at 10% capacity an engine-sized
directory forgot conversations their engine still held (97.7% of the shared LRU on the bench's
slice against 103% at 8x)."""
SIM_MODEL = "kvgate-sim-8b"
_ID_BYTES = 8
"""A hash id is packed as 8 little-endian bytes: one 'block' of cachemap's chain."""


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = DEFAULT_NUM_REPLICAS
    capacity_frac: float = DEFAULT_CAPACITY_FRAC
    timing: TimingModel = field(default_factory=TimingModel)
    router: RouterConfig = field(default_factory=RouterConfig)
    seed: int = 0
    max_output_tokens: int | None = None
    """Cap outputs (the bench caps them to keep replays short); None keeps the trace's."""
    directory_ttl_s: float = DEFAULT_TTL_S
    directory_scale: float = DEFAULT_DIRECTORY_SCALE
    overflow: bool = True
    """Spread hot prefixes as the gateway does (router.plan, cachemap.rates), with the
    threshold derived from the engines' prefill rate; `cache_aware` only."""
    overflow_threshold_per_min: float | None = None
    decode_token_weight: float = DEFAULT_DECODE_TOKEN_WEIGHT
    """The load bound's weight of a replica's outstanding output tokens, as the gateway's
    setting of the same name (each simulated request's output is known: its trace length)."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.directory_scale <= 0:
            raise ValueError(f"directory_scale must be positive, got {self.directory_scale}")
        if self.capacity_frac <= 0:
            raise ValueError(f"capacity_frac must be positive, got {self.capacity_frac}")


@dataclass
class RequestOutcome:
    index: int
    replica: str
    arrival_s: float
    input_tokens: int
    cached_tokens: int
    uncached_tokens: int
    ttft_s: float
    e2e_s: float
    reason: str


@dataclass
class PolicyResult:
    policy: str
    requests: int
    input_tokens: int
    cached_tokens: int
    hit_ratio: float
    share_of_ideal: float
    share_of_lru_reference: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    imbalance: float
    """max / mean over replicas of engine busy seconds (prefill + decode)."""
    prompt_imbalance: float
    """max / mean over replicas of the prompt tokens they were sent (how a spine spreads)."""
    prefill_utilization: float
    """Prefill busy seconds / (replicas × span): how loaded the prefill servers were."""
    decisions: dict[str, int]
    sim_wall_s: float = 0.0
    outcomes: list[RequestOutcome] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("outcomes")
        return out


@dataclass(frozen=True)
class References:
    input_tokens: int
    ideal_hit_ratio: float
    lru_reference_hit_ratio: float
    capacity_blocks_total: int
    capacity_blocks_per_replica: int
    unique_blocks: int


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the replay uses the same definition)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


@dataclass(frozen=True, slots=True)
class Keys:
    """A request's block hashes and consistent-hash affinity key, as the gateway makes them."""

    hashes: list[BlockHash]
    affinity: bytes


def request_keys(req: TraceRequest, consistent_hash_blocks: int, model: str = SIM_MODEL) -> Keys:
    """cachemap's chain over the request's hash ids, rooted at its tenant's scope."""
    root = root_hash((req.tenant or "").encode(), model)
    data = struct.pack(f"<{len(req.hash_ids)}Q", *req.hash_ids)
    hashes = chain_hashes(data, root, _ID_BYTES)
    return Keys(hashes, affinity_key(data, root, hashes, consistent_hash_blocks, _ID_BYTES))


def _cached_tokens(matched_blocks: int, req: TraceRequest, block_size: int) -> int:
    return min(matched_blocks * block_size, req.input_length)


def references(
    trace: Trace, keys: Sequence[Keys], capacity_frac: float, num_replicas: int
) -> References:
    """The single-cache ideal and the single shared LRU, over the requests in arrival order."""
    unique = trace.unique_blocks()
    per_replica = max(int(capacity_frac * unique / num_replicas), 1)
    seen: set[bytes] = set()
    lru = PrefixCache(per_replica * num_replicas)
    ideal_cached = lru_cached = total = 0
    for req, k in zip(trace.requests, keys, strict=True):
        hs = k.hashes
        total += req.input_length
        n = 0
        for h in hs:
            if h not in seen:
                break
            n += 1
        ideal_cached += _cached_tokens(n, req, trace.block_size)
        seen.update(hs)
        lru_cached += _cached_tokens(lru.match(hs), req, trace.block_size)
        lru.insert(hs)
    return References(
        input_tokens=total,
        ideal_hit_ratio=ideal_cached / total if total else 0.0,
        lru_reference_hit_ratio=lru_cached / total if total else 0.0,
        capacity_blocks_total=per_replica * num_replicas,
        capacity_blocks_per_replica=per_replica,
        unique_blocks=unique,
    )


class _Clock:
    """The simulation's virtual time, injected into the directory."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _ReplicaState:
    id: str
    core: EngineCore
    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    decode_tokens: float = 0.0

    def snapshot(self) -> Replica:
        return Replica(
            self.id,
            True,
            self.num_inflight,
            self.pending_prefill_tokens,
            decode_tokens=self.decode_tokens,
        )


def simulate(
    trace: Trace,
    policy: str,
    config: SimConfig,
    refs: References,
    keys: Sequence[Keys] | None = None,
) -> PolicyResult:
    """Replay `trace` through `policy` in virtual time; see the module docstring."""
    wall0 = time.perf_counter()
    profile = build_policy(policy, config.router)
    rng = random.Random(config.seed)
    clock = _Clock()
    per_replica = refs.capacity_blocks_per_replica
    index = MemoryIndex(
        capacity_blocks=max(int(per_replica * config.directory_scale), 1),
        ttl_s=config.directory_ttl_s,
        clock=clock,
    )
    replicas = [
        _ReplicaState(f"r{i}", EngineCore(config.timing, BlockPool(per_replica)))
        for i in range(config.num_replicas)
    ]
    by_id = {r.id: r for r in replicas}
    index_of = {r.id: i for i, r in enumerate(replicas)}
    rates = PrefixRates(clock=clock) if config.overflow and policy == "cache_aware" else None
    overflow = OverflowConfig(
        config.timing.prefill_tokens_per_s * config.timing.time_scale,
        fixed_threshold_per_min=config.overflow_threshold_per_min,
    )
    if keys is None:
        keys = [request_keys(r, config.router.consistent_hash_blocks) for r in trace.requests]
    block = trace.block_size
    outcomes: list[RequestOutcome | None] = [None] * len(trace.requests)
    estimates: dict[str, tuple[_ReplicaState, float, TraceRequest, str]] = {}
    outputs: dict[str, int] = {}
    decisions: dict[str, int] = {}

    # engine events come out of a heap keyed by each core's next event time
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        t = replicas[i].core.next_event_time()
        if t is not None:
            heapq.heappush(heap, (t, i))

    def drain(until: float) -> None:
        while heap and heap[0][0] <= until:
            t, i = heapq.heappop(heap)
            state = replicas[i]
            due = state.core.next_event_time()
            if due is None or due != t:
                continue  # a stale entry: the core's schedule moved
            clock.now = t
            for at, kind, job in state.core.advance(t):
                clock.now = at
                rep, estimate, req, reason = estimates[job.id]
                if kind == FIRST_TOKEN:
                    index.record(rep.id, keys[req.index].hashes)
                    rep.pending_prefill_tokens = max(rep.pending_prefill_tokens - estimate, 0.0)
                else:
                    rep.num_inflight -= 1
                    rep.decode_tokens = max(rep.decode_tokens - outputs.pop(job.id), 0.0)
                    assert job.first_token_s is not None and job.finish_s is not None
                    outcomes[req.index] = RequestOutcome(
                        req.index,
                        rep.id,
                        req.arrival_s,
                        req.input_length,
                        job.cached_tokens,
                        job.uncached_tokens,
                        job.first_token_s - req.arrival_s,
                        job.finish_s - req.arrival_s,
                        reason,
                    )
                    del estimates[job.id]
            push(i)

    for req in trace.requests:
        drain(req.arrival_s)
        clock.now = req.arrival_s
        hs = keys[req.index].hashes
        overlap = index.lookup(hs) if hs else {}
        route = RouteRequest(
            num_blocks=len(hs),
            num_prompt_tokens=float(req.input_length),
            overlap=overlap,
            tokens_per_block=float(block),
            affinity_key=keys[req.index].affinity,
            sequence=req.index,
            decode_token_weight=config.decode_token_weight,
        )
        snapshot = [r.snapshot() for r in replicas]
        depth = max(overlap.values(), default=0)
        hot = None
        if rates is not None and depth > 0:  # the gateway's hot-prefix step, the same code
            observed = rates.observe(hs[depth - 1])
            hot = HotPrefix(observed.rate_per_min, observed.k)
        planned = plan(profile, route, snapshot, rng, hot, overflow)
        if planned.k is not None:
            assert rates is not None
            rates.set_k(hs[depth - 1], planned.k)
        decision = planned.decision
        assert decision is not None, "every simulated replica is healthy"
        decisions[decision.reason] = decisions.get(decision.reason, 0) + 1
        rep = by_id[decision.replica]
        estimate = route.uncached_tokens(rep.id)
        rep.num_inflight += 1
        rep.pending_prefill_tokens += estimate
        output = req.output_length
        if config.max_output_tokens is not None:
            output = min(output, config.max_output_tokens)
        job = Job(
            id=str(req.index),
            block_hashes=hs,
            num_prompt_tokens=req.input_length,
            num_output_tokens=max(output, 1),
            block_size=block,
            max_cached_tokens=req.input_length,
        )
        estimates[job.id] = (rep, estimate, req, decision.reason)
        outputs[job.id] = job.num_output_tokens
        rep.decode_tokens += job.num_output_tokens
        rep.core.submit(req.arrival_s, job)
        push(index_of[rep.id])
    drain(float("inf"))
    assert not estimates, "every request finished"
    done = [o for o in outcomes if o is not None]
    return _result(policy, done, replicas, refs, trace, decisions, time.perf_counter() - wall0)


def _result(
    policy: str,
    outcomes: list[RequestOutcome],
    replicas: list[_ReplicaState],
    refs: References,
    trace: Trace,
    decisions: dict[str, int],
    wall_s: float,
) -> PolicyResult:
    total = sum(o.input_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    hit = cached / total if total else 0.0
    ttfts = [o.ttft_s for o in outcomes]
    busy = [r.core.counters.busy_prefill_s + r.core.counters.busy_decode_s for r in replicas]
    mean_busy = statistics.fmean(busy) if busy else 0.0
    prompts = [r.core.counters.prompt_tokens for r in replicas]
    mean_prompts = statistics.fmean(prompts) if prompts else 0.0
    span = max(trace.span_s, 1e-9)
    prefill = sum(r.core.counters.busy_prefill_s for r in replicas)
    return PolicyResult(
        policy=policy,
        requests=len(outcomes),
        input_tokens=total,
        cached_tokens=cached,
        hit_ratio=hit,
        share_of_ideal=hit / refs.ideal_hit_ratio if refs.ideal_hit_ratio else 0.0,
        share_of_lru_reference=(
            hit / refs.lru_reference_hit_ratio if refs.lru_reference_hit_ratio else 0.0
        ),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
        e2e_mean_s=statistics.fmean(o.e2e_s for o in outcomes) if outcomes else 0.0,
        imbalance=max(busy) / mean_busy if mean_busy else 1.0,
        prompt_imbalance=max(prompts) / mean_prompts if mean_prompts else 1.0,
        prefill_utilization=prefill / (len(replicas) * span),
        decisions=dict(sorted(decisions.items())),
        sim_wall_s=wall_s,
        outcomes=outcomes,
    )


def run_policies(
    trace: Trace, policies: Sequence[str], config: SimConfig
) -> tuple[References, list[PolicyResult]]:
    for name in policies:
        if name not in POLICIES:
            raise ValueError(
                f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}"
            )
    keys = [request_keys(r, config.router.consistent_hash_blocks) for r in trace.requests]
    refs = references(trace, keys, config.capacity_frac, config.num_replicas)
    return refs, [simulate(trace, p, config, refs, keys) for p in policies]


def timing_defaults() -> dict[str, float]:
    return {
        "prefill_tokens_per_s": DEFAULT_PREFILL_TOKENS_PER_S,
        "decode_s_per_token": DEFAULT_DECODE_S_PER_TOKEN,
        "decode_s_per_seq": DEFAULT_DECODE_S_PER_SEQ,
        "decode_s_per_context_token": DEFAULT_DECODE_S_PER_CONTEXT_TOKEN,
        "max_batch": DEFAULT_MAX_BATCH,
    }


# -- the command ----------------------------------------------------------------------------
def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        nargs="?",
        default=str(CONVERSATION_TRACE),
        help="a trace (Mooncake or Qwen-Bailian JSONL, agent session files: a.json@0,b.json@30), "
        "or hot-spine[:rate=60,seconds=30,system=4000,suffix=300,output=8] (requests sharing a "
        "system prompt, faster than one replica); default: the shipped Mooncake conversation "
        "trace",
    )
    parser.add_argument(
        "--replicas", type=int, default=DEFAULT_NUM_REPLICAS, help="simulated engine replicas"
    )
    parser.add_argument(
        "--capacity-frac",
        type=float,
        default=DEFAULT_CAPACITY_FRAC,
        help="fleet KV capacity as a share of the trace's unique blocks (split evenly)",
    )
    parser.add_argument(
        "--policy", default="all", help=f"one of {', '.join(POLICIES)}, or 'all' (default)"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="tokens per hash id (default: the format's)"
    )
    parser.add_argument("--start", type=int, default=0, help="first trace line (0-based)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many requests")
    parser.add_argument("--tenants", type=int, default=0, help="assign conversations to N tenants")
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help="simulated prefill speed",
    )
    add_decode_arguments(parser)
    parser.add_argument(
        "--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="requests decoded together"
    )
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="cap output lengths (default: the trace's)",
    )
    parser.add_argument(
        "--absolute-slack-tokens",
        type=float,
        default=None,
        help="cache_aware's absolute load slack (default: the gateway's)",
    )
    parser.add_argument(
        "--relative-slack",
        type=float,
        default=None,
        help="cache_aware's relative load slack (default: the gateway's)",
    )
    parser.add_argument(
        "--decode-token-weight",
        type=float,
        default=DEFAULT_DECODE_TOKEN_WEIGHT,
        help="prefill tokens of load per outstanding output token (0: prefill only)",
    )
    parser.add_argument(
        "--directory-scale",
        type=float,
        default=DEFAULT_DIRECTORY_SCALE,
        help="the router's directory capacity as a multiple of each engine's KV (default 8)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--overflow",
        choices=("on", "off"),
        default="on",
        help="spread hot prefixes as the gateway does (cache_aware; default on)",
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    router = RouterConfig()
    overrides = {
        k: v
        for k, v in (
            ("absolute_slack_tokens", args.absolute_slack_tokens),
            ("relative_slack", args.relative_slack),
        )
        if v is not None
    }
    if overrides:
        router = replace(router, **overrides)
    return SimConfig(
        num_replicas=args.replicas,
        capacity_frac=args.capacity_frac,
        timing=TimingModel(
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            max_batch=args.max_batch,
            **decode_from_args(args),
        ),
        router=router,
        seed=args.seed,
        max_output_tokens=args.max_output_tokens,
        directory_scale=args.directory_scale,
        overflow=args.overflow == "on",
        decode_token_weight=args.decode_token_weight,
    )


def run_sim(args: argparse.Namespace) -> int:
    from rich.table import Table

    from loadgen.console import report_console

    console = report_console()
    try:
        config = config_from_args(args)
        policies = list(POLICIES) if args.policy == "all" else [args.policy]
        if args.trace.startswith("hot-spine"):
            trace = hot_spine_trace(args.trace)
        else:
            trace = read_trace(
                args.trace,
                block_size=args.block_size,
                start=args.start,
                limit=args.limit,
                num_tenants=args.tenants,
            )
        refs, results = run_policies(trace, policies, config)
    except (OSError, ValueError) as exc:
        console.print(f"[red]kvgate sim: {exc}[/]")
        return 2
    t = config.timing
    console.print(
        f"[bold]kvgate sim[/] {trace.name}: {len(trace.requests):,} requests over "
        f"{trace.span_s:,.0f} s, {refs.unique_blocks:,} unique blocks of {trace.block_size} "
        f"tokens; {config.num_replicas} replicas × {refs.capacity_blocks_per_replica:,} blocks "
        f"(capacity frac {config.capacity_frac:g})\nengine timing: prefill "
        f"{t.prefill_tokens_per_s:,.0f} tokens/s FCFS, {describe_decode(t)}, "
        f"batch ≤ {t.max_batch}; router: absolute slack "
        f"{config.router.absolute_slack_tokens:,.0f} tokens, relative slack "
        f"{config.router.relative_slack:g}, directory {config.directory_scale:g}x the engines' "
        f"KV; seed {config.seed}"
    )
    ideal, lru = refs.ideal_hit_ratio, refs.lru_reference_hit_ratio
    table = Table(
        title=f"ideal (one unlimited cache) {ideal:.1%}; one shared LRU of the fleet's capacity "
        f"{lru:.1%} ({lru / ideal if ideal else 0:.1%} of ideal)"
    )
    for column in (
        "policy",
        "hit ratio",
        "of ideal",
        "of LRU",
        "TTFT mean s",
        "p50 s",
        "p99 s",
        "imbalance",
        "prompts max/mean",
        "prefill util",
        "sim s",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in results:
        table.add_row(
            r.policy,
            f"{r.hit_ratio:.1%}",
            f"{r.share_of_ideal:.1%}",
            f"{r.share_of_lru_reference:.1%}",
            f"{r.ttft_mean_s:.3f}",
            f"{r.ttft_p50_s:.3f}",
            f"{r.ttft_p99_s:.3f}",
            f"{r.imbalance:.2f}",
            f"{r.prompt_imbalance:.2f}",
            f"{r.prefill_utilization:.2f}",
            f"{r.sim_wall_s:.1f}",
        )
    console.print(table)
    if args.json_out:
        payload = {
            "trace": {
                "path": str(args.trace),
                "requests": len(trace.requests),
                "span_s": trace.span_s,
                "block_size": trace.block_size,
                "start": args.start,
            },
            "config": {
                "replicas": config.num_replicas,
                "capacity_frac": config.capacity_frac,
                "timing": asdict(config.timing),
                "router": asdict(config.router),
                "seed": config.seed,
                "max_output_tokens": config.max_output_tokens,
                "directory_scale": config.directory_scale,
                "decode_token_weight": config.decode_token_weight,
            },
            "references": asdict(refs),
            "results": {r.policy: r.summary() for r in results},
        }
        Path(args.json_out).write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
        console.print(f"wrote {args.json_out}")
    return 0
