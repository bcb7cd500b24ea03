"""A shared lookup's deadline: the configured base, raised to follow Redis's recent p99, within
a cap; plus an allowance per block of the chain the script walks.

    deadline(n blocks) = min(max(base, P99_FACTOR × p99 of the last WINDOW round trips),
                             max(cap, base))
                         + per_block × n

Why it moves: a lookup can legitimately queue behind other gateways' 2–4 ms write chunks on
the same Redis, so a fixed 5-ms base sent a share of lookups to the local index although Redis
answered them; a deadline at twice the recent p99 lets such a Redis answer, and the cap keeps
what a Redis that stopped answering costs a request bounded (until the breaker opens).

Round trips come from the lookup lanes (`cachemap.redis.lookups`): written to parsed, every
reply (a given-up lookup's too, when it is read), so a Redis that slowed down is seen at its
real latency. They include the time this loop took to read the reply, an over-estimate of
Redis's own: the cap bounds it. Until `MIN_SAMPLES` round trips are in, the deadline is the
base. While the breaker is open only its probes make round trips: they teach the deadline a
Redis that is slower than the base but well within the cap, so such a Redis is used again.
"""

from __future__ import annotations

from collections import deque

WINDOW = 512
"""Round trips the p99 is taken over: the last second or so at the bench's load."""
MIN_SAMPLES = 16
"""Round trips before the p99 is trusted (the p99 of fewer is their maximum). Few enough that
a breaker's probes (`breaker.PROBE_LOOKUPS` every `PROBE_INTERVAL_S`) teach it a Redis that
stepped up to a new latency within a couple of seconds."""
RECOMPUTE_EVERY = 8
"""The p99 is recomputed every so many round trips (a sort of `WINDOW` floats, ~20 µs: a few
µs a lookup)."""
P99_FACTOR = 2.0
"""A reply twice as late as the recent p99 is not Redis's usual queueing: a fault."""


class LookupDeadline:
    """The deadline above. `base_s` and `per_block_s` may be changed at any time (tests do)."""

    def __init__(self, base_s: float, per_block_s: float, cap_s: float) -> None:
        if cap_s <= 0:
            raise ValueError(f"the deadline's cap must be positive, got {cap_s}")
        self.base_s = base_s
        self.per_block_s = per_block_s
        self.cap_s = cap_s
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._since = 0
        self.p99_s = 0.0
        """The recent round trips' p99 (0 until `MIN_SAMPLES` are in)."""

    def observe(self, round_trip_s: float) -> None:
        self._samples.append(round_trip_s)
        self._since += 1
        if self._since >= RECOMPUTE_EVERY and len(self._samples) >= MIN_SAMPLES:
            self._since = 0
            ordered = sorted(self._samples)
            self.p99_s = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def seconds(self, num_blocks: int) -> float:
        base = self.base_s
        following = min(max(base, P99_FACTOR * self.p99_s), max(self.cap_s, base))
        return following + self.per_block_s * num_blocks
