"""Request rates per prefix: how often requests match a given prefix, and how widely the
router has spread it (k). The in-process store; the Redis directory keeps the same counters
inside its lookup script (`cachemap.redis.directory`), so every gateway sees one rate.

A rate is a sliding window over two fixed windows (the NGINX / Cloudflare approximation):
    count = previous_count × (1 − elapsed / window) + current_count      (requests per window)
scaled to requests per minute. The window is 10 s. O(1) per request.

That formula assumes the prefix was requested all along: a burst that began 2 s ago has 2 s of
requests divided by 10 s, a fifth of its rate (a spine at 40 requests/s stayed on its holder for
most of an 8-s burst). So while the prefix is young — first seen within the two windows — the
rate is measured over the span actually observed, from its first request:
    young rate = (requests since the first − 1) / max(now − first, MIN_SPAN_S)
(the first request starts the clock; the span is at least a second, so a handful of requests
in the same millisecond is not an infinite rate), and the rate is the larger of the two. Once a
whole previous window has been seen the sliding window alone holds, and the two agree there. A
prefix unseen for a whole window starts young again: a burst after a lull is seen at once.

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
MIN_SPAN_S = 1.0
"""A young prefix's rate is measured over at least 1 s: a burst is seen within a second or two
(at 40 requests/s the ~780/min threshold of a 300-token suffix is passed after ~14
requests, 0.35 s), while a few simultaneous requests do not read as a flood."""
MAX_TRACKED_PREFIXES = 100_000
"""Prefixes tracked at once (LRU): a few MB; a prefix unseen for longer than the LRU keeps it
has no rate worth remembering."""
HOT_CANDIDATES = 64
"""Candidates for the hottest prefixes: a dozen times what /metrics shows, so a prefix turning
hot between two scrapes finds room; a scrape re-rates these 64, never the whole table."""


@dataclass
class _Counter:
    window: int
    first_s: float
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


def prefix_rate(
    window: int, current: int, previous: int, first_s: float, now_s: float, window_s: float
) -> float:
    """Requests per minute: the sliding window, or over the observed span while the prefix is
    young (see the module docstring; the Redis lookup script computes the same)."""
    rate = sliding_rate(window, current, previous, now_s, window_s)
    if first_s >= (window - 1) * window_s:  # no whole previous window seen yet
        young = (current + previous - 1) * 60.0 / max(now_s - first_s, MIN_SPAN_S)
        rate = max(rate, young)
    return rate


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
            counter = self._counters[prefix] = _Counter(window, now)
            while len(self._counters) > self.max_prefixes:
                self._counters.popitem(last=False)
        else:
            self._counters.move_to_end(prefix)
        if counter.window != window:
            if counter.window == window - 1:
                counter.previous = counter.current
            else:  # a whole window without a request: it is young again
                counter.previous, counter.first_s = 0, now
            counter.current = 0
            counter.window = window
        counter.current += 1
        rate = prefix_rate(
            window, counter.current, counter.previous, counter.first_s, now, self.window_s
        )
        self._offer(prefix, rate)
        return PrefixRate(rate, counter.k)

    def unobserve(self, prefix: BlockHash) -> None:
        """Take back one request of the prefix's current count, never its first (the young
        rate's clock starts there): a later sibling of a fan-out flight is not a new arrival."""
        counter = self._counters.get(prefix)
        if counter is None or counter.window != int(self.clock() // self.window_s):
            return
        if counter.current > 1:
            counter.current -= 1

    def _rate_now(self, c: _Counter, now: float) -> float:
        """A counter's rate at `now`, however long ago it last counted (its current window
        then is a previous one, or older than both)."""
        window = int(now // self.window_s)
        if c.window == window:
            return prefix_rate(window, c.current, c.previous, c.first_s, now, self.window_s)
        if c.window == window - 1:
            return prefix_rate(window, 0, c.current, c.first_s, now, self.window_s)
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
    def num_tracked(self) -> int:
        """Prefixes counted now (at most `max_prefixes`)."""
        return len(self._counters)

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
