"""How many directory entries an engine's KV cache is worth (issue 42).

The directory predicts what each engine holds; it should forget about when the engine does.
An engine reports its KV capacity on /metrics (vLLM's `vllm:cache_config_info`, labels
`num_gpu_blocks` and `block_size`, per data-parallel rank), so the gateway converts it into
entries — `block_bytes` (256) of rendered prompt each — the way `kvgate bench-pd
--directory-scale 1` sized it by hand:

    entries = ceil(num_gpu_blocks × block_size × dp ranks × bytes_per_token / block_bytes)

with `bytes_per_token` what a token of the engines' KV holds of prompt text: the ratio learned
from every response's prompt tokens, all tenants together (`TokenEstimator.
fleet_bytes_per_token`; the configured `bytes_per_token` until the first response). The KV
holds every tenant's tokens, so the mix is what fills it: a tenant whose text is dense fills the
engines with fewer bytes, and the directory then holds fewer entries, as it should. The size
must be close to the engine's, on both sides (measured in `kvgate sim`, virtual time, against
`--directory-scale`, the directory's capacity over the engine's true KV):
- too small forgets prefixes the engine still holds: bench point 1 (Mooncake conversations, 4
  replicas, 25% KV, 2,000 requests) read a hit ratio of 14.8% at 0.6x, 18.4% at 1x, 18.6-18.7%
  at 2x-8x — 0.6x is what converting at a fixed 4 bytes a token gives the benches' text (~6.5);
- too large keeps the cache-aware pick on an engine that evicted the prefix: agent sessions (24
  sessions, 8 concurrent, 300 requests, 2 replicas, 25% KV) read 92.2% at 0.6x, 90.7% at 1x,
  58.1% at 1.25x and 53.0% at 2x-40x (TTFT p99 6.6 s, 41 s, 231 s, 376 s) — 2x is what a fixed 8
  bytes a token gives English text (~4).
Each replica keeps the smaller of that and `directory_capacity_blocks`
(`RoutingDirectory.set_capacity`); an engine that reports no capacity (SGLang, a vLLM before
profiling) keeps the setting.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.directory.routing import RoutingDirectory

log = logging.getLogger(__name__)

RELOG_CHANGE = 0.1
"""A replica's capacity is logged when first set and when it moved by this share since."""


def kv_entries(
    num_gpu_blocks: int | None,
    block_size: int,
    *,
    dp_size: int,
    bytes_per_token: float,
    block_bytes: int,
) -> int | None:
    """The directory entries an engine's KV holds (None: it reports no capacity), from its
    `num_gpu_blocks` of `block_size` tokens per rank."""
    if num_gpu_blocks is None:
        return None
    tokens = num_gpu_blocks * block_size * max(dp_size, 1)
    return max(math.ceil(tokens * bytes_per_token / block_bytes), 1)


@dataclass
class DirectorySizer:
    """Applies each replica's engine-sized capacity to the directory, with the ratio of the
    moment: `engine` with every scrape of a replica (its KV figures, or None when it reports
    none), so the capacity follows the engine and the learned ratio."""

    directory: RoutingDirectory
    bytes_per_token: Callable[[], float]
    capacity_blocks: int
    """The setting (`directory_capacity_blocks`): the most any replica keeps."""
    dp_size: int = 1
    block_bytes: int = 256
    _logged: dict[str, int] = field(default_factory=dict)

    def engine(self, replica: str, num_gpu_blocks: int | None, block_size: int) -> None:
        entries = kv_entries(
            num_gpu_blocks,
            block_size,
            dp_size=self.dp_size,
            bytes_per_token=self.bytes_per_token(),
            block_bytes=self.block_bytes,
        )
        kept = self.capacity_blocks if entries is None else min(entries, self.capacity_blocks)
        if self.directory.local.index.capacity_of(replica) == kept:
            return
        self.directory.set_capacity(replica, entries)
        logged = self._logged.get(replica)
        if logged is None or abs(kept - logged) > RELOG_CHANGE * logged:
            self._logged[replica] = kept
            log.info(
                "directory: %s keeps at most %d entries (its engine's KV: %s blocks of %d "
                "tokens, %.1f bytes a token)",
                replica,
                kept,
                num_gpu_blocks,
                block_size,
                self.bytes_per_token(),
            )
