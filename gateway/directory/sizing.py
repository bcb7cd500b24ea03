"""How many directory entries an engine's KV cache is worth (issue 42).

The directory predicts what each engine holds; it should forget about when the engine does.
An engine reports its KV capacity on /metrics (vLLM's `vllm:cache_config_info`, labels
`num_gpu_blocks` and `block_size`, per data-parallel rank), so the gateway converts it into
entries — 256-byte blocks of rendered prompt (`block_bytes`) — the way `kvgate bench-pd
--directory-scale 1` sized it by hand:

    entries = ceil(num_gpu_blocks × block_size × dp ranks × bytes_per_token / block_bytes)

with `bytes_per_token` the configured estimate (the gateway's learned ratios are per tenant:
one tenant's text must not move every tenant's directory). Each replica then keeps the smaller
of that and `directory_capacity_blocks` (`RoutingDirectory.set_capacity`); an engine that
reports no capacity (SGLang, a vLLM before profiling) keeps the setting.
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
