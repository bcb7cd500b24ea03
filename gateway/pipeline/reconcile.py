"""Reconciliation: the engine's reported `cached_tokens` against the directory's prediction.

The prediction for the serving replica is its matched blocks; block i covers the rendering's
bytes up to 256·(i+1), which map to tokens proportionally (tokens = bytes · prompt_tokens /
rendered bytes; no tokenizer on the gateway). When the engine read fewer tokens than predicted
(beyond `SLACK_TOKENS` of granularity), the directory held entries the engine had evicted.

The correction is LRU-consistent, not per chain: the request itself has just written its whole
prompt again (it was recorded at its first token), so dropping its blocks would be wrong; what
the miss proves is that the engine evicted an entry last used at time t — and an LRU engine
evicts everything older first. So every entry of that replica last used at or before t (the
deepest matched block's last use, which the lookup returned) is expired, in one O(1) step.

An answer without `prompt_tokens_details.cached_tokens` (vLLM without
`--enable-prompt-tokens-details`) is not compared: it says nothing about the cache, and read as
0 it made every predicted hit an expiry of the replica's entries and a suspicion.

An answer that read nothing at all where a match was predicted may also be an engine restarted
since (issue 45, item 17): the replica becomes suspect at once (`on_contradicted`): routing
ignores its entries until its start marker is checked, so the requests routed after this answer
are not misled too; an unchanged marker (an eviction) gives the entries back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.directory.routing import RoutingDirectory
from gateway.request.state import ExchangeRecord, idle_hook
from gateway.request.usage import EngineUsage

SLACK_TOKENS = 64
"""Engines cache whole blocks (vLLM 16 tokens, SGLang pages up to 64) and recompute the last
one: a shortfall within 64 tokens is granularity, not a wrong prediction."""


@dataclass
class ReconcileStats:
    predicted_tokens: float = 0.0
    engine_cached_tokens: int = 0
    overestimates: int = 0
    underestimates: int = 0
    expiries: int = 0
    contradictions: int = 0
    """Answers that read nothing from a predicted match (the replica became suspect)."""


class Reconciler:
    """An exchange observer: compares, exports the error, expires what the engine evicted."""

    def __init__(
        self,
        directory: RoutingDirectory,
        block_bytes: int,
        registry: CollectorRegistry,
        *,
        block_tokens: int | None = None,
    ) -> None:
        self.directory = directory
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        """Precise mode: blocks are this many tokens exactly (no bytes-to-tokens guess)."""
        self.stats = ReconcileStats()
        self.on_contradicted: Callable[[str, str], None] | None = None
        """Called with (replica, why) when an answer read nothing from the cache where the
        directory predicted a match: the engine may have restarted (`ReplicaSet.suspect`)."""
        self._error = Histogram(
            "kvgate_prediction_error_ratio",
            "(predicted - engine-reported cached tokens) / prompt tokens, per response.",
            buckets=(-1.0, -0.5, -0.25, -0.1, -0.02, 0.02, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self._tokens = Counter(
            "kvgate_cached_tokens",
            "Cached prompt tokens: predicted by the directory, and reported by the engines.",
            ["source"],
            registry=registry,
        )
        # the two children looked up once: `labels()` takes a lock and builds a key per call
        self._predicted = self._tokens.labels("predicted")
        self._engine = self._tokens.labels("engine")

    @idle_hook
    async def on_first_token(self, record: ExchangeRecord) -> None:
        return None

    @idle_hook
    async def on_finish(self, record: ExchangeRecord) -> None:
        return None

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        prompt_tokens = usage.prompt_tokens
        engine_cached = usage.cached_tokens
        rendered = len(record.parsed.rendered)
        if not prompt_tokens or rendered == 0 or not usage.cached_reported:
            return  # no count of the engine's hit to check the prediction against
        replica = record.cached_on or record.replica  # P/D: the prefill instance's cache
        routed = record.routed
        matched = routed.route.overlap.get(replica, 0)
        if self.block_tokens is not None:
            predicted = float(min(matched * self.block_tokens, prompt_tokens))
        else:
            predicted = min(matched * self.block_bytes, rendered) * prompt_tokens / rendered
        stats = self.stats
        stats.predicted_tokens += predicted
        stats.engine_cached_tokens += engine_cached
        self._predicted.inc(predicted)
        self._engine.inc(engine_cached)
        self._error.observe((predicted - engine_cached) / prompt_tokens)
        if engine_cached + SLACK_TOKENS < predicted:
            stats.overestimates += 1
            if engine_cached == 0 and self.on_contradicted is not None:
                stats.contradictions += 1
                self.on_contradicted(
                    replica, f"it read no cached token where {predicted:.0f} were predicted"
                )
            last_use = routed.last_use.get(replica)
            if last_use is not None:
                stats.expiries += 1
                # the floor is the lookup's last use, which the request's own record may have
                # left on its held blocks (`Routed.held`): they are written again, whole
                rewrite = routed.hashes if replica in routed.held else ()
                await self.directory.expire(replica, last_use, rewrite)
        elif engine_cached > predicted + SLACK_TOKENS:
            stats.underestimates += 1
