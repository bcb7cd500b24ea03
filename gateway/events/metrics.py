"""Precise mode's metrics, collected at scrape time from the state the intake and the index keep
(docs/operations.md lists them): event lag, gaps, replays, restarts and wipes detected, indexed
blocks per domain and tier, speculative entries confirmed and expired, tokenization cost and the
tokenizer checks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from cachemap.events import TIERS, EventIndex
from cachemap.redis.events import EventWriter
from gateway.events.precise import PreciseKeys, TokenizerCheck

FEED_COUNTERS = (
    "batches",
    "malformed",
    "unknown_events",
    "duplicates",
    "gaps",
    "unrepaired_gaps",
    "replays",
    "replayed_batches",
    "restarts",
    "wipes",
    "over_capacity",
    "cut_replays",
    "disconnects",
)


def precise_families(precise: PreciseKeys, check: TokenizerCheck | None) -> Iterable[Any]:
    yield from _feeds(precise)
    index = precise.index
    writer = precise.intake.writer if precise.intake is not None else None
    indexed: EventIndex | EventWriter = writer if writer is not None else index
    blocks = GaugeMetricFamily(
        "kvgate_events_indexed_blocks",
        "Blocks the engines' events say each cache domain holds, per tier (shared: the "
        "domains this gateway owns and writes).",
        labels=["domain", "tier"],
    )
    for domain in indexed.domains():
        for name, tier in TIERS.items():
            blocks.add_metric([domain, name], indexed.num_blocks(domain, tier))
    yield blocks
    if writer is not None:
        yield from _shared(precise, writer)
    claims = CounterMetricFamily(
        "kvgate_events_unplaced_claims",
        "Requests for which a domain's KV events claimed more of the prompt's chain than this "
        "gateway placed there (routed on the prediction for that replica; issue 45, item 9).",
        labels=["domain"],
    )
    for domain, count in sorted(precise.placed.unplaced_claims.items()):
        claims.add_metric([domain], count)
    yield claims
    stats = index.stats
    speculative = CounterMetricFamily(
        "kvgate_events_speculative_entries",
        "Speculative entries made at routing time, by how they ended.",
        labels=["outcome"],
    )
    speculative.add_metric(["made"], precise.stats.speculated)
    speculative.add_metric(["confirmed"], stats.speculative_confirmed)
    speculative.add_metric(["expired"], stats.speculative_expired)
    yield speculative
    yield counter_by(
        "kvgate_events_stored_blocks",
        "Event blocks stored in the index, by how their own keys were had: hashed from their "
        "tokens, or taken from the chain of the placement that sent them (no second hash).",
        "keys",
        {
            "hashed": indexed.stats.stored_blocks - indexed.stats.expected_blocks,
            "placed": indexed.stats.expected_blocks,
        },
    )
    skipped = CounterMetricFamily(
        "kvgate_events_blocks_not_indexed",
        "Event blocks the index could not apply, by why.",
        labels=["reason"],
    )
    for reason in ("unknown_removals", "unresolved_parents", "wrong_block_size", "skipped_groups"):
        skipped.add_metric([reason], getattr(indexed.stats, reason))
    yield skipped
    tokens = precise.tokens.stats
    tokenize = CounterMetricFamily(
        "kvgate_precise_tokens",
        "Prompt tokens of precise requests: all of them, those the BPE encoded (missed by the "
        "segment and word caches) and those taken from a cached conversation prefix.",
        labels=["kind"],
    )
    tokenize.add_metric(["prompt"], tokens.tokens)
    tokenize.add_metric(["encoded"], tokens.tokens_encoded)
    tokenize.add_metric(["prefix"], tokens.prefix_tokens)
    yield tokenize
    word_stats = precise.tokens.word_ids.stats
    yield counter_by(
        "kvgate_precise_word_pieces",
        "Pieces of new text looked up word by word, by result (a miss is encoded by the BPE).",
        "result",
        {"hit": word_stats.pieces - word_stats.misses, "miss": word_stats.misses},
    )
    yield counter_by(
        "kvgate_precise_incremental_checks",
        "Sampled chats rendered message by message and whole, by result (a mismatch turns "
        "message-by-message rendering off).",
        "result",
        {
            "match": tokens.incremental_checks - tokens.incremental_mismatches,
            "mismatch": tokens.incremental_mismatches,
        },
    )
    yield CounterMetricFamily(
        "kvgate_precise_keying_seconds",
        "CPU time rendering, tokenizing and hashing precise requests.",
        tokens.seconds,
    )
    if check is not None:
        checked = check.stats
        yield counter_by(
            "kvgate_precise_tokenizer_checks",
            "Sampled requests compared with an engine's /tokenize, by result.",
            "result",
            {"match": checked.checks - checked.mismatches, "mismatch": checked.mismatches},
        )


def _shared(precise: PreciseKeys, writer: EventWriter) -> Iterable[Any]:
    """The shared event index: what this gateway owns and writes, and its lookups."""
    owned = GaugeMetricFamily(
        "kvgate_events_owned_domains", "Cache domains whose events this gateway owns and writes."
    )
    owned.add_metric([], len(writer.domains()))
    yield owned
    intake = precise.intake
    if intake is not None:
        gateways = GaugeMetricFamily(
            "kvgate_events_shared_gateways",
            "Live gateways of the shared event index at the last ownership round (balance).",
        )
        gateways.add_metric([], intake.gateways)
        yield gateways
        handed = CounterMetricFamily(
            "kvgate_events_handovers",
            "Domains this gateway released so that owners balance over the live gateways.",
        )
        handed.add_metric([], intake.handed_over)
        yield handed
        frontiers = intake.frontiers
        if frontiers is not None:
            yield counter_by(
                "kvgate_events_shared_frontiers",
                "Eviction orders shared for cache_pressure, by what happened: published (by "
                "this gateway as an owner), malformed (fetched and skipped), touches sent "
                "(placements here on domains owned elsewhere), touches applied (other "
                "gateways' placements on domains owned here), touches failed (not sent), "
                "rounds failed (against Redis).",
                "event",
                {
                    "published": frontiers.published,
                    "malformed": frontiers.malformed,
                    "touches_sent": frontiers.touches_sent,
                    "touches_applied": frontiers.touches_applied,
                    "touches_failed": frontiers.touch_failures,
                    "rounds_failed": frontiers.round_failures,
                },
            )
    if precise.shared is not None:
        yield counter_by(
            "kvgate_events_shared_speculative",
            "Speculative entries written into the shared index, by outcome (blocks written; "
            "writes failed or not sent).",
            "outcome",
            {"blocks": precise.shared.speculated, "failed": precise.shared.speculate_failures},
        )
    yield counter_by(
        "kvgate_events_shared_flushes",
        "Pipelined writes of the event index into Redis, by outcome.",
        "outcome",
        {"ok": writer.flushes, "error": writer.flush_errors},
    )
    stats = precise.stats
    yield counter_by(
        "kvgate_events_shared_lookups",
        "Lookups of the shared event index, by outcome (failed: routed on the prediction).",
        "outcome",
        {"ok": stats.shared_lookups - stats.shared_failures, "failed": stats.shared_failures},
    )


def counter_by(name: str, documentation: str, label: str, values: dict[str, float]) -> Any:
    """A counter with one sample per value of `label`."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in values.items():
        family.add_metric([value], count)
    return family


def _feeds(precise: PreciseKeys) -> Iterable[Any]:
    if precise.intake is None:
        return
    counters = CounterMetricFamily(
        "kvgate_events", "KV event batches per feed, by what happened.", labels=["domain", "kind"]
    )
    lag = SummaryMetricFamily(
        "kvgate_events_lag_seconds",
        "Publish (the batch's ts) to indexed, over the feed's last 4,096 batches.",
        labels=["domain"],
    )
    for feed in precise.intake.feeds():
        domain = feed.config.domain
        for kind in FEED_COUNTERS:
            counters.add_metric([domain, kind], getattr(feed.stats, kind))
        lags = feed.stats.lags_s
        lag.add_metric([domain], len(lags), sum(lags))
    yield counters
    yield lag
