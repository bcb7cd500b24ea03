"""How many directory entries an engine's KV cache is worth (issue 42).

The directory predicts what each engine holds; it should forget about when the engine does.
An engine reports its KV capacity on /metrics (vLLM's `vllm:cache_config_info`, labels
`num_gpu_blocks` and `block_size`, per data-parallel rank), so the gateway converts it into
entries — 256-byte blocks of rendered prompt (`block_bytes`) — the way `kvgate bench-pd
--directory-scale 1` sized it by hand:

    entries = ceil(num_gpu_blocks × block_size × dp ranks × bytes_per_token / block_bytes)

with `bytes_per_token` the most prompt bytes a token stands for (`MAX_BYTES_PER_TOKEN`, 8; or
the configured `bytes_per_token` if higher), so the directory never forgets a prefix before the
engine does, whatever the text: English at ~4 bytes a token is then remembered for twice the
engine's KV. Forgetting early is the costly side — in `kvgate sim` at bench point 1 a directory
of 0.6x the engine's KV read a hit ratio of 14.8% against 18.4% at 1x and 18.6% at 2x-8x —
while remembering a little long costs a wrong prediction now and then, which reconciliation
corrects; what made the cache-aware pick stick to a thrashing engine was 40x (issue 42). The
gateway's learned ratios are per tenant and not used: one tenant's text must not move every
tenant's directory. Each replica then keeps the smaller of that and `directory_capacity_blocks`
(`RoutingDirectory.set_capacity`); an engine that reports no capacity (SGLang, a vLLM before
profiling) keeps the setting.
"""

from __future__ import annotations

import math


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
