"""Request rates per prefix: how often requests match a given prefix, and how widely the
router has spread it (k). The in-process store; the Redis directory keeps the same counters
inside its lookup script (`cachemap.redis.directory`), so every gateway sees one rate.

A rate is a sliding window over two fixed windows (the NGINX / Cloudflare approximation):
    count = previous_count × (1 − elapsed / window) + current_count      (requests per window)
scaled to requests per minute. The window is 10 s: a prefix that turns hot is seen within
seconds, not after a minute. O(1) per request.

`hottest(n)` (what /metrics shows) never looks at all the tracked prefixes: a bounded set of
candidates (`HOT_CANDIDATES`) is kept as requests arrive — a prefix joins when its rate at one
of its requests passes the weakest candidate's — and a scrape re-rates only those, so its cost
does not grow with the 100,000 prefixes tracked (a full sort of them took ~0.3 s of the event
loop per scrape).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cachemap.keys import BlockHash

RATE_WINDOW_S = 10.0
"""Counted over 10 s, reported per minute like the threshold (OpenAI documents ~15 requests per
minute per prefix before overflow): short enough to see a burst, long enough to smooth it."""
MAX_TRACKED_PREFIXES = 100_000
"""Prefixes tracked at once (LRU): a few MB; a prefix unseen for longer than the LRU keeps it
has no rate worth remembering."""
HOT_CANDIDATES = 64
"""Candidates for the hottest prefixes: a dozen times what /metrics shows, so a prefix turning
hot between two scrapes finds room; a scrape re-rates these 64, never the whole table."""


@dataclass
class _Counter:
    window: int
    current: int = 0
    previous: int = 0
    k: int = 1


@dataclass(frozen=True)
class PrefixRate:
    rate_per_min: float
    k: int


def sliding_rate(window: int, current: int, previous: int, now_s: float, window_s: float) -> float:
    """Requests per minute over the sliding window that ends now."""
    elapsed = now_s / window_s - window
    return (previous * max(0.0, 1.0 - elapsed) + current) * 60.0 / window_s


class PrefixRates:
    def __init__(
        self,
        *,
        window_s: float = RATE_WINDOW_S,
        max_prefixes: int = MAX_TRACKED_PREFIXES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s = window_s
        self.max_prefixes = max_prefixes
        self.clock = clock
        self._counters: OrderedDict[BlockHash, _Counter] = OrderedDict()
        self._hot: dict[BlockHash, float] = {}
        """Candidates for `hottest`: prefix -> its rate when last rated."""
        self._hot_floor = 0.0
        """No rate at or below this can displace a candidate (the weakest one's, when last
        looked at; a lower bound, so a newcomer above it checks the real weakest)."""

    def observe(self, prefix: BlockHash) -> PrefixRate:
        """Count one request matching `prefix`; its rate including this request, and its k."""
        now = self.clock()
        window = int(now // self.window_s)
        counter = self._counters.get(prefix)
        if counter is None:
            counter = self._counters[prefix] = _Counter(window)
            while len(self._counters) > self.max_prefixes:
                self._counters.popitem(last=False)
        else:
            self._counters.move_to_end(prefix)
        if counter.window != window:
            counter.previous = counter.current if counter.window == window - 1 else 0
            counter.current = 0
            counter.window = window
        counter.current += 1
        rate = sliding_rate(window, counter.current, counter.previous, now, self.window_s)
        self._offer(prefix, rate)
        return PrefixRate(rate, counter.k)

    def _rate_now(self, counter: _Counter, now: float) -> float:
        """A counter's rate at `now`, however long ago it last counted (its current window
        then is a previous one, or older than both)."""
        window = int(now // self.window_s)
        if counter.window == window:
            return sliding_rate(window, counter.current, counter.previous, now, self.window_s)
        if counter.window == window - 1:
            return sliding_rate(window, 0, counter.current, now, self.window_s)
        return 0.0

    def _offer(self, prefix: BlockHash, rate: float) -> None:
        hot = self._hot
        if prefix in hot or len(hot) < HOT_CANDIDATES:
            hot[prefix] = rate
            return
        if rate <= self._hot_floor:
            return
        weakest = min(hot, key=hot.__getitem__)
        if hot[weakest] >= rate:
            self._hot_floor = hot[weakest]
            return
        del hot[weakest]
        hot[prefix] = rate
        self._hot_floor = min(hot.values())

    @property
    def num_candidates(self) -> int:
        """Prefixes a scrape re-rates (at most `HOT_CANDIDATES`)."""
        return len(self._hot)

    def set_k(self, prefix: BlockHash, k: int) -> None:
        counter = self._counters.get(prefix)
        if counter is not None:
            counter.k = k

    def hottest(self, n: int) -> list[tuple[BlockHash, PrefixRate]]:
        """The `n` hottest prefixes now, hottest first (among the candidates, re-rated: a
        candidate that cooled gets its real rate, and room goes to the next riser)."""
        now = self.clock()
        rated: list[tuple[BlockHash, PrefixRate]] = []
        for prefix in list(self._hot):
            c = self._counters.get(prefix)
            if c is None:  # left the LRU
                del self._hot[prefix]
                continue
            rate = self._rate_now(c, now)
            self._hot[prefix] = rate
            rated.append((prefix, PrefixRate(rate, c.k)))
        self._hot_floor = min(self._hot.values()) if len(self._hot) >= HOT_CANDIDATES else 0.0
        rated.sort(key=lambda item: -item[1].rate_per_min)
        return rated[:n]
