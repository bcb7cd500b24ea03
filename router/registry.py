"""Routing policies by name: one explicit dict, no import side effects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.adapters import DEFAULT_ADAPTER_WEIGHT, AdapterFilter, AdapterScorer
from router.filters import (
    DEFAULT_ABSOLUTE_SLACK_TOKENS,
    DEFAULT_RELATIVE_SLACK,
    HealthyFilter,
    LoadBoundFilter,
)
from router.herd import TIE_BREAK
from router.profile import RoutingProfile
from router.scorers import (
    DEFAULT_DISPLACEMENT_HALF_LIFE_S,
    DEFAULT_DISPLACEMENT_HOT_S,
    ConversationScorer,
    CrowdingScorer,
    DisplacementScorer,
    EstimatedWorkScorer,
    InflightScorer,
    PrefixScorer,
    RandomScorer,
    RendezvousScorer,
    RoomScorer,
    RoundRobinScorer,
    WorkAndDisplacementScorer,
)

DEFAULT_CONSISTENT_HASH_BLOCKS = 4
"""Consistent hashing keys on the first 4 blocks (1 KB): hashing block 0 alone sends every
request to one replica when all prompts share a system prompt."""

DEFAULT_DISPLACEMENT_WEIGHT = 4.0
"""A live block a placement evicts costs four blocks it finds cached: its owner prefills it
again when it returns, and on a replica full of live sessions that prefill evicts the next
one's, and so on (each step of a thrashing replica re-prefills what the last one evicted).
docs/benchmarks-archive.md "round 2", half-size agent sessions: w = 1 / 2 / 4 / 8 gave 93.0 / 95.3 /
95.8 / 96.0% of the shared LRU with a p99 TTFT of 7.0 / 5.4 / 5.5 / 6.4 s. 0 keeps displacement
as a tie-break only, which the Mooncake slice at 10% prefers (its conversations rarely return:
a hot block there is seldom reused)."""

DEFAULT_CROWDING_WEIGHT = 1.0
"""A crowded replica's cheapest conversation pays its stake there and the overcommit, once, in
the prefix scorer's unit: it gives up exactly its advantage there, so it moves to a replica
where it fits and stays only if every other is worse (see `CrowdingScorer`).
docs/benchmarks-archive.md
"round 3": 96.6 / 96.8% of the shared LRU on the full / half-size agent sessions against round
2's 96.2 / 95.8 (weight 0)."""

DEFAULT_AFFINITY_WEIGHT = 1.0
"""Conversation affinity (`ConversationScorer`) at the prefix scorer's weight: a conversation
evicted everywhere goes back to its home as if the home still held its previous prompt, which
is what approximate mode's memory of its placements did (docs/precise.md, "Conversation
affinity", measures the weights). 0: off, the rankings of before issue 40."""


DEFAULT_ROOM_WEIGHT = 0.05
"""The room scorer (`RoomScorer`) at 5% of the prefix scorer's range (room outweighs at most 5%
of the prompt's blocks cached), in precise mode (`room_weight_for`): it decides where a
conversation with nothing cached anywhere goes (a new one, or one back from a pause evicted
everywhere, whose move is free), among the replicas equally fit by load only (within the
request's own prompt tokens of the least loaded, no more foreign queued work), so it never
outranks the load (tests/e2e/test_engine_load.py). With the queue rule for claims
(`router.claims`) it is what keeps sessions spread: on the issue-shaped trace, precise
`cache_pressure` without it reads 95.4% of the shared LRU at 25% KV (imbalance 2.29), with it
98.9% (docs/precise.md, "The queued turn"). Sweep of the weight: docs/precise.md, "Room": 0.001
/ 0.05 / 0.3 / 1 gave 92.3 / 93.4 / 93.2 / 92.6% of the shared LRU."""

DEFAULT_STICKINESS = 1.0
"""A conversation's home stays within the load bound while its load over the bound is less
than once the tokens it holds there (see `LoadBoundFilter`): leaving costs their re-prefill
elsewhere now and the KV it displaces there. docs/precise.md, "Room": 1 / 2 / 4 gave 93.9 /
94.1 / 94.2% of the shared LRU with p99 TTFT 42.8 / 45.7 / 57.7 s and imbalance 1.21 / 1.27 /
1.38 (0: 93.4%, 45.2 s, 1.19)."""


def stickiness_for(configured: float | None, precise: bool) -> float:
    """The stickiness a mode routes with: the one configured, else `DEFAULT_STICKINESS` in
    precise mode and 0 in approximate mode, whose predicted overlap at the home is stale (it
    still counts blocks the engine evicted): the extra slack there kept sessions home past
    their real wait (25% KV: 94.4% of the shared LRU, imbalance 2.45, against 97.8% without)."""
    if configured is not None:
        return configured
    return DEFAULT_STICKINESS if precise else 0.0


def room_weight_for(configured: float | None, precise: bool) -> float:
    """The room weight a mode routes with: the one configured, else `DEFAULT_ROOM_WEIGHT` in
    precise mode and 0 in approximate mode, where it kept sessions home past their wait (p99
    TTFT 268 s against 254 s at 10% KV on the issue-shaped trace) and widened the simulator's
    property sweep at 5% KV (approximate gains more from it there than precise does)."""
    if configured is not None:
        return configured
    return DEFAULT_ROOM_WEIGHT if precise else 0.0


def affinity_weight_for(configured: float | None, precise: bool) -> float:
    """The affinity weight a mode routes with: the one configured, else `DEFAULT_AFFINITY_WEIGHT`
    in precise mode and 0 in approximate mode, whose prediction already remembers where each
    conversation went (evicted blocks stay predicted until their TTL): measured, affinity on top
    of it read 93.1% of the shared LRU against 96.2% without at 25% KV (docs/precise.md)."""
    if configured is not None:
        return configured
    return DEFAULT_AFFINITY_WEIGHT if precise else 0.0


_TIE_BREAK = TIE_BREAK
"""Weight of the load scorer in `cache_aware`: below 1/num_blocks for any real prompt, so it
only breaks ties between equal matches (`router.herd` reads the ties it decides)."""


@dataclass(frozen=True)
class RouterConfig:
    absolute_slack_tokens: float = DEFAULT_ABSOLUTE_SLACK_TOKENS
    relative_slack: float = DEFAULT_RELATIVE_SLACK
    consistent_hash_blocks: int = DEFAULT_CONSISTENT_HASH_BLOCKS
    displacement_half_life_s: float = DEFAULT_DISPLACEMENT_HALF_LIFE_S
    displacement_hot_s: float = DEFAULT_DISPLACEMENT_HOT_S
    """cache_pressure: an evicted block used less than this long ago weighs a whole block."""
    displacement_weight: float = DEFAULT_DISPLACEMENT_WEIGHT
    """cache_pressure: what a displaced recently used block costs against a cached one."""
    crowding_weight: float = DEFAULT_CROWDING_WEIGHT
    """cache_pressure: the weight of `CrowdingScorer` (0: off, round 2's ranking)."""
    affinity_weight: float = DEFAULT_AFFINITY_WEIGHT
    """cache_aware, cache_pressure: the weight of `ConversationScorer` (0: off)."""
    adapter_weight: float = DEFAULT_ADAPTER_WEIGHT
    """The locality policies: the weight of `AdapterScorer`, a resident LoRA adapter (0: off)."""
    room_weight: float = 0.0
    """cache_aware, cache_pressure: the weight of `RoomScorer` (0: off; the gateway and `kvgate
    sim` set the mode's, `room_weight_for`)."""
    stickiness: float = DEFAULT_STICKINESS
    """cache_aware, cache_pressure: the home's extra load slack in tokens it holds (0: off)."""
    session_level: bool = True
    """cache_pressure: which session leaves a crowded replica is decided per session
    (`router.scorers.stays_home`); False: per request, as before issue 40's round 3."""
    balance_homes: bool = True
    """cache_aware, cache_pressure: the affinity credit skips an outweighed home
    (`router.scorers.outweighed_home`: its live conversations exceed the least committed
    candidate's by more than this one's context), so a free move evens the homes; False: the
    credit as before issue 40's round 7. Acts only with room on (it reads `committed`)."""
    spread_sessions: bool = True
    """cache_aware, cache_pressure: a new conversation whose match is a short shared prefix may
    go to a replica whose live conversations are fewer than the prefix holders' by more than
    `router.scorers.SPREAD_MARGIN` times its prompt (`router.scorers.shared_prefix_credit`);
    False: as before issue 40's round 8. Acts only with room and affinity on."""

    def __post_init__(self) -> None:
        if self.crowding_weight < 0:
            raise ValueError(f"crowding_weight must be non-negative, got {self.crowding_weight}")
        if self.room_weight < 0 or self.stickiness < 0:
            raise ValueError(
                f"room_weight and stickiness must be non-negative, got {self.room_weight} and "
                f"{self.stickiness}"
            )
        if self.affinity_weight < 0:
            raise ValueError(f"affinity_weight must be non-negative, got {self.affinity_weight}")
        if self.adapter_weight < 0:
            raise ValueError(f"adapter_weight must be non-negative, got {self.adapter_weight}")
        if self.displacement_weight < 0:
            raise ValueError(
                f"displacement_weight must be non-negative, got {self.displacement_weight}"
            )


def cache_aware(config: RouterConfig) -> RoutingProfile:
    """The longest cached prefix among the replicas within the load bound (for a LoRA adapter:
    among those where it is resident, or can be loaded without thrashing: `router.adapters`)."""
    return RoutingProfile(
        "cache_aware",
        (
            HealthyFilter(),
            AdapterFilter(),
            LoadBoundFilter(config.absolute_slack_tokens, config.relative_slack, config.stickiness),
        ),
        (
            (PrefixScorer(), 1.0),
            (EstimatedWorkScorer(), _TIE_BREAK),
            (
                ConversationScorer(balanced=config.balance_homes, spread=config.spread_sessions),
                config.affinity_weight,
            ),
            (AdapterScorer(), config.adapter_weight),
            (RoomScorer(), config.room_weight),
        ),
        locality=True,
    )


def cache_pressure(config: RouterConfig) -> RoutingProfile:
    """`cache_aware` that also counts what a placement evicts: among the replicas within the
    load bound, the most cached blocks minus `displacement_weight` × the live blocks (used
    within `displacement_hot_s`, then decaying) the request's new ones would displace
    (`DisplacementScorer`, from each replica's eviction frontier), ties going to the least
    load + displaced tokens. Without a frontier (approximate mode, events off) or without
    pressure it ranks exactly as `cache_aware`.

    A policy of its own rather than a term inside `cache_aware`: the default stays what it was
    measured to be, and the two can run side by side in one `kvgate sim` run."""
    return RoutingProfile(
        "cache_pressure",
        (
            HealthyFilter(),
            AdapterFilter(),
            LoadBoundFilter(config.absolute_slack_tokens, config.relative_slack, config.stickiness),
        ),
        (
            (PrefixScorer(), 1.0),
            # NOTE: a negative weight: the scorer is a cost, and adding −0.0 leaves every sum
            # bit-identical to cache_aware's when nothing would be displaced
            (
                DisplacementScorer(
                    config.displacement_half_life_s,
                    config.displacement_hot_s,
                    config.session_level,
                ),
                -config.displacement_weight,
            ),
            (CrowdingScorer(), -config.crowding_weight),
            (
                WorkAndDisplacementScorer(
                    config.displacement_half_life_s,
                    config.displacement_hot_s,
                    config.session_level,
                ),
                _TIE_BREAK,
            ),
            (
                ConversationScorer(
                    crowded=True,
                    balanced=config.balance_homes,
                    spread=config.spread_sessions,
                ),
                config.affinity_weight,
            ),
            (AdapterScorer(), config.adapter_weight),
            (RoomScorer(), config.room_weight),
        ),
        locality=True,
    )


def round_robin(config: RouterConfig) -> RoutingProfile:
    return RoutingProfile("round_robin", (HealthyFilter(),), ((RoundRobinScorer(), 1.0),))


def random_choice(config: RouterConfig) -> RoutingProfile:
    return RoutingProfile("random", (HealthyFilter(),), ((RandomScorer(), 1.0),))


def least_load(config: RouterConfig) -> RoutingProfile:
    """Fewest requests in flight, ties at random: blind to the cache, as the peers' baseline."""
    return RoutingProfile("least_load", (HealthyFilter(),), ((InflightScorer(), 1.0),))


def consistent_hash(config: RouterConfig) -> RoutingProfile:
    return RoutingProfile("consistent_hash", (HealthyFilter(),), ((RendezvousScorer(), 1.0),))


def cache_aware_local(config: RouterConfig) -> RoutingProfile:
    """`cache_aware` while the shared directory is away: the overlap comes from this gateway's
    own records, and ties (above all: no match anywhere) go by consistent hashing of the first
    blocks, so every gateway still sends a new prefix to the same replica."""
    return RoutingProfile(
        "cache_aware_local",
        (
            HealthyFilter(),
            AdapterFilter(),
            LoadBoundFilter(config.absolute_slack_tokens, config.relative_slack),
        ),
        (
            (PrefixScorer(), 1.0),
            (RendezvousScorer(), _TIE_BREAK),
            (AdapterScorer(), config.adapter_weight),
        ),
        locality=True,
    )


POLICIES: dict[str, Callable[[RouterConfig], RoutingProfile]] = {
    "cache_aware": cache_aware,
    "cache_pressure": cache_pressure,
    "round_robin": round_robin,
    "random": random_choice,
    "least_load": least_load,
    "consistent_hash": consistent_hash,
}


FALLBACKS: dict[str, Callable[[RouterConfig], RoutingProfile]] = {
    "cache_aware": cache_aware_local,
    "cache_pressure": cache_aware_local,
}
"""What a policy becomes while the shared directory does not answer (others are unchanged)."""


def build_fallback(name: str, config: RouterConfig | None = None) -> RoutingProfile:
    factory = FALLBACKS.get(name)
    return factory(config or RouterConfig()) if factory else build_policy(name, config)


def build_policy(name: str, config: RouterConfig | None = None) -> RoutingProfile:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
    return factory(config or RouterConfig())


def frontier_reader(profile: RoutingProfile) -> DisplacementScorer | None:
    """The policy's scorer that reads eviction frontiers, if it has one (`cache_pressure`)."""
    for scorer, _ in profile.scorers:
        if isinstance(scorer, DisplacementScorer):
            return scorer
        inner = getattr(scorer, "displacement", None)
        if isinstance(inner, DisplacementScorer):
            return inner
    return None
