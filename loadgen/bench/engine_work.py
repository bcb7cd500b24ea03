"""What each engine did during a run, from its own `/metrics` (vLLM's counters): prompt tokens,
prefix-cache hits, generated tokens; and the fleet's imbalance, the busiest engine's work over
the mean (the simulator's `imbalance`: prefill of uncached tokens plus decode, in seconds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class EngineTotals:
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    generation_tokens: float = 0.0


def engine_totals(url: str) -> EngineTotals:
    """The engine's counters now (summed over its labels, e.g. data-parallel ranks)."""
    totals = EngineTotals()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10.0).text):
        value = sum(s.value for s in family.samples if s.name.endswith("_total"))
        if family.name == "vllm:prompt_tokens":
            totals.prompt_tokens = value
        elif family.name == "vllm:prefix_cache_hits":
            totals.cached_tokens = value
        elif family.name == "vllm:generation_tokens":
            totals.generation_tokens = value
    return totals


def busy_seconds(
    before: Sequence[EngineTotals],
    after: Sequence[EngineTotals],
    prefill_tokens_per_s: float,
    decode_s_per_token: float,
) -> list[float]:
    """Each engine's work between the two readings: its uncached prompt tokens at the prefill
    rate plus its generated tokens at the decode cost."""
    busy = []
    for b, a in zip(before, after, strict=True):
        prefill = a.prompt_tokens - a.cached_tokens - b.prompt_tokens + b.cached_tokens
        decode = a.generation_tokens - b.generation_tokens
        busy.append(prefill / prefill_tokens_per_s + decode * decode_s_per_token)
    return busy


def imbalance(busy: Sequence[float]) -> float:
    """The busiest engine's work over the mean: 1.0 is even; 0.0 when nothing was done."""
    mean = sum(busy) / len(busy) if busy else 0.0
    return max(busy) / mean if mean else 0.0
