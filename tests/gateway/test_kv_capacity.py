"""A replica's KV in tokens, from its engine's metrics (`ReplicaState.kv_capacity_tokens`): what
precise mode caps a placement's counted load at (`router.capacity`, issue 40 live)."""

from __future__ import annotations

from gateway.fleet.engine_metrics import EngineMetrics, parse_engine_metrics
from gateway.fleet.replicas import ReplicaState
from router.capacity import within_capacity
from router.types import RouteRequest

PAGE = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_cpu_blocks="0",'
    'num_gpu_blocks="1120"} 1.0\n'
)
"""The simulated engine's info gauge at the live bench's 10% KV."""


def test_the_engines_kv_is_its_blocks_times_their_size() -> None:
    state = ReplicaState("http://e0")
    assert state.kv_capacity_tokens() == 0.0  # not scraped yet: unknown
    state.metrics = parse_engine_metrics(PAGE)
    assert state.kv_capacity_tokens() == 1_120 * 16
    state.metrics = EngineMetrics(num_gpu_blocks=1_120)  # no block size: unknown
    assert state.kv_capacity_tokens() == 0.0


def test_a_lease_counts_what_the_engine_will_prefill() -> None:
    """A 62,400-token turn claiming 3,768 blocks at its home: its lease there counts the prompt
    less the engine's whole KV, not less the claim."""
    state = ReplicaState("http://e0")
    state.metrics = parse_engine_metrics(PAGE)
    turn = RouteRequest(
        3_900, 62_400.0, {"http://e0": 3_768}, tokens_per_block=16.0, claimed={"http://e0": 3_588}
    )
    assert turn.uncached_tokens("http://e0") == 2_112
    capped = within_capacity(turn, {state.url: state.kv_capacity_tokens()})
    assert capped.uncached_tokens("http://e0") == 62_400 - 17_920
