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

Two directories (`SimConfig.mode`):
- approximate (the default, today's gateway): the router records a request's blocks on its
  replica at its first token and predicts the rest (capacity, TTL), as above;
- precise (issue 16): the directory is fed by the engines' own KV events only — each
  `BlockPool` logs what it stored and what its own LRU evicted, and the log reaches the
  directory `event_delay_s` later (publish, ZMQ, ingest) — so it holds what the engines hold,
  late by the delay. Policies that read each replica's eviction frontier (`cache_pressure`)
  get it here: the engine's evictable blocks in eviction order, aged by when the router last
  sent a request using them (a gateway knows when it routed; the engine's events say what
  is stored and gone). Cache-blind policies read no directory and run in approximate mode only.

Many gateways (`SimConfig.gateways`, issue 39): requests are spread round robin over N routers
on one shared directory, as a Service spreads them over gateways on one Redis. What Redis shares
is shared: the entries (kept as the Redis directory keeps them: `_GenerationIndex`), the
placements in flight (a flight each, `:p`, `cachemap.redis.directory.PLACEMENT_TTL_S`), the
hot-prefix rates and k, the conversations' homes, precise mode's event index and speculative
entries. What a gateway keeps to itself is its own: its requests' load counted exactly
(`Lease`), its peers' as they published it at their last load-share round (`_Gateways`,
gateway.fleet.shared_load); and each ranks a load tie by its place among the gateways, as a
gateway with peers does (`router.herd`, `SimConfig.herd`). `SimConfig.ahead` (live as the
`place_ahead` setting, `gateway.fleet.ahead`) has each decide on the published load with the
requests looked up before it and not yet published placed first (`router.ahead`).
`SimConfig.as_one` models a piece as one in-process gateway has it, to find what costs the hit
ratio. Not modelled (at one gateway either): the engines' /metrics, fan-out holds, flow control,
the write-behind queue's latency and reconciliation.

Invariants (checked by the tests): for every request cached + uncached = input; the ideal hit
ratio bounds every policy's; the same seed gives the same result.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import heapq
import itertools
import math
import random
import statistics
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from cachemap.affinity import ConversationAffinity
from cachemap.directory import DEFAULT_TTL_S, Held
from cachemap.events import DEFAULT_SPECULATIVE_TTL_S
from cachemap.keys import BlockHash, affinity_key, chain_hashes, root_hash
from cachemap.memory import MemoryIndex
from cachemap.rates import PrefixRates
from cachemap.redis.directory import DISTINCT_GENERATIONS, PLACEMENT_TTL_S, record_refresh_ms
from loadgen.engine.kvpool import BlockPool, CacheEvent, Cleared, Removed, Stored
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
from loadgen.traces.sessions import SESSIONS_PREFIX, agent_sessions_trace
from router.ahead import Ahead, place_ahead, ties_by_id
from router.capacity import within_capacity
from router.claims import counted_claims
from router.filters import DEFAULT_DECODE_TOKEN_WEIGHT
from router.overflow import OverflowConfig
from router.plan import HotPrefix, plan
from router.profile import RoutingProfile
from router.registry import (
    DEFAULT_AFFINITY_WEIGHT,
    DEFAULT_CROWDING_WEIGHT,
    DEFAULT_DISPLACEMENT_WEIGHT,
    DEFAULT_ROOM_WEIGHT,
    DEFAULT_STICKINESS,
    POLICIES,
    RouterConfig,
    affinity_weight_for,
    build_policy,
    frontier_reader,
    room_weight_for,
    stickiness_for,
)
from router.scorers import (
    DEFAULT_DISPLACEMENT_HALF_LIFE_S,
    DEFAULT_DISPLACEMENT_HOT_S,
    DisplacementScorer,
)
from router.types import Decision, KvFrontier, Replica, RouteRequest

DEFAULT_NUM_REPLICAS = 8
DEFAULT_CAPACITY_FRAC = 0.25
"""KV capacity of the whole fleet as a share of the trace's unique blocks: a quarter makes
eviction matter (the issue's operating point)."""
DEFAULT_DIRECTORY_SCALE = 8.0
"""The directory holds 8x each engine's KV, as the gateway's default directory capacity is
sized (`cachemap.directory.DEFAULT_REPLICA_CAPACITY_BLOCKS`): at 10% capacity an engine-sized
directory forgot conversations their engine still held (97.7% of the shared LRU on the bench's
slice against 103% at 8x)."""
APPROXIMATE = "approximate"
PRECISE = "precise"
MODES = (APPROXIMATE, PRECISE)
DEFAULT_EVENT_DELAY_S = 0.05
"""KV events reach the directory 50 ms after the engine changed: vLLM publishes once per
engine step (10–30 ms), then ZMQ and the gateway's ingest."""
DEFAULT_GATEWAYS = 1
DEFAULT_LOAD_SHARE_INTERVAL_S = 0.1
"""The gateway's `load_share_interval_s` default (`gateway.settings`), in trace seconds."""
SGLANG_MODEL = "sglang_model"
"""A model of sglang-router's `cache_aware` (sim only, not a kvgate policy): see `SglangModel`."""
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5

LOAD = "load"
CAPACITY = "capacity"
PLACEMENTS = "placements"
AS_ONE = (LOAD, CAPACITY, PLACEMENTS)
"""What `SimConfig.as_one` can model as one in-process gateway has it, at N gateways: every
gateway's load known at once (`load`), the directory an exact LRU per replica (`capacity`), no
placements in flight (`placements`)."""
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
    mode: str = APPROXIMATE
    """The directory: predicted by the router (approximate) or fed by engine events (precise)."""
    affinity_weight: float | None = None
    """Conversation affinity's weight; None: the mode's default, as the gateway's
    (`router.registry.affinity_weight_for`), which replaces `router.affinity_weight`."""
    event_delay_s: float = DEFAULT_EVENT_DELAY_S
    """Precise mode: how late an engine's events reach the directory."""
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    """Precise mode: how long a placement's blocks count as held on its replica before their
    event, as the gateway's setting of the same name (`cachemap.events.EventIndex.speculate`)."""
    stickiness: float | None = None
    """The load bound's stickiness; None: the mode's default, as the gateway's
    (`router.registry.stickiness_for`), which replaces `router.stickiness`."""
    gateways: int = DEFAULT_GATEWAYS
    """Routers on one shared directory, requests round robin over them (module docstring); 1:
    one in-process gateway."""
    load_share_interval_s: float = DEFAULT_LOAD_SHARE_INTERVAL_S
    """How often each of several gateways publishes its load and reads its peers'."""
    as_one: frozenset[str] = frozenset()
    """Of `AS_ONE`: pieces modelled at several gateways as one in-process gateway has them."""
    placement_delay_s: float | None = None
    """Several gateways: each publishes its figures at each placement too, seen by its peers
    this long after (trace seconds), and each decision reads its peers' latest (`_Gateways`);
    None: the peers' figures come by the periodic round only."""
    routing_s: float = 0.0
    """Several gateways: each decides its requests one after another, this long each (trace
    seconds; it orders who sees whose placement, the engines still get each at its arrival)."""
    room_weight: float | None = None
    """The room scorer's weight; None: the mode's default, as the gateway's
    (`router.registry.room_weight_for`), which replaces `router.room_weight`."""
    pace: bool = False
    """Several gateways, placements shared (`placement_delay_s`): a gateway decides its next
    request no sooner than `placement_delay_s` after its last decision, when the peers'
    placements of that instant have reached its view (a model only: what is left of the herd
    once each instant's ties are ranked, docs/design/directory.md)."""
    herd: bool = True
    """Several gateways: each ranks a load tie by its place among the gateways (gateway `g`
    of N: `RouteRequest.peers` N - 1, `peer_rank` g; `router.herd`), as the gateway's
    `spread_herd` setting; False: each breaks it by its own view alone, as before issue 39's
    herd rule. One gateway has no peers either way, nor do gateways that know each other's
    load at once (`as_one` load: there is no herd to spread)."""
    ahead: bool = False
    """Several gateways, placements shared (`placement_delay_s`): each decides on the load
    every gateway has published, with the requests looked up before its own (a request is
    looked up `routing_s` before its decision) and not yet published placed first, a peer's
    where the policy places it (`router.ahead`; the gateway's is `gateway.fleet.ahead`, whose
    registration is a round trip after the lookup, not modelled). False: each on its own view,
    the herd rule standing for its peers' requests."""
    distinct_generations: int = DISTINCT_GENERATIONS
    """Several gateways, the directory by generations: K > 0 as Redis keeps it (`_Distinct
    GenerationIndex`: K generations of 1/K of the capacity, the oldest dropped by the entries
    it still holds; built with K = `DISTINCT_GENERATIONS`, 16); 0 the rule before
    (`_GenerationIndex`: two generations of 3/4 the capacity)."""

    def __post_init__(self) -> None:
        if self.gateways < 1:
            raise ValueError(f"gateways must be at least 1, got {self.gateways}")
        if self.load_share_interval_s <= 0:
            raise ValueError(
                f"load_share_interval_s must be positive, got {self.load_share_interval_s}"
            )
        if self.placement_delay_s is not None and self.placement_delay_s < 0:
            raise ValueError(
                f"placement_delay_s must be non-negative, got {self.placement_delay_s}"
            )
        if self.routing_s < 0:
            raise ValueError(f"routing_s must be non-negative, got {self.routing_s}")
        if self.ahead and self.placement_delay_s is None:
            raise ValueError("ahead needs placements shared (placement_delay_s)")
        if self.distinct_generations < 0:
            raise ValueError(
                f"distinct_generations must be non-negative, got {self.distinct_generations}"
            )
        unknown = self.as_one - set(AS_ONE)
        if unknown:
            raise ValueError(f"unknown as_one {sorted(unknown)}; choose from {AS_ONE}")
        if self.mode not in MODES:
            raise ValueError(f"unknown directory mode {self.mode!r}; choose one of {MODES}")
        if self.event_delay_s < 0:
            raise ValueError(f"event_delay_s must be non-negative, got {self.event_delay_s}")
        if self.speculative_ttl_s < 0:
            raise ValueError(
                f"speculative_ttl_s must be non-negative, got {self.speculative_ttl_s}"
            )
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
    best_blocks: int = 0
    """The most leading blocks of the request any replica held, as the directory said when
    the router placed it."""


@dataclass
class PolicyResult:
    policy: str
    mode: str
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
    evicted_blocks: int = 0
    """Blocks the engines' LRUs evicted in the run (what placement made them give up)."""
    lost_staying_tokens: int = 0
    """Of the prefix a conversation's previous request left (the blocks the two share), the
    tokens a request did not find although it went to the same replica: evicted there."""
    lost_moving_tokens: int = 0
    """...and the tokens it did not find because it went to another replica (a move)."""
    num_moves: int = 0
    """Requests placed away from their conversation's previous request's replica."""
    num_blind_moves: int = 0
    """Of those, moves made while the directory showed the conversation's context gone
    everywhere: no replica held half the blocks the request shares with its previous one."""
    session_hops_mean: float = 0.0
    """Moves per conversation (requests placed away from the previous one's replica)..."""
    session_hops_max: int = 0
    session_reprefill_tokens_mean: float = 0.0
    """...and tokens per conversation prefilled again: of what its previous request left,
    what a request did not find (lost staying + lost moving)."""
    session_reprefill_tokens_max: int = 0
    sim_wall_s: float = 0.0
    outcomes: list[RequestOutcome] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("outcomes")
        return out

    @property
    def label(self) -> str:
        """The policy, with its directory when that is precise ("cache_aware@precise")."""
        return self.policy if self.mode == APPROXIMATE else f"{self.policy}@{self.mode}"


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


@dataclass(slots=True)
class _Load:
    """Requests on one replica as a lease counts them (`gateway.fleet.replicas.Lease`): in
    flight, their uncached prefill until the first token, their output until the end."""

    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    decode_tokens: float = 0.0

    def add(self, other: _Load) -> None:
        self.num_inflight += other.num_inflight
        self.pending_prefill_tokens += other.pending_prefill_tokens
        self.decode_tokens += other.decode_tokens


@dataclass
class _ReplicaState:
    id: str
    core: EngineCore
    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    routed_s: dict[bytes, float] = field(default_factory=dict)
    """When the router last sent this replica a request using each block (precise mode)."""

    def snapshot(self, frontier: KvFrontier | None = None, seen: _Load | None = None) -> Replica:
        """The replica as a router sees it: every request on it, or what one of several
        gateways `seen` of them."""
        if seen is None:
            seen = _Load(self.num_inflight, self.pending_prefill_tokens, self.decode_tokens)
        return Replica(
            self.id,
            True,
            seen.num_inflight,
            seen.pending_prefill_tokens,
            decode_tokens=seen.decode_tokens,
            kv_frontier=frontier,
        )

    def frontier(
        self,
        need_blocks: int,
        now: float,
        live: tuple[int, ...] = (),
        own: Sequence[BlockHash] = (),
    ) -> KvFrontier:
        """The engine's eviction frontier as deep as `need_blocks` new blocks would evict,
        in runs of blocks the router last used at one time, with the engine's capacity and
        the other live conversations' own blocks there (`live`). The request's own cached
        prefix here (`own`: its blocks the directory matched on this replica) is left out:
        placed here, the request takes them out of the free queue before it allocates, as the
        gateway's frontier leaves them out (`gateway.pipeline.frontier`)."""
        pool = self.core.cache
        empty = pool.num_empty
        depth = need_blocks - empty
        if depth <= 0:
            return KvFrontier(empty, (), pool.capacity_blocks, live)
        runs: list[tuple[int, float]] = []
        blocks = pool.eviction_order()
        if own:
            skip = frozenset(own)
            blocks = (h for h in blocks if h not in skip)
        order = itertools.islice(blocks, depth)
        for used_s, run in itertools.groupby(order, key=self.routed_s.get):
            idle = now - used_s if used_s is not None else math.inf
            runs.append((sum(1 for _ in run), idle))
        return KvFrontier(empty, tuple(runs), pool.capacity_blocks, live)


class _Gateways:
    """Several gateways' views of the load (`gateway.fleet.shared_load`): each counts its own
    requests exactly, and its peers' as they were at their last round. A gateway's round, every
    `round_s` (staggered over the gateways, as they start at different instants), writes its
    own figures and reads the others' last written ones in one call, so a peer's figure is up
    to two rounds old when a decision reads it: a prefill that ended since is still counted,
    one sent since is not.

    With `placement_delay_s` (the placements shared, `SimConfig.placement_delay_s`) a gateway
    also publishes its figures at each placement, which its peers see `placement_delay_s`
    after it (a Redis round trip and the placing gateway's own routing), and every decision
    reads its peers' latest published figures (the lookup's round trip reads them), not its
    last round's. A gateway decides its requests one after another, `routing_s` each
    (`decide_at`): a burst of one arrival instant spreads over its gateways' routing, so a
    peer's placement made early in the burst reaches a decision late in it."""

    def __init__(
        self,
        count: int,
        round_s: float,
        replicas: Sequence[str],
        placement_delay_s: float | None = None,
        routing_s: float = 0.0,
        pace: bool = False,
        ahead: bool = False,
    ) -> None:
        self.pace_s = placement_delay_s if pace and placement_delay_s is not None else None
        """`SimConfig.pace`: the least time between a gateway's two decisions (None: any)."""
        if count == 1:
            self.pace_s = None
        self.round_s = round_s
        self.replicas = tuple(replicas)
        self.placement_delay_s = placement_delay_s
        self.routing_s = routing_s
        self.own = [{r: _Load() for r in replicas} for _ in range(count)]
        self._published = [{r: _Load() for r in replicas} for _ in range(count)]
        self._published_at = [-math.inf] * count
        """When each gateway's published figures were taken."""
        self._peers = [{r: _Load() for r in replicas} for _ in range(count)]
        self._next = [g * round_s / count for g in range(count)]
        self._free = [-math.inf] * count
        """When each gateway finishes routing its last request."""
        self._decided = [-math.inf] * count
        """When each gateway decided its last request."""
        self._pending: list[tuple[float, int, int, float, dict[str, _Load]]] = []
        """Placements' figures on their way to the peers: (visible at, order, gateway, taken
        at, figures), a heap."""
        self._order = itertools.count()
        self.ahead_on = ahead and count > 1
        """`SimConfig.ahead`: decisions on the published load, the requests ahead first."""
        self._looked_up: list[tuple[float, int, int, RouteRequest, float, str]] = []
        """Requests whose placements may be unpublished, in lookup order: (looked up at,
        position, gateway, request, decided at, replica)."""

    def decide_at(self, g: int, arrival_s: float) -> float:
        """When gateway `g` decides a request arriving at `arrival_s`: after the ones it
        has before it, `routing_s` each (paced: and no sooner than `pace_s` after its last)."""
        at = self._free[g] = max(arrival_s, self._free[g]) + self.routing_s
        if self.pace_s is not None:  # when its peers' placements of its last instant arrive
            at = self._free[g] = max(at, self._decided[g] + self.pace_s)
            self._decided[g] = at
        return at

    def placed(self, g: int, at: float) -> None:
        """Gateway `g` placed a request at `at`: its figures reach its peers later."""
        if self.placement_delay_s is None or len(self.own) == 1:
            return
        figures = {r: replace(load) for r, load in self.own[g].items()}
        item = (at + self.placement_delay_s, next(self._order), g, at, figures)
        heapq.heappush(self._pending, item)

    def rounds_until(self, now: float) -> None:
        """Every gateway's rounds due by `now`, and every placement visible by then, in time
        order (one gateway has no peers)."""
        due = self._next
        if len(due) == 1:
            return
        while True:
            g = min(range(len(due)), key=due.__getitem__)
            pending = self._pending[0][0] if self._pending else math.inf
            if min(due[g], pending) > now:
                return
            if pending < due[g]:
                _, _, h, taken, figures = heapq.heappop(self._pending)
                if taken >= self._published_at[h]:
                    self._published[h], self._published_at[h] = figures, taken
                continue
            self._round(g, due[g])
            due[g] += self.round_s

    def _round(self, g: int, now: float) -> None:
        self._published[g] = {r: replace(load) for r, load in self.own[g].items()}
        self._published_at[g] = now
        peers = self._peers[g] = {r: _Load() for r in self.replicas}
        for h, published in enumerate(self._published):
            if h != g:
                for r, load in published.items():
                    peers[r].add(load)

    def published(self, replica: str) -> _Load:
        """What every gateway's published figures count on `replica` (the same for all)."""
        seen = _Load()
        for figures in self._published:
            seen.add(figures[replica])
        return seen

    def ahead(self, g: int, looked_up: tuple[float, int]) -> list[Ahead]:
        """The requests looked up before `looked_up` (time, position) whose placements are not
        in their gateway's published figures: `g`'s own where it sent them, its peers' to be
        placed by the policy (`router.ahead`)."""
        pending = self._looked_up = [
            item for item in self._looked_up if item[4] > self._published_at[item[2]]
        ]
        return [
            Ahead(req, rid if h == g else None)
            for at, position, h, req, _, rid in pending
            if (at, position) < looked_up
        ]

    def deciding_on(self, seen: Callable[[str], _Load] | None) -> Callable[[str], _Load] | None:
        """The load a decision reads: with the requests ahead, the published load (the same
        for every gateway, `router.ahead`); else as given."""
        return self.published if self.ahead_on else seen

    def with_ahead(
        self,
        profile: RoutingProfile,
        g: int,
        looked_up: tuple[float, int],
        snapshot: list[Replica],
        req: RouteRequest,
    ) -> tuple[list[Replica], RouteRequest]:
        """`snapshot` with the requests looked up before `looked_up` and not yet published
        placed on it first, and `req` as it is then decided: ties by id when any is ahead
        (`router.ahead`); both unchanged without."""
        if not self.ahead_on:
            return snapshot, req
        ahead = self.ahead(g, looked_up)
        if not ahead:
            return snapshot, req
        return place_ahead(profile, ahead, snapshot)[0], ties_by_id(req)

    def looked_up(
        self, g: int, looked_up: tuple[float, int], req: RouteRequest, at: float, replica: str
    ) -> None:
        """Gateway `g` looked `req` up at `looked_up` and placed it on `replica` at `at` (kept
        while its placement may be unpublished, with the requests ahead only)."""
        if not self.ahead_on:
            return
        bisect.insort(self._looked_up, (*looked_up, g, req, at, replica), key=lambda i: i[:2])

    def seen(self, g: int, replica: str) -> _Load:
        """What gateway `g` counts on `replica`: its own requests and its peers' figures (as
        its last round read them, or as published now when placements are shared)."""
        seen = replace(self.own[g][replica])
        if self.placement_delay_s is None:
            seen.add(self._peers[g][replica])
            return seen
        for h, published in enumerate(self._published):
            if h != g:
                seen.add(published[replica])
        return seen


class _Conversations:
    """Precise mode: who needs each replica soon, as a gateway knows it from its own routing —
    per conversation, the replica it was last sent to, when, with which blocks, and whether
    that request still runs. A conversation is live while its last request runs or was routed
    within the hot horizon; a conversation's own blocks are those beyond what it shares with
    the request being placed (shared leading blocks count once: cached for both)."""

    def __init__(self, hot_s: float) -> None:
        self.hot_s = hot_s
        self.last: dict[str, tuple[str, float, tuple[int, ...]]] = {}
        self.running: dict[str, int] = {}
        self._shared: dict[tuple[str, str], int] = {}
        """Leading hash ids two conversations share: a conversation's prompt only grows, so
        (but for one being a prefix of the other, both kept whole) it never changes."""

    def routed(self, conversation: str, replica: str, now: float, ids: tuple[int, ...]) -> None:
        self.last[conversation] = (replica, now, ids)
        self.running[conversation] = self.running.get(conversation, 0) + 1

    def finished(self, conversation: str) -> None:
        self.running[conversation] -= 1

    def live(self, conversation: str, ids: tuple[int, ...], now: float) -> dict[str, list[int]]:
        """Per replica, the own blocks of every other live conversation there."""
        out: dict[str, list[int]] = {}
        for other, (replica, at, theirs) in list(self.last.items()):
            if other == conversation:
                continue
            if now - at >= self.hot_s and not self.running.get(other):
                del self.last[other]  # routed again, it comes back
                continue
            out.setdefault(replica, []).append(
                len(theirs) - self.shared(conversation, ids, other, theirs)
            )
        return out

    def shared(self, a: str, a_ids: tuple[int, ...], b: str, b_ids: tuple[int, ...]) -> int:
        key = (a, b) if a < b else (b, a)
        n = self._shared.get(key)
        if n is None or n in (len(a_ids), len(b_ids)):
            n = 0
            for x, y in zip(a_ids, b_ids, strict=False):
                if x != y:
                    break
                n += 1
            self._shared[key] = n
        return n


class _PredictingDirectory:
    """Approximate mode: the router records a request's blocks on its replica at its first
    token, in an index that forgets by capacity and TTL (the gateway's default directory)."""

    def __init__(self, index: MemoryIndex) -> None:
        self.index = index

    def first_token(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self.index.record(replica, hashes)

    def speculate(self, replica: str, hashes: Sequence[BlockHash], now: float) -> None:
        pass

    def lookup(
        self, hashes: Sequence[BlockHash], now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica, the predicted overlap, and none of it claimed."""
        return (self.index.lookup(hashes) if hashes else {}), {}

    def engine_events(self, now: float, replica: str, events: list[CacheEvent]) -> None:
        pass

    def catch_up(self, now: float) -> None:
        pass


class _EventDirectory:
    """Precise mode: the index holds what the engines' events said, `delay_s` after they
    said it; a first token records nothing (the event will). A placement's blocks count as
    held on its replica until their event stores them or `speculative_ttl_s` passes (the
    gateway's speculative entries, `cachemap.events.EventIndex.speculate`): a lookup's depth
    there is its leading run of blocks held or claimed. (The gateway keeps one entry per
    window of 4 blocks, so a chain parting inside a window matches up to 3 blocks fewer there;
    here every block has one.)"""

    def __init__(self, index: MemoryIndex, delay_s: float, speculative_ttl_s: float) -> None:
        self.index = index
        self.delay_s = delay_s
        self.speculative_ttl_s = speculative_ttl_s
        self._due: deque[tuple[float, str, list[CacheEvent]]] = deque()
        self._claims: dict[str, dict[bytes, float]] = {}
        """Per replica: block -> when its speculative entry expires."""
        self._held_of: Sequence[BlockHash] | None = None
        self._held: dict[str, int] = {}
        """The last lookup's chain and what the events held of it, per replica."""

    def first_token(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        pass

    def speculate(self, replica: str, hashes: Sequence[BlockHash], now: float) -> None:
        """Claim the placed chain's blocks past those its replica's events hold (as the
        gateway enters none for a window its engine already holds)."""
        if self.speculative_ttl_s <= 0 or not hashes:
            return
        held = self._held.get(replica, 0) if self._held_of is hashes else 0
        claims = self._claims.setdefault(replica, {})
        claims.update(dict.fromkeys(hashes[held:], now + self.speculative_ttl_s))
        if len(claims) > 4 * self.index.capacity_blocks:  # expired ones go, amortised
            self._claims[replica] = {h: t for h, t in claims.items() if t > now}

    def lookup(
        self, hashes: Sequence[BlockHash], now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica, the leading run held or claimed, and how much of it only claimed."""
        if not hashes:
            return {}, {}
        overlap = self.index.lookup(hashes)
        self._held_of, self._held = hashes, dict(overlap)
        claimed: dict[str, int] = {}
        for replica, claims in self._claims.items():
            held = depth = overlap.get(replica, 0)
            while depth < len(hashes) and claims.get(hashes[depth], -math.inf) > now:
                depth += 1
            if depth > held:
                overlap[replica] = depth
                claimed[replica] = depth - held
        return overlap, claimed

    def engine_events(self, now: float, replica: str, events: list[CacheEvent]) -> None:
        if events:  # engine time never goes back, so the queue stays in delivery order
            self._due.append((now + self.delay_s, replica, events))

    def catch_up(self, now: float) -> None:
        due = self._due
        while due and due[0][0] <= now:
            at, replica, events = due.popleft()
            claims = self._claims.get(replica)
            for event in events:
                if isinstance(event, Stored):
                    self.index.record(replica, [BlockHash(h) for h in event.hashes], at)
                    if claims:  # confirmed: the event holds them now
                        for h in event.hashes:
                            claims.pop(h, None)
                elif isinstance(event, Removed):
                    self.index.drop(replica, [BlockHash(h) for h in event.hashes])
                elif isinstance(event, Cleared):
                    self.index.forget(replica)


TWO_GENERATIONS_SHARE = 0.75
"""The Redis directory's rule before its distinct generations (`--distinct-generations 0`): a
generation advances after 3/4 of the capacity in blocks new to it, two generations match."""


class _GenerationIndex:
    """A replica's capacity as the Redis directory kept it before its distinct generations
    (`--distinct-generations 0`; the lookup's live generations): an entry carries the
    generation it was written at, a record counts the blocks new to the replica's generation,
    and after 3/4 of the capacity of them the generation advances; only the current and
    the previous one match. An LRU approximated by two generations: it holds between one and
    two generations' worth of the replica's most recently recorded blocks, where `MemoryIndex`
    holds exactly `capacity`. A record leaves a held prefix its lookup read at the current
    generation and used within `record_refresh_ms` as it is (`RedisDirectory.record_many`; no
    floors here: reconciliation is not modelled)."""

    def __init__(self, capacity_blocks: int, ttl_s: float, clock: _Clock) -> None:
        self.per_generation = max(math.ceil(capacity_blocks * TWO_GENERATIONS_SHARE), 1)
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[str, dict[bytes, tuple[int, float]]] = {}
        self._generation: dict[str, int] = {}
        self._count: dict[str, int] = {}

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {replica: held.depth for replica, held in self.lookup_held(hashes).items()}

    def lookup_held(self, hashes: Sequence[BlockHash]) -> dict[str, Held]:
        """Per replica, its match and the oldest generation and last use (ms) in it (the lookup
        script's held entries)."""
        expired_before = self.clock() - self.ttl_s
        out: dict[str, Held] = {}
        for replica, entries in self._entries.items():
            live = self.oldest_live(replica)
            depth, gen, used = 0, 0, math.inf
            for block in hashes:
                entry = entries.get(block)
                if entry is None or entry[0] < live or entry[1] <= expired_before:
                    break
                depth += 1
                gen = entry[0] if depth == 1 else min(gen, entry[0])
                used = min(used, entry[1])
            if depth:
                out[replica] = Held(depth, gen, round(used * 1000))
        return out

    def oldest_live(self, replica: str) -> int:
        """The oldest generation whose entries match (the lookup script's argument)."""
        return self._generation[replica] - 1

    def record(self, replica: str, hashes: Sequence[BlockHash], held: Held | None = None) -> None:
        now = self.clock()
        entries = self._entries.setdefault(replica, {})
        generation = self._generation.setdefault(replica, 0)
        now_ms = round(now * 1000)
        ttl_ms = round(self.ttl_s * 1000)
        refresh_ms = record_refresh_ms(ttl_ms, ttl_ms)  # no floor: as one a TTL old
        if held is not None and held.gen == generation and now_ms - held.used_ms < refresh_ms:
            hashes = hashes[held.depth :]
        new = 0
        for block in hashes:
            old = entries.get(block)
            new += old is None or old[0] != generation
            entries[block] = (generation, now)
        count = self._count.get(replica, 0) + new
        if count >= self.per_generation:
            generation += 1
            self._generation[replica], count = generation, 0
            # an older generation never matches again: its entries go (Redis's go by TTL)
            self._entries[replica] = {b: e for b, e in entries.items() if e[0] >= generation - 1}
        self._count[replica] = count


class _DistinctGenerationIndex(_GenerationIndex):
    """The Redis directory's capacity as built (`SimConfig.distinct_generations`, `scripts.
    _COUNTED`). Two generations hold between 3/4 and 3/2 of the capacity in
    distinct blocks, and where a replica's blocks are used again across generations (every
    conversation's prefix at its next turn) the count of blocks new to the generation runs
    ahead of the blocks held: the directory forgets prefixes its engine still holds, or lists
    ones it evicted, where an exact LRU of the capacity does neither. Here each replica keeps
    how many of its live entries are at each generation (a block used again moves from its
    generation to the current one: one less there, one more here); the current generation
    advances after `capacity / K` entries are at it, and the oldest live generation is dropped
    while the entries left without it are nearer the capacity than with it — so the live
    entries stay within half a generation (capacity / 2K) of the capacity, as an LRU's. The
    lookup is unchanged: it already takes each replica's oldest live generation. A TTL-expired
    entry is still counted until its generation is dropped (the TTL is far past these traces)."""

    def __init__(self, capacity_blocks: int, ttl_s: float, clock: _Clock, generations: int) -> None:
        super().__init__(capacity_blocks, ttl_s, clock)
        self.capacity = capacity_blocks
        self.per_generation = max(math.ceil(capacity_blocks / generations), 1)
        self._at: dict[str, dict[int, int]] = {}
        """Per replica: a live generation -> how many of its entries are at it."""
        self._oldest: dict[str, int] = {}

    def oldest_live(self, replica: str) -> int:
        return self._oldest.get(replica, 0)

    def record(self, replica: str, hashes: Sequence[BlockHash], held: Held | None = None) -> None:
        now = self.clock()
        entries = self._entries.setdefault(replica, {})
        generation = self._generation.setdefault(replica, 0)
        oldest = self._oldest.get(replica, 0)
        at = self._at.setdefault(replica, {})
        now_ms = round(now * 1000)
        ttl_ms = round(self.ttl_s * 1000)
        refresh_ms = record_refresh_ms(ttl_ms, ttl_ms)
        if held is not None and held.gen == generation and now_ms - held.used_ms < refresh_ms:
            hashes = hashes[held.depth :]
        for block in hashes:
            old = entries.get(block)
            if old is not None and old[0] >= oldest:
                at[old[0]] -= 1
            at[generation] = at.get(generation, 0) + 1
            entries[block] = (generation, now)
        if at.get(generation, 0) >= self.per_generation:
            generation += 1
            self._generation[replica] = generation
        live = sum(at.values())
        while oldest < generation and live - at.get(oldest, 0) / 2 > self.capacity:
            live -= at.pop(oldest, 0)
            oldest += 1
        if oldest != self._oldest.get(replica, 0):
            self._oldest[replica] = oldest
            self._entries[replica] = {b: e for b, e in entries.items() if e[0] >= oldest}


class _SharedDirectory:
    """Approximate mode at several gateways: the Redis directory (`cachemap.redis`), its
    capacity by generations (`_GenerationIndex`; or a `MemoryIndex`, `as_one` capacity) and the
    placements in flight: a request's blocks past what its replica was seen to hold are a
    flight on that replica from its routing (`RoutingDirectory.place`) until `placement_ttl_s`
    passes. As the lookup script reads them (`scripts.PLACE`): after the entries, a replica's
    match goes on through its live flight that starts where the match ends, as far as the
    flight's blocks are the chain's, and on through a flight starting there in turn; a flight
    the first token's record covered starts inside the entries and is not read again."""

    def __init__(self, index: MemoryIndex | _GenerationIndex, placement_ttl_s: float) -> None:
        self.index = index
        self.placement_ttl_s = placement_ttl_s
        self._flights: dict[str, dict[bytes, tuple[float, Sequence[BlockHash]]]] = {}
        """Per replica: a flight's first block -> (when it expires, its blocks)."""
        self._seen_of: Sequence[BlockHash] | None = None
        self._seen: dict[str, int] = {}
        """The last lookup's chain and its overlap (what the director's `place` reads)."""
        self._held: dict[int, tuple[Sequence[BlockHash], dict[str, Held]]] = {}
        """A looked-up chain's id -> (the chain, what its lookup read each replica to hold):
        what its first token's record leaves as it is."""

    def first_token(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        if isinstance(self.index, _GenerationIndex):
            of, held = self._held.pop(id(hashes), (None, {}))
            self.index.record(replica, hashes, held.get(replica) if of is hashes else None)
        else:
            self.index.record(replica, hashes)

    def speculate(self, replica: str, hashes: Sequence[BlockHash], now: float) -> None:
        if self.placement_ttl_s <= 0 or not hashes:
            return
        held = self._seen.get(replica, 0) if self._seen_of is hashes else 0
        if held >= len(hashes):
            return
        flights = self._flights.setdefault(replica, {})
        flights[hashes[held]] = (now + self.placement_ttl_s, hashes[held:])
        if len(flights) > 4096:  # expired ones go, amortised
            self._flights[replica] = {b: f for b, f in flights.items() if f[0] > now}

    def lookup(
        self, hashes: Sequence[BlockHash], now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica, the overlap with placements in flight walked through, and none of it
        claimed (the gateway judges only precise mode's speculative claims, `router.claims`)."""
        if not hashes:
            return {}, {}
        if isinstance(self.index, _GenerationIndex):
            held = self.index.lookup_held(hashes)
            self._held[id(hashes)] = (hashes, held)
            overlap = {replica: h.depth for replica, h in held.items()}
        else:
            overlap = self.index.lookup(hashes)
        for replica, flights in self._flights.items():
            depth = overlap.get(replica, 0)
            while depth < len(hashes):
                flight = flights.get(hashes[depth])
                if flight is None or flight[0] <= now:
                    break
                depth += _agreed(flight[1], hashes[depth:])
            if depth:
                overlap[replica] = depth
        self._seen_of, self._seen = hashes, dict(overlap)
        return overlap, {}

    def engine_events(self, now: float, replica: str, events: list[CacheEvent]) -> None:
        pass

    def catch_up(self, now: float) -> None:
        pass


def _agreed(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """How many leading blocks two chains share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _directory(
    config: SimConfig, per_replica: int, clock: _Clock
) -> _PredictingDirectory | _EventDirectory | _SharedDirectory:
    if config.mode == PRECISE:
        # NOTE: events arrive in order, so the index never holds more than its engine did:
        # a capacity twice the engine's never evicts, and no TTL (an entry leaves by event)
        index = MemoryIndex(capacity_blocks=2 * per_replica + 1, ttl_s=math.inf, clock=clock)
        return _EventDirectory(index, config.event_delay_s, config.speculative_ttl_s)
    capacity = max(int(per_replica * config.directory_scale), 1)
    if config.gateways > 1 and CAPACITY not in config.as_one:
        ttl = 0.0 if PLACEMENTS in config.as_one else PLACEMENT_TTL_S
        generations = (
            _DistinctGenerationIndex(
                capacity, config.directory_ttl_s, clock, config.distinct_generations
            )
            if config.distinct_generations
            else _GenerationIndex(capacity, config.directory_ttl_s, clock)
        )
        return _SharedDirectory(generations, ttl)
    index = MemoryIndex(capacity_blocks=capacity, ttl_s=config.directory_ttl_s, clock=clock)
    if config.gateways > 1 and PLACEMENTS not in config.as_one:
        return _SharedDirectory(index, PLACEMENT_TTL_S)
    return _PredictingDirectory(index)


def simulate(
    trace: Trace,
    policy: str,
    config: SimConfig,
    refs: References,
    keys: Sequence[Keys] | None = None,
) -> PolicyResult:
    """Replay `trace` through `policy` in virtual time; see the module docstring."""
    wall0 = time.perf_counter()
    precise = config.mode == PRECISE
    weight = affinity_weight_for(config.affinity_weight, precise=precise)
    sticky = stickiness_for(config.stickiness, precise=precise)
    room = room_weight_for(config.room_weight, precise=precise)
    config = replace(
        config,
        router=replace(config.router, affinity_weight=weight, stickiness=sticky, room_weight=room),
    )
    peer = policy == SGLANG_MODEL
    profile = build_policy("least_load" if peer else policy, config.router)
    rng = random.Random(config.seed)
    clock = _Clock()
    per_replica = refs.capacity_blocks_per_replica
    kv_tokens = (
        {f"r{i}": float(per_replica * trace.block_size) for i in range(config.num_replicas)}
        if precise
        else {}
    )
    directory = _directory(config, per_replica, clock)
    frontiers = frontier_reader(profile) if precise else None
    conversations = _Conversations(frontiers.hot_s if frontiers is not None else 0.0)
    replicas = [
        _ReplicaState(
            f"r{i}", EngineCore(config.timing, BlockPool(per_replica, record_events=precise))
        )
        for i in range(config.num_replicas)
    ]
    by_id = {r.id: r for r in replicas}
    index_of = {r.id: i for i, r in enumerate(replicas)}
    gateways = _Gateways(
        config.gateways,
        config.load_share_interval_s,
        list(by_id),
        config.placement_delay_s,
        config.routing_s,
        config.pace,
        ahead=config.ahead and LOAD not in config.as_one,
    )
    rates = PrefixRates(clock=clock) if config.overflow and profile.locality else None
    # conversation affinity, as the gateway keeps it: looked up and recorded at each decision
    # (the homes, and each replica's room: the KV its live conversations come back for)
    homes = (
        ConversationAffinity(clock=clock)
        if profile.locality and (config.router.affinity_weight > 0 or config.router.room_weight)
        else None
    )
    overflow = OverflowConfig(
        config.timing.prefill_tokens_per_s * config.timing.time_scale,
        fixed_threshold_per_min=config.overflow_threshold_per_min,
    )
    if keys is None:
        keys = [request_keys(r, config.router.consistent_hash_blocks) for r in trace.requests]
    block = trace.block_size
    outcomes: list[RequestOutcome | None] = [None] * len(trace.requests)
    estimates: dict[str, tuple[_ReplicaState, float, TraceRequest, str, _Load]] = {}
    """Per job: its replica, estimated uncached tokens, request, reason and the load its
    gateway counts there."""
    best_blocks: dict[int, int] = {}
    outputs: dict[str, int] = {}
    decisions: dict[str, int] = {}
    sglang = SglangModel(list(by_id)) if peer else None

    # engine events come out of a heap keyed by each core's next event time
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        t = replicas[i].core.next_event_time()
        if t is not None:
            heapq.heappush(heap, (t, i))

    def publish(state: _ReplicaState, now: float) -> None:
        log = state.core.cache.log
        if log is not None:
            directory.engine_events(now, state.id, log.take())

    def drain(until: float) -> None:
        while heap and heap[0][0] <= until:
            t, i = heapq.heappop(heap)
            state = replicas[i]
            due = state.core.next_event_time()
            if due is None or due != t:
                continue  # a stale entry: the core's schedule moved
            gateways.rounds_until(t)
            clock.now = t
            for at, kind, job in state.core.advance(t):
                clock.now = at
                rep, estimate, req, reason, own = estimates[job.id]
                if kind == FIRST_TOKEN:
                    directory.first_token(rep.id, keys[req.index].hashes)
                    rep.pending_prefill_tokens = max(rep.pending_prefill_tokens - estimate, 0.0)
                    own.pending_prefill_tokens = max(own.pending_prefill_tokens - estimate, 0.0)
                else:
                    output = outputs.pop(job.id)
                    rep.num_inflight -= 1
                    rep.decode_tokens = max(rep.decode_tokens - output, 0.0)
                    own.num_inflight -= 1
                    own.decode_tokens = max(own.decode_tokens - output, 0.0)
                    conversations.finished(_conversation(req))
                    outcomes[req.index] = _outcome(
                        req, rep.id, job, reason, best_blocks.pop(req.index)
                    )
                    del estimates[job.id]
            publish(state, t)
            push(i)

    for position, req in enumerate(trace.requests):
        drain(req.arrival_s)
        clock.now = req.arrival_s
        gateway = position % config.gateways
        decided_s = gateways.decide_at(gateway, req.arrival_s)
        gateways.rounds_until(decided_s)
        seen: Callable[[str], _Load] | None = (
            None if LOAD in config.as_one else functools.partial(gateways.seen, gateway)
        )
        directory.catch_up(req.arrival_s)
        hs = keys[req.index].hashes
        overlap, claimed = directory.lookup(hs, clock.now)
        home = homes.lookup(hs) if homes is not None else None
        committed = homes.committed(home) if homes is not None and config.router.room_weight else {}
        route = RouteRequest(
            num_blocks=len(hs),
            num_prompt_tokens=float(req.input_length),
            overlap=overlap,
            claimed=claimed,
            tokens_per_block=float(block),
            affinity_key=keys[req.index].affinity,
            sequence=req.index,
            decode_token_weight=config.decode_token_weight,
            home=home.replica if home is not None else None,
            home_blocks=home.depth_blocks if home is not None else 0,
            committed=committed,
            peers=config.gateways - 1 if config.herd and LOAD not in config.as_one else 0,
            peer_rank=gateway,
        )
        looked_up = (decided_s - config.routing_s, position)
        seen = gateways.deciding_on(seen)
        snapshot = _snapshots(replicas, route, clock.now, frontiers, conversations, req, hs, seen)
        snapshot, route = gateways.with_ahead(profile, gateway, looked_up, snapshot, route)
        decision = (
            _decide(profile, route, snapshot, rng, hs, rates, overflow)
            if sglang is None
            else sglang.decide(
                hs, {r.id: r.num_inflight for r in replicas}, req.input_length, block
            )
        )
        gateways.looked_up(gateway, looked_up, route, decided_s, decision.replica)
        decisions[decision.reason] = decisions.get(decision.reason, 0) + 1
        # what the router counted held anywhere (a claim it did not count is not: `router.claims`)
        counted = counted_claims(route, snapshot).overlap
        best_blocks[req.index] = max(counted.values(), default=0)
        rep = by_id[decision.replica]
        if homes is not None:
            homes.record(hs, rep.id, home)
        directory.speculate(rep.id, hs, clock.now)
        # the load it adds there: no replica saves more than its KV (`router.capacity`)
        estimate = within_capacity(route, kv_tokens).uncached_tokens(rep.id)
        rep.num_inflight += 1
        rep.pending_prefill_tokens += estimate
        if frontiers is not None:
            rep.routed_s.update(dict.fromkeys(hs, clock.now))
        conversations.routed(_conversation(req), rep.id, clock.now, req.hash_ids)
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
        own = gateways.own[gateway][rep.id]
        own.num_inflight += 1
        own.pending_prefill_tokens += estimate
        own.decode_tokens += job.num_output_tokens
        gateways.placed(gateway, decided_s)
        estimates[job.id] = (rep, estimate, req, decision.reason, own)
        outputs[job.id] = job.num_output_tokens
        rep.decode_tokens += job.num_output_tokens
        rep.core.submit(req.arrival_s, job)
        publish(rep, req.arrival_s)
        push(index_of[rep.id])
    drain(float("inf"))
    assert not estimates, "every request finished"
    done = [o for o in outcomes if o is not None]
    return _result(
        policy, config.mode, done, replicas, refs, trace, decisions, time.perf_counter() - wall0
    )


class SglangModel:
    """sglang-router's `cache_aware` policy (sglang_router 0.3.2's defaults), as its source
    comment states it, on the simulator's blocks rather than its text:

    - the fleet is imbalanced when the most and least requests in flight differ by more than
      64 and the most exceeds 1.5x the least: then the fewest in flight;
    - else, when the longest prefix match in the router's own tree (every prompt it sent a
      worker, never evicted here: its 2^26-character cap is not reached on 1,000 prompts)
      covers more than 30% of the prompt: that worker;
    - else the worker whose tree is smallest (the fewest distinct blocks sent to it).

    The last branch, taken by most requests on a trace with few hits, balances the cumulative
    distinct prefill sent to each worker, whatever is queued there now."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self.trees: dict[str, set[BlockHash]] = {rid: set() for rid in replicas}

    def decide(
        self, hs: Sequence[BlockHash], inflight: dict[str, int], prompt_tokens: int, block: int
    ) -> Decision:
        ids = sorted(self.trees)
        most, least = max(inflight.values()), min(inflight.values())
        if most - least > SGLANG_BALANCE_ABS and most > SGLANG_BALANCE_REL * least:
            pick, reason = min(ids, key=lambda rid: (inflight[rid], rid)), "shortest_queue"
        else:
            match = {rid: self._match(rid, hs) for rid in ids}
            best = max(ids, key=lambda rid: (match[rid], -ids.index(rid)))
            if prompt_tokens > 0 and match[best] * block / prompt_tokens > SGLANG_CACHE_THRESHOLD:
                pick, reason = best, "prefix"
            else:
                pick, reason = min(ids, key=lambda rid: (len(self.trees[rid]), rid)), "no_match"
        self.trees[pick].update(hs)
        ranking = (pick, *(rid for rid in ids if rid != pick))
        return Decision(ranking, reason, policy=SGLANG_MODEL)

    def _match(self, rid: str, hs: Sequence[BlockHash]) -> int:
        tree = self.trees[rid]
        n = 0
        for h in hs:
            if h not in tree:
                break
            n += 1
        return n


def _decide(
    profile: RoutingProfile,
    route: RouteRequest,
    snapshot: list[Replica],
    rng: random.Random,
    hs: Sequence[BlockHash],
    rates: PrefixRates | None,
    overflow: OverflowConfig,
) -> Decision:
    """The gateway's routing step: the hot-prefix step (the same code), then the policy."""
    depth = max(route.overlap.values(), default=0)
    hot = None
    if rates is not None and depth > 0:
        observed = rates.observe(hs[depth - 1])
        hot = HotPrefix(observed.rate_per_min, observed.k)
    planned = plan(profile, route, snapshot, rng, hot, overflow)
    if planned.k is not None:
        assert rates is not None
        rates.set_k(hs[depth - 1], planned.k)
    assert planned.decision is not None, "every simulated replica is healthy"
    return planned.decision


def _snapshots(
    replicas: Sequence[_ReplicaState],
    route: RouteRequest,
    now: float,
    scorer: DisplacementScorer | None,
    conversations: _Conversations,
    req: TraceRequest,
    hs: Sequence[BlockHash] = (),
    seen: Callable[[str], _Load] | None = None,
) -> list[Replica]:
    """The router's view of every replica, each with its eviction frontier when the policy
    reads one (as deep as this request's placement there reaches, its queue's blocks first,
    with the other live conversations' own blocks there); with `seen`, the load one of several
    gateways counts there."""
    if scorer is None:
        return [r.snapshot(None, seen(r.id) if seen else None) for r in replicas]
    live = conversations.live(_conversation(req), req.hash_ids, now)
    out = []
    for r in replicas:
        load = seen(r.id) if seen else None
        frontier = r.frontier(
            scorer.depth_blocks(route, r.snapshot(None, load)),
            now,
            tuple(live.get(r.id, ())),
            hs[: route.overlap.get(r.id, 0)],
        )
        out.append(r.snapshot(frontier, load))
    return out


def _conversation(req: TraceRequest) -> str:
    """The request's conversation, or a name of its own when the trace gives none."""
    return req.conversation if req.conversation is not None else f"#{req.index}"


def _outcome(
    req: TraceRequest, replica: str, job: Job, reason: str, best_blocks: int
) -> RequestOutcome:
    assert job.first_token_s is not None and job.finish_s is not None
    return RequestOutcome(
        req.index,
        replica,
        req.arrival_s,
        req.input_length,
        job.cached_tokens,
        job.uncached_tokens,
        job.first_token_s - req.arrival_s,
        job.finish_s - req.arrival_s,
        reason,
        best_blocks,
    )


@dataclass(frozen=True, slots=True)
class SessionLosses:
    """Each request against its conversation's previous one, in arrival order: what the
    previous left (their shared leading blocks, capped at this input) minus what this one
    found, by whether it stayed on that replica, and per conversation."""

    lost_staying_tokens: int
    lost_moving_tokens: int
    num_moves: int
    num_blind_moves: int
    hops: dict[str, int]
    """Per conversation: its moves."""
    reprefill_tokens: dict[str, int]
    """Per conversation: the tokens its requests prefilled again."""


def session_losses(outcomes: Sequence[RequestOutcome], trace: Trace) -> SessionLosses:
    """See `SessionLosses`; requests without a conversation are left out."""
    by_index = {o.index: o for o in outcomes}
    last: dict[str, tuple[TraceRequest, str]] = {}
    hops: dict[str, int] = {}
    reprefill: dict[str, int] = {}
    staying = moving = moves = blind = 0
    for req in trace.requests:
        o = by_index.get(req.index)
        if o is None or req.conversation is None:
            continue
        conversation = req.conversation
        previous = last.get(conversation)
        last[conversation] = (req, o.replica)
        hops.setdefault(conversation, 0)
        reprefill.setdefault(conversation, 0)
        if previous is None:
            continue
        before, replica = previous
        shared = 0
        for a, b in zip(before.hash_ids, req.hash_ids, strict=False):
            if a != b:
                break
            shared += 1
        lost = max(_cached_tokens(shared, req, trace.block_size) - o.cached_tokens, 0)
        reprefill[conversation] += lost
        if o.replica == replica:
            staying += lost
        else:
            moving += lost
            moves += 1
            hops[conversation] += 1
            blind += 2 * o.best_blocks < shared
    return SessionLosses(staying, moving, moves, blind, hops, reprefill)


def _result(
    policy: str,
    mode: str,
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
    losses = session_losses(outcomes, trace)
    hops, reprefill = list(losses.hops.values()), list(losses.reprefill_tokens.values())
    return PolicyResult(
        policy=policy,
        mode=mode,
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
        evicted_blocks=sum(r.core.cache.num_evictions for r in replicas),
        lost_staying_tokens=losses.lost_staying_tokens,
        lost_moving_tokens=losses.lost_moving_tokens,
        num_moves=losses.num_moves,
        num_blind_moves=losses.num_blind_moves,
        session_hops_mean=statistics.fmean(hops) if hops else 0.0,
        session_hops_max=max(hops, default=0),
        session_reprefill_tokens_mean=statistics.fmean(reprefill) if reprefill else 0.0,
        session_reprefill_tokens_max=max(reprefill, default=0),
        sim_wall_s=wall_s,
        outcomes=outcomes,
    )


def run_policies(
    trace: Trace, policies: Sequence[str], config: SimConfig, modes: Sequence[str] = ()
) -> tuple[References, list[PolicyResult]]:
    """Every policy in every directory mode (default: the config's), over the same requests.
    A cache-blind policy reads no directory: it runs once, in approximate mode."""
    for name in policies:
        if name not in POLICIES and name != SGLANG_MODEL:
            raise ValueError(
                f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}"
            )
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown directory mode {mode!r}; choose one of {MODES}")
    keys = [request_keys(r, config.router.consistent_hash_blocks) for r in trace.requests]
    refs = references(trace, keys, config.capacity_frac, config.num_replicas)
    arms: list[tuple[str, str]] = []
    for mode in modes or (config.mode,):
        for name in policies:
            reads = name != SGLANG_MODEL and build_policy(name, config.router).locality
            arm = (name, mode if reads else APPROXIMATE)
            if arm not in arms:
                arms.append(arm)
    results = [simulate(trace, p, replace(config, mode=m), refs, keys) for p, m in arms]
    return refs, results


def at_utilization(trace: Trace, config: SimConfig, utilization: float) -> SimConfig:
    """The config with the engines' prefill rate set so that round robin keeps prefill
    `utilization` busy on this trace (what `kvgate bench --utilization` does)."""
    if not 0 < utilization < 1:
        raise ValueError(f"utilization must be between 0 and 1, got {utilization}")
    _, (rr,) = run_policies(trace, ["round_robin"], replace(config, mode=APPROXIMATE))
    rate = config.timing.prefill_tokens_per_s * rr.prefill_utilization / utilization
    return replace(config, timing=replace(config.timing, prefill_tokens_per_s=rate))


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
        "system prompt, faster than one replica), or agent-sessions[:sessions=160,concurrency=24,"
        "steps=50,...] (concurrent 50-step agent sessions growing past 100k tokens, "
        "loadgen.traces.sessions); default: the shipped Mooncake conversation trace",
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
        "--policy",
        default="all",
        help=f"one of {', '.join(POLICIES)}, a comma-separated list, or 'all' (default); "
        f"also {SGLANG_MODEL} (a model of sglang-router's cache_aware, not in 'all')",
    )
    parser.add_argument(
        "--mode",
        choices=(*MODES, "both"),
        default=APPROXIMATE,
        help="the directory: predicted (approximate, default), fed by the engines' KV events "
        "(precise), or both side by side; cache-blind policies run once",
    )
    parser.add_argument(
        "--event-delay-ms",
        type=float,
        default=DEFAULT_EVENT_DELAY_S * 1e3,
        help="precise mode: how late engine events reach the directory (default 50)",
    )
    parser.add_argument(
        "--speculative-ttl-s",
        type=float,
        default=DEFAULT_SPECULATIVE_TTL_S,
        help="precise mode: a placement's blocks count as held there this long before their "
        f"event, as the gateway's speculative_ttl_s (default {DEFAULT_SPECULATIVE_TTL_S:g})",
    )
    parser.add_argument(
        "--displacement-half-life-s",
        type=float,
        default=DEFAULT_DISPLACEMENT_HALF_LIFE_S,
        help="cache_pressure: past the hot horizon, seconds in which an evicted block's "
        "weight halves",
    )
    parser.add_argument(
        "--displacement-hot-s",
        type=float,
        default=DEFAULT_DISPLACEMENT_HOT_S,
        help="cache_pressure: an evicted block used less than this many seconds ago weighs a "
        "whole block (0: the weight decays from the start)",
    )
    parser.add_argument(
        "--displacement-weight",
        type=float,
        default=DEFAULT_DISPLACEMENT_WEIGHT,
        help="cache_pressure: a displaced recently used block's cost against a cached one "
        "(0: displacement only breaks ties)",
    )
    parser.add_argument(
        "--crowding-weight",
        type=float,
        default=DEFAULT_CROWDING_WEIGHT,
        help="cache_pressure: on a replica whose live conversations do not fit, the weight of "
        "moving the cheapest one (0: off, round 2's ranking)",
    )
    parser.add_argument(
        "--affinity-weight",
        type=float,
        default=None,
        help="cache_aware, cache_pressure: the weight of conversation affinity (the replica a "
        "conversation's previous request went to, kept after its KV is evicted; 0: off; "
        f"default: {DEFAULT_AFFINITY_WEIGHT:g} in precise mode, 0 in approximate mode, as the "
        "gateway)",
    )
    parser.add_argument(
        "--stickiness",
        type=float,
        default=None,
        help="cache_aware, cache_pressure: the home stays within the load bound while over it "
        "by less than this many times the tokens it holds (0: off; default: "
        f"{DEFAULT_STICKINESS:g} in precise mode, 0 in approximate mode, as the gateway)",
    )
    parser.add_argument(
        "--room-weight",
        type=float,
        default=None,
        help="cache_aware, cache_pressure: the weight of the room scorer (a turn with nothing "
        "cached anywhere goes where the live sessions leave room; 0: off; default: "
        f"{DEFAULT_ROOM_WEIGHT:g} in precise mode, 0 in approximate mode, as the gateway)",
    )
    parser.add_argument(
        "--session-level",
        choices=("on", "off"),
        default="on",
        help="cache_pressure: which session leaves a crowded replica is decided per session (a "
        "session that is not the cheapest there stays home; off: per request)",
    )
    parser.add_argument(
        "--balance-homes",
        choices=("on", "off"),
        default="on",
        help="cache_aware, cache_pressure: a conversation evicted everywhere leaves a home "
        "whose live conversations outweigh the least committed replica's by more than its own "
        "context (off: affinity credits every home)",
    )
    parser.add_argument(
        "--spread-sessions",
        choices=("on", "off"),
        default="on",
        help="cache_aware, cache_pressure: a new conversation matching only a short shared prefix "
        "may go to a replica whose live conversations are fewer than the prefix holders' by more "
        "than 4x its prompt (off: it follows the prefix)",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=None,
        help="set the prefill rate so that round robin keeps prefill this busy (as the bench)",
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
        "--gateways",
        type=int,
        default=DEFAULT_GATEWAYS,
        help="routers sharing one directory as gateways share Redis, requests round robin "
        "over them (default 1: one in-process gateway)",
    )
    parser.add_argument(
        "--load-share-interval-s",
        type=float,
        default=DEFAULT_LOAD_SHARE_INTERVAL_S,
        help="several gateways: how often each publishes its load and reads its peers' (trace "
        f"seconds; default {DEFAULT_LOAD_SHARE_INTERVAL_S:g}, the gateway's)",
    )
    parser.add_argument(
        "--placement-delay-ms",
        type=float,
        default=None,
        help="several gateways: each placement reaches the peers' load view this long after "
        "it (published at placement, read in each lookup; default: by the round only)",
    )
    parser.add_argument(
        "--routing-ms",
        type=float,
        default=0.0,
        help="several gateways: each decides its requests one after another, this long each "
        "(default 0)",
    )
    parser.add_argument(
        "--as-one",
        default="",
        help=f"several gateways: a comma-separated subset of {', '.join(AS_ONE)} modelled as "
        "one in-process gateway has it (every gateway's load known at once; an exact LRU "
        "directory; no placements in flight)",
    )
    parser.add_argument(
        "--distinct-generations",
        type=int,
        default=DISTINCT_GENERATIONS,
        metavar="K",
        help="several gateways: the Redis directory's capacity in K generations of 1/K of it, "
        f"the oldest dropped by the entries it still holds (default {DISTINCT_GENERATIONS}, "
        "as built; 0: the two generations of 3/4 before)",
    )
    parser.add_argument(
        "--pace",
        action="store_true",
        help="several gateways, with --placement-delay-ms: each decides its next request no "
        "sooner than that delay after its last (a model: what is left of the herd)",
    )
    parser.add_argument(
        "--herd",
        choices=("on", "off"),
        default="on",
        help="several gateways: each ranks a load tie by its place among the gateways, as the "
        "gateway's spread_herd (router.herd; default on)",
    )
    parser.add_argument(
        "--ahead",
        action="store_true",
        help="several gateways, with --placement-delay-ms: each decides on the published load "
        "with the requests looked up before its own placed first (router.ahead; live: the "
        "gateway's place_ahead setting)",
    )
    parser.add_argument(
        "--overflow",
        choices=("on", "off"),
        default="on",
        help="spread hot prefixes as the gateway does (cache_aware; default on)",
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")


def _sessions_table(results: Sequence[PolicyResult]) -> Any:
    """Per conversation: its hops between replicas, the share of them made blind (the
    directory showing its context gone everywhere), and the tokens it prefilled again."""
    from rich.table import Table

    table = Table(title="per conversation: hops and re-prefilled tokens")
    for column in (
        "policy",
        "moves",
        "blind",
        "hops mean",
        "hops max",
        "re-prefilled mean",
        "re-prefilled max",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in results:
        table.add_row(
            r.label,
            f"{r.num_moves:,}",
            f"{r.num_blind_moves / r.num_moves:.0%}" if r.num_moves else "-",
            f"{r.session_hops_mean:.1f}",
            f"{r.session_hops_max:,}",
            f"{r.session_reprefill_tokens_mean:,.0f}",
            f"{r.session_reprefill_tokens_max:,}",
        )
    return table


def config_from_args(args: argparse.Namespace) -> SimConfig:
    router = RouterConfig(
        displacement_half_life_s=args.displacement_half_life_s,
        displacement_hot_s=args.displacement_hot_s,
        displacement_weight=args.displacement_weight,
        crowding_weight=args.crowding_weight,
        session_level=args.session_level == "on",
        balance_homes=args.balance_homes == "on",
        spread_sessions=args.spread_sessions == "on",
    )
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
        affinity_weight=args.affinity_weight,
        stickiness=args.stickiness,
        room_weight=args.room_weight,
        seed=args.seed,
        max_output_tokens=args.max_output_tokens,
        directory_scale=args.directory_scale,
        overflow=args.overflow == "on",
        decode_token_weight=args.decode_token_weight,
        event_delay_s=args.event_delay_ms / 1e3,
        speculative_ttl_s=args.speculative_ttl_s,
        gateways=args.gateways,
        load_share_interval_s=args.load_share_interval_s,
        as_one=frozenset(item for item in args.as_one.split(",") if item),
        placement_delay_s=(
            args.placement_delay_ms / 1e3 if args.placement_delay_ms is not None else None
        ),
        routing_s=args.routing_ms / 1e3,
        herd=args.herd == "on",
        pace=args.pace,
        ahead=args.ahead,
        distinct_generations=args.distinct_generations,
    )


def _describe_gateways(config: SimConfig) -> str:
    if config.gateways == 1:
        return ""
    as_one = f", as one: {', '.join(sorted(config.as_one))}" if config.as_one else ""
    placements = (
        f", placements seen by the peers {config.placement_delay_s * 1e3:g} ms after"
        if config.placement_delay_s is not None
        else ""
    )
    routing = f", routing {config.routing_s * 1e3:g} ms a request" if config.routing_s else ""
    herd = "" if config.herd else ", herd rule off"
    if config.pace and config.placement_delay_s is not None:
        herd += ", paced"
    if config.ahead:
        herd += ", the requests looked up ahead placed first"
    if config.distinct_generations != DISTINCT_GENERATIONS:
        herd += f", the directory {config.distinct_generations} distinct generations"
        herd += " (0: two of 3/4, the rule before)" if not config.distinct_generations else ""
    return (
        f"\n{config.gateways} gateways on one shared directory, requests round robin, load "
        f"shared every {config.load_share_interval_s:g} s{placements}{routing}{herd}{as_one}"
    )


def _read(args: argparse.Namespace) -> Trace:
    if args.trace.startswith("hot-spine"):
        return hot_spine_trace(args.trace)
    if args.trace.startswith(SESSIONS_PREFIX):
        return agent_sessions_trace(args.trace)
    return read_trace(
        args.trace,
        block_size=args.block_size,
        start=args.start,
        limit=args.limit,
        num_tenants=args.tenants,
    )


def run_sim(args: argparse.Namespace) -> int:
    from rich.table import Table

    from loadgen.console import report_console

    console = report_console()
    try:
        config = config_from_args(args)
        policies = list(POLICIES) if args.policy == "all" else args.policy.split(",")
        modes = MODES if args.mode == "both" else (args.mode,)
        trace = _read(args)
        if args.utilization is not None:
            config = at_utilization(trace, config, args.utilization)
        refs, results = run_policies(trace, policies, config, modes)
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
        f"KV (approximate) or their events {config.event_delay_s * 1e3:g} ms late (precise); "
        f"seed {config.seed}{_describe_gateways(config)}"
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
        "evicted blocks",
        "sim s",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in results:
        table.add_row(
            r.label,
            f"{r.hit_ratio:.1%}",
            f"{r.share_of_ideal:.1%}",
            f"{r.share_of_lru_reference:.1%}",
            f"{r.ttft_mean_s:.3f}",
            f"{r.ttft_p50_s:.3f}",
            f"{r.ttft_p99_s:.3f}",
            f"{r.imbalance:.2f}",
            f"{r.prompt_imbalance:.2f}",
            f"{r.prefill_utilization:.2f}",
            f"{r.evicted_blocks:,}",
            f"{r.sim_wall_s:.1f}",
        )
    console.print(table)
    console.print(_sessions_table(results))
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
                "event_delay_s": config.event_delay_s,
                "gateways": config.gateways,
                "load_share_interval_s": config.load_share_interval_s,
                "as_one": sorted(config.as_one),
                "placement_delay_s": config.placement_delay_s,
                "routing_s": config.routing_s,
                "distinct_generations": config.distinct_generations,
            },
            "references": asdict(refs),
            "results": {r.label: r.summary() for r in results},
        }
        Path(args.json_out).write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
        console.print(f"wrote {args.json_out}")
    return 0
