"""The snapshot a routing decision sees."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter


@dataclass(frozen=True, slots=True)
class KvFrontier:
    """What a replica's KV cache gives up next, as an engine's own events and the gateway's
    routing reveal it (issue 16, placement under cache pressure).

    `empty_blocks` an allocation takes before it evicts anything. `runs` are the evictable
    cached blocks (held by no running request) in the engine's eviction order, next evicted
    first, as (num_blocks, idle_s) with idle_s the seconds since those blocks were last used.
    A producer may stop listing past the deepest eviction any placement would cause; blocks
    past the listed ones count as not evictable (a request needing them waits, or preempts).

    `capacity_blocks` and `live` say who else needs the replica soon: the KV it holds in all,
    and, for every other conversation the router sent there recently (within the hot horizon,
    or still running), the blocks its next request needs beyond those it shares with this
    request (its own context). 0 and () are "unknown": the crowding rule then never applies.
    """

    empty_blocks: int
    runs: tuple[tuple[int, float], ...] = ()
    capacity_blocks: int = 0
    live: tuple[int, ...] = ()

    @property
    def num_evictable_listed(self) -> int:
        return sum(n for n, _ in self.runs)


@dataclass(frozen=True, slots=True)
class Replica:
    """One engine replica as the router sees it at decision time.

    `pending_prefill_tokens` is the prefill work the gateway has sent to the replica whose first
    token has not come back yet: what a new request queues behind (vLLM schedules FCFS).
    `foreign_prefill_tokens` is what other gateways queued there, seen through the engine's
    metrics; every default is "unknown / none", so a snapshot without signals means what it
    meant before they existed.
    """

    id: str
    healthy: bool = True
    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    # -- engine load signals (issue 9): what the engine's /metrics said at the last scrape ----
    engine_num_waiting: float = 0.0
    """Requests queued at the engine (scheduled by no one yet), from every gateway."""
    own_num_waiting: float = 0.0
    """This gateway's requests on the replica that were still before their first token when
    that scrape answered: the part of `engine_num_waiting` already in `pending_prefill_tokens`
    (an over-count when one of them was already prefilling, so the foreign part errs low)."""
    foreign_request_tokens: float = 0.0
    """Prefill tokens assumed per request another gateway queued (this gateway's mean uncached
    tokens per request: gateways behind one Service see the same traffic)."""

    # -- decode occupancy (issue 14): what the replica is still generating ---------------------
    decode_tokens: float = 0.0
    """Output tokens still expected from this gateway's requests on the replica (each counted
    at its expected length from its routing to its end: on average twice what is left, on every
    replica alike, so comparisons between replicas hold)."""
    engine_num_running: float = 0.0
    """Requests the engine's /metrics said were running (vllm:num_requests_running)..."""
    own_num_running: float = 0.0
    """...of which this gateway's (its requests in flight there when that scrape answered)."""
    request_output_tokens: float = 0.0
    """Output tokens assumed per request another gateway runs there (this gateway's mean)."""
    kv_frontier: KvFrontier | None = None
    """The replica's eviction frontier when precise mode knows it (None: unknown)."""

    def with_frontier(self, frontier: KvFrontier | None) -> Replica:
        """This snapshot with `frontier` (precise mode annotates every candidate per request:
        `dataclasses.replace` was ~40% of that at 256 replicas, cProfile)."""
        return _NEW_REPLICA(*_ALL_BUT_FRONTIER(self), frontier)

    @property
    def decode_work_tokens(self) -> float:
        """Output tokens the replica is still to generate: this gateway's, and other gateways'
        running requests (seen through the engine's metrics) at the mean length."""
        foreign = self.engine_num_running - self.own_num_running
        return self.decode_tokens + (foreign * self.request_output_tokens if foreign > 0 else 0.0)

    @property
    def foreign_prefill_tokens(self) -> float:
        """Prefill work other gateways have queued on the replica: the engine's waiting
        requests this gateway did not send, each at `foreign_request_tokens`. 0 without
        engine signals, so a lone gateway's estimate is unchanged."""
        foreign = self.engine_num_waiting - self.own_num_waiting
        return foreign * self.foreign_request_tokens if foreign > 0 else 0.0


_ALL_BUT_FRONTIER = attrgetter(*(f.name for f in fields(Replica)[:-1]))
"""Every field of a `Replica` but its last, `kv_frontier`, as one tuple in field order (a test
holds `with_frontier` to `dataclasses.replace`)."""
_NEW_REPLICA: Callable[..., Replica] = Replica
"""`Replica` called with those fields and a frontier by position (mypy cannot count a
tuple of Any)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about one request.

    `overlap[replica]` is the number of leading blocks of the prompt cached there (absent = 0);
    `tokens_per_block` converts blocks to tokens, so uncached work is counted in tokens;
    `decode_token_weight` converts a replica's outstanding output tokens into prefill tokens of
    work (0: decode is not counted, as before decode occupancy was a signal).
    """

    num_blocks: int
    num_prompt_tokens: float
    overlap: Mapping[str, int] = field(default_factory=dict)
    tokens_per_block: float = 64.0
    affinity_key: bytes = b""
    sequence: int = 0
    decode_token_weight: float = 0.0
    offloaded: Mapping[str, int] = field(default_factory=dict)
    """Of `overlap[replica]`, blocks the replica holds on no GPU (a CPU or storage tier, known
    from KV events): cached, but each costs `offload_cost` of prefilling it to load back."""
    offload_cost: float = 0.0
    home: str | None = None
    """The replica this request's conversation went to last (`cachemap.affinity`), kept after
    its KV was evicted everywhere; None: a new conversation, or affinity off."""
    home_blocks: int = 0
    """...and the blocks of that previous request: the context the conversation built there."""
    adapter_slots: Mapping[str, int] = field(default_factory=dict)
    """The request's LoRA adapter at each replica: `router.adapters` RESIDENT / LOADABLE /
    FULL (absent: LOADABLE); empty for the base model."""
    claimed: Mapping[str, int] = field(default_factory=dict)
    """Of `overlap[replica]`, blocks only a placement's speculative entry claims there (a
    prompt placed on the replica whose prefill has not stored it yet: precise mode); absent =
    0. Whether they count is `router.claims.counted_claims`'s rule."""
    committed: Mapping[str, int] = field(default_factory=dict)
    """Per replica, the blocks of the other conversations whose home it is and that are live
    (routed within the session horizon, paused ones included): the KV they will come back for
    (`cachemap.affinity.ConversationAffinity.committed`; absent = 0)."""
    unclaimed: Mapping[str, int] = field(default_factory=dict)
    """Per replica, the claimed blocks `router.claims` did not count (taken out of `overlap`
    and `claimed`: the placement they speak for is queued behind more than its re-prefill
    elsewhere); empty until that rule ran, and where every claim counts."""
    peers: int = 0
    """Other gateways routing on the same Redis (their load entries live): 0 for a gateway
    alone, which routes as it always did. With peers, a tie between equally good replicas is
    ranked as the gateways' requests of one instant would be placed in the order of their
    ids (`router.herd`)."""
    peer_rank: int = 0
    """This gateway's place in that order: how many of the live gateways' ids sort before its
    own (0 to `peers`)."""

    def uncached_tokens(self, replica: str) -> float:
        cached = self.overlap.get(replica, 0) * self.tokens_per_block
        uncached = max(self.num_prompt_tokens - cached, 0.0)
        offloaded = self.offloaded.get(replica, 0) if self.offloaded else 0
        if offloaded:
            uncached += self.offload_cost * offloaded * self.tokens_per_block
        return uncached

    def estimated_work(self, replica: Replica) -> float:
        """Prefill tokens that must run on `replica` before this request's first token: this
        gateway's pending prefills, other gateways' queued ones, and this request's own."""
        return (
            replica.pending_prefill_tokens
            + replica.foreign_prefill_tokens
            + self.uncached_tokens(replica.id)
        )

    def load(self, replica: Replica) -> float:
        """What the load bound compares, in prefill tokens: the prefill work before this
        request's first token (`estimated_work`) plus the decode the replica still runs,
        weighted (a decoded token takes a share of the engine's steps that prefill would
        otherwise use)."""
        return self.estimated_work(replica) + self.decode_token_weight * replica.decode_work_tokens


class DecisionMemo:
    """One decision's per-replica arithmetic, each value computed at most once.

    Several filters and scorers of a profile read the same value of a replica: `cache_aware`'s
    load bound and its tie-break both read `RouteRequest.load`, `cache_pressure`'s
    displacement cost and its tie-break both read what a placement evicts. At fleet size that
    arithmetic is the decision's cost (`python -m tools.route_cost`: about half of it was the
    loads, each computed twice). `RoutingProfile.decide` makes one memo per decision and hands
    it to each filter and scorer; a filter or scorer called without one makes its own.

    `what` names the value; values of one name must come from the same function of
    (request, replica), whoever asks first.
    """

    __slots__ = ("_values", "req")

    def __init__(self, req: RouteRequest) -> None:
        self.req = req
        self._values: dict[str, dict[str, float]] = {}

    def values(
        self,
        what: str,
        replicas: Sequence[Replica],
        compute: Callable[[RouteRequest, Replica], float],
    ) -> list[float]:
        """`compute(req, replica)` of each replica, in order, each computed once per decision."""
        known = self._values.get(what)
        if known is None:
            known = self._values[what] = {}
        req, out = self.req, []
        for replica in replicas:
            value = known.get(replica.id)
            if value is None:
                value = known[replica.id] = compute(req, replica)
            out.append(value)
        return out

    def loads(self, replicas: Sequence[Replica]) -> list[float]:
        """`RouteRequest.load` of each replica."""
        return self.values("load", replicas, RouteRequest.load)


@dataclass(frozen=True, slots=True)
class Decision:
    """A ranking of replicas, best first (the rest are fallbacks for retries).

    `reason` says why the first was chosen: "prefix" (longest match within the load bound),
    "load_bound" (a longer match existed but was over the bound), "no_match", or the policy
    name for the baselines.
    """

    ranking: tuple[str, ...]
    reason: str
    matched_blocks: int = 0
    scores: tuple[float, ...] = ()
    """Each ranked replica's weighted score, in ranking order (a demoted replica's within the
    demoted group, ranked after every eligible one): what a route receipt shows."""
    policy: str = ""
    """The profile that decided (the local fallback's while the shared directory is away)."""

    @property
    def replica(self) -> str:
        return self.ranking[0]
