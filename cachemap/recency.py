"""Recency: each cache domain's blocks in the order its engine would evict them, with when each
was last used — the eviction frontier's raw material (issue 16, placement under cache pressure).

vLLM's free-block queue evicts the least recently *freed* block first (a request's blocks go
back to the queue when it ends; a prefix hit takes them out again), SGLang's radix cache the
least recently used leaf. Neither publishes its queue, but a gateway sees the two things that
move a block in it: the engine's `BlockStored` (the block was just written) and its own
routing (a request it placed there uses the blocks it matched). So per domain:

    store (BlockStored, GPU tier)  ──▶ its blocks become the newest run, used now
    touch (a placement's matched blocks on that domain) ──▶ the same
    BlockRemoved (GPU tier) / a wipe ──▶ gone

and the eviction order is the runs oldest first. A run is one store or touch (its blocks
share a time), so a walk to depth d steps over runs, not blocks: the request path asks for the
frontier as deep as a placement would evict (`runs`), and a store or a touch of n blocks is
two C-level passes over its keys (`_take`). Runs emptied by later touches are skipped and
dropped lazily; the deque is compacted when dead runs outnumber live ones.

What this does not know: blocks a running request holds are not in the engine's queue at all;
here they are simply recent (touched when their request was placed), which the displacement
cost weighs as live anyway. Blocks of other gateways' requests are recent only from their
engine's stores, not from their hits (another gateway's touch is invisible).

Invariants: `_run_of[key]` is the id of a live run whose count includes the key; each run's
count is the number of keys mapped to it; `num_blocks` is the sum of the live counts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from operator import attrgetter

from cachemap.keys import BlockHash

RUN_MERGE_S = 1.0
"""A store or touch within 1 s of the newest run's joins it (its time moves to the newer):
a thrashing engine announces a request's blocks in several batches a few ms apart, and the
displacement cost changes by a block's weight only over seconds (its hot horizon is 15 s,
its half-life 5 s), so runs finer than a second would only lengthen every walk."""


@dataclass(slots=True)
class _Run:
    id: int
    used_s: float
    count: int


_COUNT, _USED = attrgetter("count"), attrgetter("used_s")


def to_depth(
    runs: Iterable[tuple[int, float]], depth: int, now_s: float
) -> tuple[tuple[int, float], ...]:
    """(num_blocks, last use) runs, next evicted first, as the frontier lists them: the oldest
    `depth` blocks as (num_blocks, idle_s), idle_s the seconds since the run was last used;
    empty runs are skipped; stops as soon as `depth` is covered."""
    out: list[tuple[int, float]] = []
    left = depth
    for count, used_s in runs:
        if left <= 0:
            break
        if not count:
            continue
        taken = min(count, left)
        out.append((taken, max(now_s - used_s, 0.0)))
        left -= taken
    return tuple(out)


@dataclass
class DomainRecency:
    """One domain's blocks in eviction order (module docstring)."""

    _runs: deque[_Run] = field(default_factory=deque)
    _by_id: dict[int, _Run] = field(default_factory=dict)
    _run_of: dict[BlockHash, int] = field(default_factory=dict)
    _next_id: int = 0
    _compact_at: int = 64

    @property
    def num_blocks(self) -> int:
        return len(self._run_of)

    def use(self, keys: Sequence[BlockHash], now_s: float) -> None:
        """`keys` were stored or used now: they become the newest run (merged into the newest
        when it is within `RUN_MERGE_S`)."""
        if not keys:
            return
        run = self._runs[-1] if self._runs else None
        if run is None or now_s - run.used_s >= RUN_MERGE_S or run.count == 0:
            run = _Run(self._next_id, now_s, 0)
            self._next_id += 1
            self._runs.append(run)
            self._by_id[run.id] = run
        else:
            run.used_s = max(run.used_s, now_s)
        self._take(keys, run)

    def touch(self, keys: Sequence[BlockHash], now_s: float) -> int:
        """A placement uses the leading `keys` this domain holds: they move to the newest run.
        Returns how many were held (the touch stops at the first key not held)."""
        run_of = self._run_of
        held = list(map(run_of.__contains__, keys))
        try:
            depth = held.index(False)
        except ValueError:
            depth = len(keys)
        self.use(keys[:depth], now_s)
        return depth

    def _take(self, keys: Sequence[BlockHash], run: _Run) -> None:
        """Map `keys` to `run`: the runs they leave are counted down per run (C-level
        counting), then every key is remapped in one `dict.update`."""
        run_of, by_id = self._run_of, self._by_id
        unique = dict.fromkeys(keys)
        for rid, n in Counter(map(run_of.get, unique)).items():
            if rid is not None:
                by_id[rid].count -= n
        run_of.update(zip(unique, repeat(run.id)))
        run.count += len(unique)
        if len(self._runs) >= self._compact_at:
            self._compact()

    def remove(self, key: BlockHash) -> bool:
        """The engine evicted `key` (or dropped its GPU copy); False when it was not held."""
        rid = self._run_of.pop(key, None)
        if rid is None:
            return False
        self._by_id[rid].count -= 1
        return True

    def runs(
        self, depth: int, now_s: float, exclude: Sequence[BlockHash] = ()
    ) -> tuple[tuple[int, float], ...]:
        """The oldest `depth` blocks as (num_blocks, idle_s) runs, next evicted first
        (`to_depth`), leaving out the blocks of `exclude` (a request's own cached prefix here:
        placed here, it takes them out of the engine's free queue before it allocates, so its
        placement never evicts them). One C-level count of the excluded keys' runs."""
        if depth <= 0:
            return ()
        runs = self._runs
        while runs and runs[0].count == 0:
            del self._by_id[runs.popleft().id]
        counts: Iterable[int] = map(_COUNT, runs)
        if exclude:
            skip = Counter(map(self._run_of.get, dict.fromkeys(exclude)))
            skip.pop(None, None)
            if skip:
                counts = [r.count - skip.get(r.id, 0) for r in runs]
        return to_depth(zip(counts, map(_USED, runs), strict=True), depth, now_s)

    def oldest(self, max_runs: int) -> list[tuple[int, float]]:
        """The first `max_runs` live runs, next evicted first, as (num_blocks, last use): what
        an owner publishes of its domain for the other gateways (`cachemap.redis.frontiers`)."""
        live = list(islice(filter(_COUNT, self._runs), max_runs))
        return list(zip(map(_COUNT, live), map(_USED, live), strict=True))

    def _compact(self) -> None:
        """Drop the runs later touches emptied (amortised: when the deque doubled since)."""
        live = deque(r for r in self._runs if r.count)
        self._by_id = {r.id: r for r in live}
        self._runs = live
        self._compact_at = 2 * len(live) + 64
