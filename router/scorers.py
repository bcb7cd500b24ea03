"""Scorers: each maps every candidate to a score in [0, 1], higher is better (GIE style)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Protocol

import mmh3

from router.types import DecisionMemo, KvFrontier, Replica, RouteRequest

DEFAULT_DISPLACEMENT_HOT_S = 15.0
"""An evicted block used less than 15 s ago weighs a whole block: an agent's next step follows
its previous reply and one tool call (a 400-token reply at ~15 ms per token and a short tool
call: 5–15 s), so such a block belongs to a live conversation that will ask for it again.
docs/benchmarks-archive.md "round 2": 12 / 15 / 20 s gave 96.2 / 95.8 / 95.4% of the shared LRU on
the half-size agent-session run (half-life 5 s, weight 4): 15 s is the steps' upper end, kept
rather than tuned to one trace."""
DEFAULT_DISPLACEMENT_HALF_LIFE_S = 5.0
"""Past the hot horizon, an evicted block's weight halves every 5 s: a conversation silent for
longer than its steps take has likely ended, so losing it costs little. With no hot horizon
(the first round's form) half-lives of 10 / 30 / 100 s gave 95.5 / 94.2 / 89.3% of the shared
LRU on the half-size run (weight 8): a live block must not decay within its steps."""


SPREAD_MARGIN = 4
"""A new conversation leaves the holders of its short shared prefix for a replica committed
less than the least committed holder by more than this many times its own prompt
(`shared_prefix_credit`): markedly, so sessions still share the prefix while the fleet is even.
On the issue-shaped trace at 10% KV, seed 1, precise `cache_aware`'s p99 TTFT read 74.5 / 73.0 /
41.1 s at 1 / 2 / 4 (99.2 / 99.2 / 99.6% of the shared LRU): a smaller margin moved sessions
whose returns from their pauses then coincided on one replica (docs/precise.md, "New sessions
and the shared prefix")."""


def liveness(idle_s: float, hot_s: float, half_life_s: float) -> float:
    """How likely a block idle for `idle_s` is to be asked for again, as a weight in [0, 1]:
    1 within the hot horizon, then halving every `half_life_s`.

        liveness(t) = 1                           t < hot_s
                      2^(−(t − hot_s) / half_life_s)  otherwise
    """
    if idle_s < hot_s:
        return 1.0
    return float(0.5 ** ((idle_s - hot_s) / half_life_s))


class Scorer(Protocol):
    name: str

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]: ...


def _lower_is_better(values: dict[str, float]) -> dict[str, float]:
    """Min-max normalise so the smallest value scores 1 and the largest 0."""
    low, high = min(values.values()), max(values.values())
    if high <= low:
        return dict.fromkeys(values, 1.0)
    return {k: (high - v) / (high - low) for k, v in values.items()}


class PrefixScorer:
    """Share of the request's prompt blocks already cached on each replica."""

    name = "prefix"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        if req.num_blocks == 0:
            return {r.id: 0.0 for r in replicas}
        return {r.id: min(req.overlap.get(r.id, 0) / req.num_blocks, 1.0) for r in replicas}


class ConversationScorer:
    """The conversation's home (the replica its previous request went to, `RouteRequest.home`)
    scores the context that request built there and no replica holds any more:

        score(home) = max(home_blocks − max_r overlap[r], 0) / num_blocks,   0 elsewhere

    Beside the prefix scorer at weight 1, the home then ranks as if it still held the
    conversation's previous prompt: what approximate mode's memory of its own placements
    does, and what precise mode, exact about residency, lost — when a conversation's KV is
    evicted everywhere, every replica matches only the shared system prompt and the load
    tie-break sends each turn somewhere else (a hop, its whole context prefilled again there,
    evicting others as it goes: docs/precise.md, "Conversation affinity").

    A weaker signal than residency: where some replica still holds the conversation's
    context the credit shrinks by it (0 where one holds it all), so cached blocks decide as
    before; and like every scorer it ranks only within the load bound. With `crowded`
    (cache_pressure) the home earns nothing where the crowding rule picks this conversation as
    the one to leave (`CrowdingScorer`): when one session must move, that rule chooses which.
    With `balanced` it earns nothing where the home is outweighed (`outweighed_home`): a
    conversation back from a pause, its context evicted everywhere, leaves a home that its
    conversations' returns keep loaded for one the live sessions leave room on. Homed by
    affinity alone, the sessions a shared system prompt's first holder took in while the
    fleet filled stayed there, each return re-prefilling its context on it (the issue-shaped
    trace at 10% KV: 13 of the first 14 sessions, one replica 1.31× the mean prefill,
    imbalance 1.34; docs/precise.md, "Outweighed homes"). With `spread` a new conversation
    (no home) whose match is a short shared prefix credits the replicas markedly less
    committed than its holders with the prefix they lack (`shared_prefix_credit`).
    """

    name = "conversation"

    def __init__(self, crowded: bool = False, balanced: bool = False, spread: bool = False) -> None:
        self.crowded = crowded
        self.balanced = balanced
        self.spread = spread

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        out = dict.fromkeys((r.id for r in replicas), 0.0)
        home = req.home
        if home is None and self.spread and req.committed and req.num_blocks:
            loads = (memo or DecisionMemo(req)).loads(replicas)
            fit = RoomScorer.fit(req, replicas, loads)
            out.update(shared_prefix_credit(req, replicas, fit))
            return out
        if home is None or home not in out or req.num_blocks == 0:
            return out
        held = max(req.overlap.values(), default=0)
        credit = req.home_blocks - held
        if credit <= 0:
            return out
        if self.crowded:
            replica = next(r for r in replicas if r.id == home)
            if CrowdingScorer.cost_blocks(req, replica) > 0:
                return out
        if self.balanced and req.committed:
            loads = (memo or DecisionMemo(req)).loads(replicas)
            fit = RoomScorer.fit(req, replicas, loads)
            if outweighed_home(req, [r.id for r, ok in zip(replicas, fit, strict=True) if ok]):
                return out
        out[home] = min(credit / req.num_blocks, 1.0)
        return out


def outweighed_home(req: RouteRequest, fit: Sequence[str]) -> bool:
    """Whether the conversation's home is outweighed (issue 40, round 7): the other live
    conversations homed there (`RouteRequest.committed`) exceed those of the least committed
    replica equally fit by load (`fit`: `RoomScorer.fit`'s, where room would send a free move)
    by more than this conversation's own context (`home_blocks`),

        committed(home) − min over fit of committed(r) > home_blocks,

    so that moving it there evens the two homes without turning the difference round. Where
    the affinity credit applies no replica holds the conversation's context any more: the move
    is free (the context is prefilled again wherever the turn goes), and an outweighed home
    earns nothing for it.

    False without `committed` (room off: approximate mode's default), without a fit replica,
    and while the home has a claim the queue rule did not count (`RouteRequest.unclaimed`):
    the conversation's previous turn is queued there, and its prefill will store the context
    at home (moved then, the turn prefilled the context on a second replica and the next one
    came back: a session ping-ponged between two)."""
    home = req.home
    if home is None or not req.committed or not fit or home in req.unclaimed:
        return False
    committed = req.committed
    least = min(committed.get(rid, 0) for rid in fit)
    return committed.get(home, 0) - least > req.home_blocks


def shared_prefix_credit(
    req: RouteRequest, replicas: Sequence[Replica], fit: Sequence[bool]
) -> dict[str, float]:
    """A new conversation's credit (issue 40, round 8): the prefix match the best holders have
    and a fit replica lacks, where that replica is outweighed the other way,

        credit(r) = (held − overlap[r]) / num_blocks
                    where min over the holders of committed − committed(r)
                              > SPREAD_MARGIN × num_blocks
                    and 2 × held ≤ num_blocks,

    `held` the longest match among the candidates (its holders: the replicas with it), `fit`
    `RoomScorer.fit`'s. The request is mostly new context (its match at most half its
    prompt, e.g. a shared system prompt), so the credit buys only that short prefix's
    re-prefill, once for the conversation's whole life; it ties such a replica with the
    holders, and room sends the session to the least committed one. The difference shrinks
    and is never turned round (the session's own blocks are fewer than it, by
    `SPREAD_MARGIN`). Without it every new session matches the system prompt on its holders
    only, room (at 5% of the prompt) cannot outweigh that, and a replica that never held the
    prompt takes a session only when the holders are over the load bound
    (the issue-shaped trace at 25% KV: one replica got no request in the whole run)."""
    out: dict[str, float] = {}
    ids = [r.id for r in replicas]
    held = max((req.overlap.get(rid, 0) for rid in ids), default=0)
    if held == 0 or 2 * held > req.num_blocks:
        return out
    committed = req.committed
    holders = [rid for rid in ids if req.overlap.get(rid, 0) == held]
    bar = min(committed.get(rid, 0) for rid in holders) - SPREAD_MARGIN * req.num_blocks
    for rid, ok in zip(ids, fit, strict=True):
        if ok and committed.get(rid, 0) < bar:
            out[rid] = (held - req.overlap.get(rid, 0)) / req.num_blocks
    return out


def displacement_blocks(
    frontier: KvFrontier, need_blocks: int, half_life_s: float, hot_s: float = 0.0
) -> float:
    """Blocks' worth of live KV that `need_blocks` new blocks on this replica evict.

    The empty blocks go first; then the frontier's runs in eviction order, each evicted block
    weighing its `liveness` (1: used within `hot_s`; hot_s = 0 is the first round's plain
    2^(−idle_s / half_life_s)). A need past the empty and listed evictable blocks weighs 1 per
    block: the request waits for running ones to end."""
    left = need_blocks - frontier.empty_blocks
    cost = 0.0
    for num_blocks, idle_s in frontier.runs:
        if left <= 0:
            break
        taken = min(num_blocks, left)
        cost += taken * liveness(max(idle_s, 0.0), hot_s, half_life_s)
        left -= taken
    return cost + max(left, 0)


class DisplacementScorer:
    """A COST in [0, 1]: the recently used KV placing the request here would evict, as a share
    of the request's blocks (`displacement_blocks` over its uncached blocks on the replica).

    Weighted −w beside the prefix scorer (w = 4 by default), the profile maximises (cached − w ×
    displaced) blocks: a live block evicted now is one its owner prefills again when it
    returns, and on a full replica that prefill evicts the next owner's (w > 1 counts the
    cascade). 0 where the frontier is unknown or the need fits in empty blocks, so without
    cache pressure the profile's sums, hence its ranking, are cache_aware's exactly."""

    name = "displacement"

    def __init__(
        self,
        half_life_s: float = DEFAULT_DISPLACEMENT_HALF_LIFE_S,
        hot_s: float = DEFAULT_DISPLACEMENT_HOT_S,
        session_level: bool = False,
    ) -> None:
        if not half_life_s > 0:
            raise ValueError(f"the displacement half-life must be positive, got {half_life_s}")
        if not hot_s >= 0:
            raise ValueError(f"the displacement hot horizon must be non-negative, got {hot_s}")
        self.half_life_s = half_life_s
        self.hot_s = hot_s
        self.session_level = session_level

    @staticmethod
    def need_blocks(req: RouteRequest, replica: str) -> int:
        """New blocks placing the request on `replica` takes: its uncached ones."""
        return math.ceil(req.uncached_tokens(replica) / req.tokens_per_block)

    @staticmethod
    def queued_blocks(req: RouteRequest, replica: Replica) -> int:
        """Blocks the prefills queued on `replica` ahead of this request allocate before it
        does (an engine schedules FCFS and allocates at prefill start): its own need evicts
        past theirs. Empty blocks a replica shows while it has a queue are spoken for."""
        ahead = replica.pending_prefill_tokens + replica.foreign_prefill_tokens
        return math.ceil(ahead / req.tokens_per_block) if ahead > 0 else 0

    def depth_blocks(self, req: RouteRequest, replica: Replica) -> int:
        """How deep into `replica`'s eviction order this request's placement reaches: the
        queue's blocks, then its own (what a frontier producer must list)."""
        return self.queued_blocks(req, replica) + self.need_blocks(req, replica.id)

    def displaced_blocks(self, req: RouteRequest, replica: Replica) -> float:
        """What the request's own new blocks evict on `replica`, after the queue ahead took
        its share: displacement_blocks(queue + need) − displacement_blocks(queue); 0 without
        a frontier. With `session_level`, 0 at the home of a conversation that stays there
        (`stays_home`): which session moves is decided at the session level.

        Both sums in one walk of the frontier, each accumulated in `displacement_blocks`'s
        order (so the result is that difference to the bit; a property test holds it)."""
        frontier = replica.kv_frontier
        if frontier is None:
            return 0.0
        if self.session_level and stays_home(req, replica):
            return 0.0
        queued = self.queued_blocks(req, replica)
        left = queued + self.need_blocks(req, replica.id) - frontier.empty_blocks
        left_queued = queued - frontier.empty_blocks
        hot_s, half_life_s = self.hot_s, self.half_life_s
        cost = cost_queued = 0.0
        for num_blocks, idle_s in frontier.runs:
            if left <= 0:  # the queue's share is no deeper than the total: both are done
                break
            weight = liveness(max(idle_s, 0.0), hot_s, half_life_s)
            taken = min(num_blocks, left)
            cost += taken * weight
            left -= taken
            if left_queued > 0:
                taken = min(num_blocks, left_queued)
                cost_queued += taken * weight
                left_queued -= taken
        cost += max(left, 0)
        if queued:
            cost -= cost_queued + max(left_queued, 0)
        return max(cost, 0.0)

    @property
    def memo_key(self) -> str:
        """The name its displaced blocks go by in a `DecisionMemo` (one per parameter set)."""
        return f"displaced {self.half_life_s!r} {self.hot_s!r} {self.session_level!r}"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        if req.num_blocks == 0:
            return {r.id: 0.0 for r in replicas}
        displaced = (memo or DecisionMemo(req)).values(
            self.memo_key, replicas, self.displaced_blocks
        )
        return {
            r.id: min(blocks / req.num_blocks, 1.0)
            for r, blocks in zip(replicas, displaced, strict=True)
        }


def _elsewhere(req: RouteRequest, replica: str) -> int:
    """The most blocks of the request cached on any replica but `replica`."""
    return max((n for rid, n in req.overlap.items() if rid != replica), default=0)


def crowding(req: RouteRequest, replica: Replica) -> tuple[int, int, float]:
    """(overcommit, stake, cheapest) of placing `req` on `replica`: the blocks by which the
    request and the other live conversations there exceed its KV (<= 0: they fit; 0 when
    unknown), the request's stake there (its cached blocks beyond the most any other replica
    holds: what leaving costs it) and the smallest other live conversation's own blocks (what
    leaving costs the cheapest of the others; inf without one)."""
    frontier = replica.kv_frontier
    if frontier is None or frontier.capacity_blocks <= 0:
        return 0, 0, math.inf
    over = req.num_blocks + sum(frontier.live) - frontier.capacity_blocks
    stake = max(req.overlap.get(replica.id, 0) - _elsewhere(req, replica.id), 0)
    return over, stake, min(frontier.live, default=math.inf)


def stays_home(req: RouteRequest, replica: Replica) -> bool:
    """Which session moves, decided at the session level (issue 40): a conversation on its
    home replica stays there, and what its new blocks evict there is not counted against it,
    unless the home is crowded (`crowding`: this request and the other live conversations
    exceed its KV) and this conversation is the cheapest one there to move (its stake there
    no more than another's own blocks: the least re-prefill) — then the crowding rule moves
    it, and only it.

    Counted per request, a session returning to a home that had evicted its context (or part
    of it) read its re-prefill there as evicting live blocks (4 each) and went to whichever
    replica's KV was coldest, evicting sessions that were idle between steps, which came back
    evicted in turn: 12 hops and 1.1 M re-prefilled tokens per session on the issue-shaped
    trace at 10% KV (docs/precise.md, "Which session moves"). Displacement still counts
    everywhere else: a session moving onto another replica pays for what it evicts there.

    False off the home and for a conversation without one."""
    if req.home != replica.id:
        return False
    over, stake, cheapest = crowding(req, replica)
    return not (over > 0 and stake <= cheapest)


class CrowdingScorer:
    """A COST in [0, 1]: on a replica whose recent conversations need more KV than it holds,
    whether this request is the one that should leave.

    A replica is crowded for a request when the request's blocks and the other live
    conversations' own blocks (`KvFrontier.live`) exceed its capacity: whatever is placed, one
    of them will not fit, and until one leaves each step evicts the next one's tail (the
    replica thrashes). Leaving costs a conversation the context it has there (it prefills it
    again elsewhere), so the one that should leave is the cheapest: the request's stake on
    the replica against each other live conversation's own blocks (`crowding`). If the
    request is the cheapest, it pays its stake plus the overcommit (capped at its size): it
    moves to a replica where it fits, or stays if every other one is worse. If a cheaper
    conversation is there, it pays nothing here: that one leaves at its own next step, by the
    same rule. (What it evicts meanwhile is still `DisplacementScorer`'s: forgiving the
    cheaper one's blocks measured 96.6% of the shared LRU against 96.8% without, half size.)

    0 without a capacity or live conversations (approximate mode, events off) and when the
    replica is not crowded, so the profile's sums are unchanged then."""

    name = "crowding"

    @staticmethod
    def cost_blocks(req: RouteRequest, replica: Replica) -> float:
        """The cost in blocks of placing the request on `replica`."""
        over, stake, cheapest = crowding(req, replica)
        if over <= 0 or stake > cheapest:
            return 0.0
        return float(stake + min(over, req.num_blocks))

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        if req.num_blocks == 0:
            return {r.id: 0.0 for r in replicas}
        return {r.id: min(self.cost_blocks(req, r) / req.num_blocks, 1.0) for r in replicas}


class WorkAndDisplacementScorer:
    """Less (load + the live tokens a placement here would evict) scores higher: the
    prefill work now and the re-prefill it causes later, in one unit. `EstimatedWorkScorer`'s
    values exactly where nothing is displaced, so without pressure it ranks alike."""

    name = "work_and_displacement"

    def __init__(
        self,
        half_life_s: float = DEFAULT_DISPLACEMENT_HALF_LIFE_S,
        hot_s: float = DEFAULT_DISPLACEMENT_HOT_S,
        session_level: bool = False,
    ) -> None:
        self.displacement = DisplacementScorer(half_life_s, hot_s, session_level)

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        per_block = req.tokens_per_block
        memo = memo or DecisionMemo(req)
        displacement = self.displacement
        displaced = memo.values(displacement.memo_key, replicas, displacement.displaced_blocks)
        return _lower_is_better(
            {
                r.id: load + blocks * per_block
                for r, load, blocks in zip(replicas, memo.loads(replicas), displaced, strict=True)
            }
        )


class RoomScorer:
    """Less KV committed to other live conversations on the replica scores higher: the
    session-level half of placement (issue 40). `RouteRequest.committed` is each replica's
    conversations homed there and live (paused ones included: they come back for it).

    At a weight below one block's match it decides only where nothing is cached that tells
    replicas apart: a new conversation, or one back from a pause with its KV evicted
    everywhere, whose move is free (its context is prefilled again wherever it goes). It then
    goes where the other sessions leave room, rather than by the load tie-break (which sent it
    onto a replica whose paused sessions it then evicted: each came back evicted in turn, the
    hops docs/precise.md shows) or back home by affinity alone. Sessions spread by the KV they
    hold, so a replica's live sessions fit its KV more often, and the engines' LRU then evicts
    only the ended ones. 0 everywhere without homes (affinity off, or no conversation).

    Room never outranks load: it ranks only the replicas *equally fit by load*, those whose
    load is within this request's own prompt tokens of the least loaded candidate's,

        fit(r)  ⇔  load(r) ≤ min load + num_prompt_tokens
                   and foreign_prefill_tokens(r) ≤ min foreign_prefill_tokens

    (a wait shorter than the request's own prefill is no reason to choose, but work another
    gateway queued there is: this gateway sees it only as a count of waiting requests at a
    mean size, and room counts only this gateway's conversations); the others score 0, as low
    as the most committed fit one. A replica with another gateway's queue on it, or with this
    gateway's own prefills piled up, is then left to the load tie-break, which ranks it last
    (tests/e2e/test_engine_load.py: new prefixes steer away from a foreign queue with room on;
    with the load band alone, a queue drained to one waiting request of the new prompts' size
    was fit and room sent the fourth new prefix there). The simulator has one gateway: no
    foreign work, the band alone."""

    name = "room"

    @staticmethod
    def fit(req: RouteRequest, replicas: Sequence[Replica], loads: Sequence[float]) -> list[bool]:
        """Per replica, whether it is equally fit by load (see the class)."""
        limit = min(loads, default=0.0) + req.num_prompt_tokens
        foreign = [r.foreign_prefill_tokens for r in replicas]
        least_foreign = min(foreign, default=0.0)
        return [
            load <= limit and queued <= least_foreign
            for load, queued in zip(loads, foreign, strict=True)
        ]

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        committed = req.committed
        out = dict.fromkeys((r.id for r in replicas), 0.0)
        if not replicas:
            return out
        loads = (memo or DecisionMemo(req)).loads(replicas)
        fit = [r.id for r, ok in zip(replicas, self.fit(req, replicas, loads), strict=True) if ok]
        if fit:  # none when the least loaded has more foreign work than another: room abstains
            out.update(_lower_is_better({rid: float(committed.get(rid, 0)) for rid in fit}))
        return out


class EstimatedWorkScorer:
    """Less load (prefill work ahead of this request's first token, and weighted decode still
    running) scores higher."""

    name = "estimated_work"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        loads = (memo or DecisionMemo(req)).loads(replicas)
        return _lower_is_better({r.id: load for r, load in zip(replicas, loads, strict=True)})


class InflightScorer:
    """Fewer requests in flight from this gateway scores higher (the classic least-load)."""

    name = "inflight"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        return _lower_is_better({r.id: float(r.num_inflight) for r in replicas})


class RoundRobinScorer:
    """Replica number `sequence mod n` (in id order) scores 1, the next ones less, cyclically."""

    name = "round_robin"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        ids = sorted(r.id for r in replicas)
        n = len(ids)
        first = req.sequence % n if n else 0
        return {rid: 1.0 - ((i - first) % n) / n for i, rid in enumerate(ids)}


class RandomScorer:
    name = "random"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        return {r.id: rng.random() for r in replicas}


class RendezvousScorer:
    """Highest-random-weight hashing of the request's affinity key (its first K blocks).

    A replica joining or leaving moves only the keys it wins or held.
    """

    name = "consistent_hash"

    def score(
        self,
        req: RouteRequest,
        replicas: Sequence[Replica],
        rng: random.Random,
        memo: DecisionMemo | None = None,
    ) -> dict[str, float]:
        key = req.affinity_key
        return {
            r.id: mmh3.mmh3_x64_128_uintdigest(key + r.id.encode()) / 2.0**128 for r in replicas
        }
