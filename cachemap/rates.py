"""Request rates per prefix: how often requests match a given prefix, and how widely the
router has spread it (k). The in-process store; the Redis directory keeps the same counters
inside its lookup script (`cachemap.redis.directory`), so every gateway sees one rate.

A rate is a sliding window over two fixed windows (the NGINX / Cloudflare approximation):
    count = previous_count × (1 − elapsed / window) + current_count      (requests per window)
scaled to requests per minute. The window is 10 s: a prefix that turns hot is seen within
seconds, not after a minute. O(1) per request.
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
        return PrefixRate(rate, counter.k)

    def set_k(self, prefix: BlockHash, k: int) -> None:
        counter = self._counters.get(prefix)
        if counter is not None:
            counter.k = k

    def hottest(self, n: int) -> list[tuple[BlockHash, PrefixRate]]:
        now = self.clock()
        rated = [
            (p, PrefixRate(sliding_rate(c.window, c.current, c.previous, now, self.window_s), c.k))
            for p, c in self._counters.items()
        ]
        rated.sort(key=lambda item: -item[1].rate_per_min)
        return rated[:n]
