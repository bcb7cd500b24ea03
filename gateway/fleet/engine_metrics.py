"""What a replica's Prometheus `/metrics` says about its load and its life.

vLLM and SGLang name the same things differently; this maps both onto one record. Samples of a
family are summed over their label sets (one engine process may report per-engine series).

A vLLM /metrics page is ~600 lines, almost all histogram buckets kvgate never reads; the text
parser costs ~20 µs a line, so lines of other families are dropped before parsing (a scrape
every second per replica per gateway must stay cheap).
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
    # SGLang's prompt and cached token counters play the part of vLLM's prefix-cache counters
    # (cumulative since the process started, so a drop is a restart)
    "prefix_queries": (
        "vllm:prefix_cache_queries",
        "vllm:gpu_prefix_cache_queries",
        "sglang:prompt_tokens",
    ),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits", "sglang:cached_tokens"),
    "start_time_s": ("process_start_time_seconds",),
}
_WANTED = {name: field for field, names in _FAMILIES.items() for name in names}
_SUFFIXES = ("_total", "_created")
"""A counter's samples and, in prometheus_client's exposition, its TYPE line carry these."""


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
    for family in text_string_to_metric_families(_wanted_lines(text)):
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


def _metric_name(line: str) -> str:
    """The metric a line is about: a sample's name, or the name a HELP/TYPE comment names."""
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end]


def _is_wanted(name: str) -> bool:
    return name in _WANTED or any(
        name.endswith(suffix) and name[: -len(suffix)] in _WANTED for suffix in _SUFFIXES
    )


def _wanted_lines(text: str) -> str:
    """Only the lines of the families kvgate reads (comments included, so types survive)."""
    return "".join(
        line + "\n" for line in text.splitlines() if line and _is_wanted(_metric_name(line))
    )
