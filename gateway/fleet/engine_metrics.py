"""What a replica's Prometheus `/metrics` says about its load and its life.

vLLM and SGLang name the same things differently; this maps both onto one record. Samples of a
family are summed over their label sets (one engine process may report per-engine series).

A vLLM /metrics page is ~600 lines, almost all histogram buckets kvgate never reads; only the
sample lines of the families below are parsed, by hand (a scrape every second per replica per
gateway must stay cheap: `_family_totals`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlencode

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


@dataclass(frozen=True)
class EngineMetrics:
    num_running: float | None = None
    num_waiting: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    start_time_s: float | None = None
    num_gpu_blocks: int | None = None
    """The engine's KV capacity in blocks (`vllm:cache_config_info`'s `num_gpu_blocks` label;
    per DP rank): what precise mode's eviction frontier counts empty blocks against, and
    what the approximate directory's capacity for the replica is sized from."""
    kv_block_size: int | None = None
    """Tokens per KV block (the same sample's `block_size` label; None: absent)."""
    max_lora: int | None = None
    """`vllm:lora_requests_info`'s labels (the newest sample): the GPU adapter slots..."""
    running_lora_adapters: str | None = None
    """...the adapters of running requests, comma-separated..."""
    waiting_lora_adapters: str | None = None
    """...and of waiting ones (None: the engine serves no adapters)."""

    def lora_adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The running and the waiting adapters, as lists."""
        return _names(self.running_lora_adapters), _names(self.waiting_lora_adapters)

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


CACHE_CONFIG_INFO = "vllm:cache_config_info"
"""vLLM's info gauge of its cache config: value 1, the config in its labels (`block_size`,
`num_gpu_blocks`, ...)."""


def cache_config_blocks(text: str, name: str = "num_gpu_blocks") -> int | None:
    """`num_gpu_blocks` (or another label, `name`) from the first `vllm:cache_config_info`
    sample (None: absent or not a positive number, as before vLLM profiled its memory: the
    label is then "None")."""
    at = text.find(CACHE_CONFIG_INFO + "{")
    if at < 0:
        return None
    line = text[at : text.find("\n", at) if text.find("\n", at) >= 0 else len(text)]
    label = line.find(f'{name}="')
    while label > 0 and line[label - 1] not in "{, ":  # not the tail of a longer label's name
        label = line.find(f'{name}="', label + 1)
    if label < 0:
        return None
    start = label + len(name) + 2
    value = line[start : line.find('"', start)]
    return int(value) if value.isdigit() and int(value) > 0 else None


LORA_REQUESTS_INFO = "vllm:lora_requests_info"
"""vLLM's info gauge of its LoRA adapters: value the report's wall time, in labels `max_lora`,
`running_lora_adapters`, `waiting_lora_adapters` (comma-separated names)."""


def lora_info(text: str) -> dict[str, str]:
    """The labels of the newest `vllm:lora_requests_info` sample ({} when absent)."""
    best: tuple[float, dict[str, str]] | None = None
    at = text.find(LORA_REQUESTS_INFO + "{")
    while at >= 0:
        end = text.find("\n", at)
        line = text[at : end if end >= 0 else len(text)]
        close = line.rfind("}")
        labels: dict[str, str] = {}
        for part in line[len(LORA_REQUESTS_INFO) + 1 : close].split('",'):
            key, sep, value = part.partition('="')
            if sep:
                labels[key.strip()] = value.rstrip('"')
        try:
            stamp = float(line[close + 1 :].split()[0])
        except (ValueError, IndexError):
            stamp = 0.0
        if best is None or stamp >= best[0]:
            best = (stamp, labels)
        at = text.find(LORA_REQUESTS_INFO + "{", at + 1)
    return best[1] if best is not None else {}


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The fields kvgate uses, from a Prometheus text exposition (unknown families ignored)."""
    found: dict[str, tuple[int, float]] = {}
    for family, total in _family_totals(text).items():
        field = _WANTED[family]
        rank = _FAMILIES[field].index(family)
        if field in found and found[field][0] < rank:
            continue
        found[field] = (rank, total)
    lora = lora_info(text)
    max_lora = lora.get("max_lora", "")
    return EngineMetrics(
        **{field: value for field, (_, value) in found.items()},
        num_gpu_blocks=cache_config_blocks(text),
        kv_block_size=cache_config_blocks(text, "block_size"),
        max_lora=int(max_lora) if max_lora.isdigit() else None,
        running_lora_adapters=lora.get("running_lora_adapters") if lora else None,
        waiting_lora_adapters=lora.get("waiting_lora_adapters") if lora else None,
    )


_SAMPLE_NAMES = (
    *(name + suffix for name in _WANTED for suffix in ("", "_total")),
    CACHE_CONFIG_INFO,
    LORA_REQUESTS_INFO,
)
SCRAPE_PATH = "/metrics?" + urlencode([("name[]", name) for name in _SAMPLE_NAMES])
"""/metrics asking for the wanted families only: prometheus_client's exposition (vLLM's,
SGLang's) then renders ~20 lines instead of ~600; an engine that ignores the query sends the
whole page, which parses the same."""
SCRAPE_HEADERS = {"accept-encoding": "identity"}
"""prometheus_client gzips /metrics for a client that accepts it (aiohttp does by default):
on loopback or a pod network that is CPU on both sides for nothing."""

_SAMPLE_PREFIXES = tuple(
    name + suffix + stop for name in _WANTED for suffix in ("", "_total") for stop in ("{", " ")
)
"""How a sample line of a wanted family starts (a counter's with `_total`): one C-level
`startswith` per line drops the ~600 lines of other families."""


def _family_totals(text: str) -> dict[str, float]:
    """Each wanted family's samples summed over their label sets (NaN skipped).

    A hand parse of the sample lines only: `name{labels} value [timestamp]`. prometheus_client's
    parser cost ~25 µs a line and a Python filter ahead of it ~5 µs a line of the page, ~3 ms a
    scrape in all; this costs ~0.1 ms on vLLM's page. A malformed value is a ValueError (the
    scrape is then ignored, as before)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_SAMPLE_PREFIXES):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        value = float(rest.split()[0])
        family = name.removesuffix("_total") if name not in _WANTED else name
        if not math.isnan(value):
            totals[family] = totals.get(family, 0.0) + value
    return totals


def _names(labels: str | None) -> list[str]:
    return [n.strip() for n in (labels or "").split(",") if n.strip()]
