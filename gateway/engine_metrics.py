"""What a replica's Prometheus `/metrics` says about its load and its life.

vLLM and SGLang name the same things differently; this maps both onto one record. Samples of a
family are summed over their label sets (one engine process may report per-engine series).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# our field -> the metric family names that carry it, first match wins
_FAMILIES: dict[str, tuple[str, ...]] = {
    "num_running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "num_waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "start_time_s": ("process_start_time_seconds",),
}
_WANTED = {name: field for field, names in _FAMILIES.items() for name in names}


@dataclass(frozen=True)
class EngineMetrics:
    num_running: float | None = None
    num_waiting: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    start_time_s: float | None = None

    @property
    def start_marker(self) -> str | None:
        """The engine process's identity over time: its start time, when it reports one."""
        if self.start_time_s is None:
            return None
        return f"{self.start_time_s:.3f}"

    def restarted_since(self, before: EngineMetrics) -> bool:
        """A new start time, or cumulative prefix-cache counters that went backwards."""
        if self.start_marker is not None and before.start_marker is not None:
            return self.start_marker != before.start_marker
        for now, then in (
            (self.prefix_queries, before.prefix_queries),
            (self.prefix_hits, before.prefix_hits),
        ):
            if now is not None and then is not None and now < then:
                return True
        return False


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The fields kvgate uses, from a Prometheus text exposition (unknown families ignored)."""
    found: dict[str, tuple[int, float]] = {}
    for family in text_string_to_metric_families(text):
        field = _WANTED.get(family.name)
        if field is None:
            continue
        rank = _FAMILIES[field].index(family.name)
        if field in found and found[field][0] < rank:
            continue
        total = 0.0
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            if not math.isnan(sample.value):
                total += sample.value
        found[field] = (rank, total)
    return EngineMetrics(**{field: value for field, (_, value) in found.items()})
