"""What placement alone can win on issue 16's two hit-ratio goals (docs/benchmarks-archive.md,
"The two open goals' ceilings").

    python -m tools.ceilings mooncake [START LIMIT]    bench point 2's slice (4000 4000)
    python -m tools.ceilings sessions [SPEC REPLICAS]  the agent sessions (agent-sessions 8)

Both at 10% KV (`CAPACITY_FRAC`), sized as `loadgen.sim.references` sizes them.

`mooncake`: the Mooncake conversation slice of bench point 2. One shared LRU of the fleet's
capacity against the same LRU told which blocks are ever used again (an admission oracle: a
router cannot tell an engine what not to keep, so this is the headroom no placement reaches);
then whether anything a router sees when a request arrives tells those blocks apart (its
kind, its length, its output class); what placing unmatched requests by unequal weights
does (four LRUs of a quarter each, `WEIGHTS`, `SEEDS`); and how far ahead a reuse comes, in
blocks stored between, against the fleet's capacity.

`sessions`: an agent-session trace. How full the fleet's KV is with the live sessions' own
blocks (the shared system prompt once), the largest session against one replica, and the
requests that land on an over-full replica when every session is placed at its first step,
for its whole life, knowing every session's future sizes (best fit by the peak it would
reach), with no moves. One shared LRU has no partition to overflow; a partition either
overflows (the LRU evicts a live session's context) or moves sessions (they prefill their
context again).
"""

from __future__ import annotations

import bisect
import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadgen.traces.readers import Trace, TraceRequest, read_trace
from loadgen.traces.sessions import agent_sessions_trace

CAPACITY_FRAC = 0.10
MOONCAKE = (
    Path(__file__).resolve().parent.parent / "loadgen/traces/mooncake/conversation_trace.jsonl"
)
MOONCAKE_BLOCK = 512
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
LENGTH_BUCKETS = (8, 16, 32, 48)
"""Prompt length classes in blocks: below 8, 8–15, ..., 48 and above."""
OUTPUT_EDGE = 50
"""Output classes: below 50 tokens and from 50 (`kvgate bench` caps `max_tokens` at 64, so a
router there sees no finer class)."""
WEIGHTS = ((1, 1, 1, 1), (2, 1, 1, 1), (4, 3, 2, 1), (10, 1, 1, 1))
SEEDS = (0, 1, 2)


class Lru:
    """An engine's prefix cache in blocks: hits are the longest cached prefix, the least
    recently used block goes first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cached: OrderedDict[int, None] = OrderedDict()

    def match(self, ids: Sequence[int]) -> int:
        n = 0
        for h in ids:
            if h not in self.cached:
                break
            n += 1
        return n

    def store(self, ids: Sequence[int], keep: Sequence[bool] | None = None) -> None:
        """Store (or touch) the blocks; with `keep`, block j only where keep[j] (the rest
        are used and dropped)."""
        cached = self.cached
        for j, h in enumerate(ids):
            if keep is None or keep[j]:
                cached[h] = None
                cached.move_to_end(h)
            else:
                cached.pop(h, None)
        while len(cached) > self.capacity:
            cached.popitem(last=False)


def _hit_tokens(req: TraceRequest, blocks: int, block_size: int) -> int:
    return min(blocks * block_size, req.input_length)


def lru_hit_ratio(
    trace: Trace, capacity: int, keep: Sequence[Sequence[bool]] | None = None
) -> float:
    """Engine-style prefix hits (cached tokens ÷ input tokens) of one LRU of `capacity`
    blocks over the trace in order; with `keep`, a request's block j is stored only where
    keep[i][j]."""
    lru = Lru(capacity)
    hit = total = 0
    for i, req in enumerate(trace.requests):
        hit += _hit_tokens(req, lru.match(req.hash_ids), trace.block_size)
        total += req.input_length
        lru.store(req.hash_ids, None if keep is None else keep[i])
    return hit / total if total else 0.0


def weighted_partition_hit_ratio(
    trace: Trace, capacity: int, weights: Sequence[float], seed: int
) -> float:
    """One LRU per weight, `capacity` split evenly: a request goes where its longest prefix
    past the shared first block is cached, else to a replica drawn by `weights` (seeded). With
    unequal weights the lightly loaded replicas keep their blocks longer."""
    rng = random.Random(seed)
    caches = [Lru(capacity // len(weights)) for _ in weights]
    replicas = range(len(weights))
    hit = total = 0
    for req in trace.requests:
        matched = [c.match(req.hash_ids) for c in caches]
        best = max(replicas, key=matched.__getitem__)
        if matched[best] <= 1:
            best = rng.choices(replicas, weights)[0]
        hit += _hit_tokens(req, matched[best], trace.block_size)
        total += req.input_length
        caches[best].store(req.hash_ids)
    return hit / total if total else 0.0


def next_uses(trace: Trace) -> list[list[int | None]]:
    """For each request's block j, the index of the next request using it (None: never)."""
    after: dict[int, int] = {}
    out: list[list[int | None]] = [[] for _ in trace.requests]
    for i in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[i].hash_ids
        out[i] = [after.get(h) for h in ids]
        for h in ids:
            after[h] = i
    return out


@dataclass
class Reuse:
    """New blocks (matched nowhere before) and those of them used again, by request class."""

    new: int = 0
    reused: int = 0

    @property
    def share(self) -> float:
        return self.reused / self.new if self.new else 0.0


def _length_class(num_blocks: int) -> str:
    low = 0
    for edge in LENGTH_BUCKETS:
        if num_blocks < edge:
            return f"{low}-{edge - 1} blocks"
        low = edge
    return f"{low}+ blocks"


def first_new(trace: Trace) -> list[int]:
    """Per request, its blocks seen before in a prefix (its new blocks start there)."""
    seen: set[int] = set()
    out = []
    for req in trace.requests:
        n = 0
        for h in req.hash_ids:
            if h not in seen:
                break
            n += 1
        seen.update(req.hash_ids)
        out.append(n)
    return out


def _output_class(tokens: int) -> str:
    return f"output < {OUTPUT_EDGE}" if tokens < OUTPUT_EDGE else f"output >= {OUTPUT_EDGE}"


CLASSES = (
    "first turn",
    "continuation",
    *(_length_class(edge) for edge in (0, *LENGTH_BUCKETS)),
    _output_class(0),
    _output_class(OUTPUT_EDGE),
)


def reuse_by_class(
    trace: Trace, uses: Sequence[Sequence[int | None]], firsts: Sequence[int]
) -> dict[str, Reuse]:
    """A request is a continuation when more than its first block (the shared system prompt)
    was seen before; its new blocks are those past the longest prefix seen before."""
    out = {name: Reuse() for name in CLASSES}
    for i, (req, n) in enumerate(zip(trace.requests, firsts, strict=True)):
        ids = req.hash_ids
        new = range(n, len(ids))
        reused = sum(1 for j in new if uses[i][j] is not None)
        kind = "continuation" if n > 1 else "first turn"
        for name in (kind, _length_class(len(ids)), _output_class(req.output_length)):
            r = out[name]
            r.new += len(new)
            r.reused += reused
    return out


def reuse_distances(
    trace: Trace, uses: Sequence[Sequence[int | None]], firsts: Sequence[int]
) -> list[int]:
    """Per new block used again, the blocks the requests in between store (what an LRU's
    recency moves past it, repeats included): it stays cached only if fewer blocks than the
    capacity were stored since (repeats lower that count, so farther reuses may still hit)."""
    stored = [0]
    for req in trace.requests:
        stored.append(stored[-1] + len(req.hash_ids))
    return sorted(
        stored[k] - stored[i + 1]
        for i, (nexts, n) in enumerate(zip(uses, firsts, strict=True))
        for k in nexts[n:]
        if k is not None
    )


def _quantiles(values: Sequence[float], spec: str = ",.0f") -> str:
    """QUANTILES of sorted `values`, nearest rank below."""
    if not values:
        return "none"
    return ", ".join(
        f"p{round(q * 100)} {values[int(q * (len(values) - 1))]:{spec}}" for q in QUANTILES
    )


def mooncake(start: int, limit: int, replicas: int = 4) -> None:
    trace = read_trace(MOONCAKE, block_size=MOONCAKE_BLOCK, start=start, limit=limit)
    capacity = max(int(CAPACITY_FRAC * trace.unique_blocks() / replicas), 1) * replicas
    uses = next_uses(trace)
    firsts = first_new(trace)
    lru = lru_hit_ratio(trace, capacity)
    oracle = lru_hit_ratio(trace, capacity, [[k is not None for k in u] for u in uses])
    print(
        f"Mooncake requests {start}..{start + len(trace.requests)}: {trace.unique_blocks():,} "
        f"unique blocks, fleet KV {capacity:,} blocks ({replicas} replicas)"
    )
    print(f"  one shared LRU: hit ratio {lru:.3f}")
    print(f"  the same LRU storing only blocks used again (admission oracle): {oracle:.3f}")
    print("  new blocks used again later, by what the router sees:")
    for name, r in reuse_by_class(trace, uses, firsts).items():
        print(f"    {name:>16}: {r.reused:,} of {r.new:,} ({r.share:.2f})")
    print(
        "  4 replicas, an unmatched request placed at random by weight (seeds "
        + ", ".join(map(str, SEEDS))
        + "):"
    )
    for weights in WEIGHTS:
        ratios = (weighted_partition_hit_ratio(trace, capacity, weights, seed) for seed in SEEDS)
        print(f"    {':'.join(map(str, weights)):>16}: " + " / ".join(f"{r:.3f}" for r in ratios))
    distances = reuse_distances(trace, uses, firsts)
    within = sum(1 for d in distances if d <= capacity)
    print(
        f"  reuse distance in blocks stored between ({len(distances):,} reuses): "
        f"{_quantiles(distances)}; within the fleet's KV {within / len(distances):.2f}"
    )


@dataclass(frozen=True)
class Session:
    """One conversation: when each step arrives and its own blocks then."""

    arrivals: tuple[float, ...]
    own: tuple[int, ...]

    def own_at(self, t: float) -> int:
        """Its own blocks at time t: those of its latest step, 0 before its first and after
        its last."""
        if t < self.arrivals[0] or t > self.arrivals[-1]:
            return 0
        return self.own[bisect.bisect_right(self.arrivals, t) - 1]


def _conversation(req: TraceRequest) -> str:
    """The request's conversation, or a name of its own (`loadgen.sim`'s rule)."""
    return req.conversation if req.conversation is not None else f"#{req.index}"


def sessions_of(trace: Trace) -> tuple[int, dict[str, Session]]:
    """The blocks every conversation shares (the longest common prefix of their first
    requests) and each conversation's steps."""
    steps: dict[str, list[TraceRequest]] = {}
    for req in trace.requests:
        steps.setdefault(_conversation(req), []).append(req)
    firsts = [reqs[0].hash_ids for reqs in steps.values()]
    shared = 0
    while all(len(f) > shared and f[shared] == firsts[0][shared] for f in firsts):
        shared += 1
    return shared, {
        c: Session(tuple(r.arrival_s for r in reqs), tuple(len(r.hash_ids) - shared for r in reqs))
        for c, reqs in steps.items()
    }


def fill_quantiles(
    trace: Trace, shared: int, sessions: dict[str, Session], capacity: int
) -> list[float]:
    """At every request's arrival, the live sessions' own blocks plus the shared ones over
    the fleet's KV, sorted."""
    return sorted(
        (shared + sum(s.own_at(req.arrival_s) for s in sessions.values())) / capacity
        for req in trace.requests
    )


def best_fit_overflow(
    trace: Trace, shared: int, sessions: dict[str, Session], replicas: int, capacity: int
) -> tuple[int, list[int]]:
    """Every session placed at its first step for its whole life on the replica where the
    peak of the shared blocks and its sessions' own blocks over its life is lowest (knowing
    all their future sizes; ties to the fewest sessions); the requests that then arrive on a
    replica holding more than `capacity`, and the sessions per replica."""
    placed: list[list[Session]] = [[] for _ in range(replicas)]
    home: dict[str, int] = {}
    for name, s in sorted(sessions.items(), key=lambda kv: kv[1].arrivals[0]):
        lo, hi = s.arrivals[0], s.arrivals[-1]
        times = set(s.arrivals)
        for r in range(replicas):
            times.update(t for o in placed[r] for t in o.arrivals if lo <= t <= hi)
        ordered = sorted(times)

        def peak(r: int, ordered: list[float] = ordered, s: Session = s) -> tuple[int, int]:
            top = max(s.own_at(t) + sum(o.own_at(t) for o in placed[r]) for t in ordered)
            return shared + top, len(placed[r])

        best = min(range(replicas), key=peak)
        placed[best].append(s)
        home[name] = best
    over = 0
    for req in trace.requests:
        r = home[_conversation(req)]
        if shared + sum(o.own_at(req.arrival_s) for o in placed[r]) > capacity:
            over += 1
    return over, [len(p) for p in placed]


def sessions(spec: str, replicas: int) -> None:
    trace = agent_sessions_trace(spec)
    per_replica = max(int(CAPACITY_FRAC * trace.unique_blocks() / replicas), 1)
    shared, by_name = sessions_of(trace)
    fill = fill_quantiles(trace, shared, by_name, per_replica * replicas)
    largest = max(shared + max(s.own) for s in by_name.values())
    over, counts = best_fit_overflow(trace, shared, by_name, replicas, per_replica)
    print(
        f"{spec}: {len(by_name)} sessions, {len(trace.requests):,} requests, {replicas} replicas "
        f"x {per_replica:,} blocks, {shared} blocks shared by all"
    )
    print(
        f"  the live sessions' blocks over the fleet's KV at each arrival: "
        f"{_quantiles(fill, '.2f')}, max {fill[-1]:.2f}"
    )
    print(f"  the largest session: {largest:,} blocks, {largest / per_replica:.2f} of a replica")
    print(
        f"  placed once, best fit on known futures, no moves: {over:,} of "
        f"{len(trace.requests):,} requests ({over / len(trace.requests):.1%}) on an over-full "
        f"replica; sessions per replica {counts}"
    )


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ("mooncake", "sessions"):
        print(__doc__)
        return 2
    if argv[0] == "mooncake":
        start, limit = (int(a) for a in (argv[1:3] if len(argv) >= 3 else ("4000", "4000")))
        mooncake(start, limit)
    else:
        spec = argv[1] if len(argv) > 1 else "agent-sessions"
        sessions(spec, int(argv[2]) if len(argv) > 2 else 8)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
