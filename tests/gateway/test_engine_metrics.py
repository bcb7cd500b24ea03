"""What an engine's /metrics says, for vLLM's names and SGLang's, from expositions written by
prometheus_client itself (the library both engines use)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.fleet.engine_metrics import EngineMetrics, parse_engine_metrics
from gateway.fleet.replicas import ReplicaState
from router.registry import build_policy
from router.types import RouteRequest

LABELS = ("model_name", "engine")
MODEL = ("meta-llama/Llama-3.1-8B-Instruct", "0")


def vllm_page(*, running: int, waiting: int, queries: int, hits: int) -> str:
    """A vLLM-shaped page: the gauges and counters kvgate reads among many histograms."""
    registry = CollectorRegistry()
    for i in range(12):  # the bulk of a real page: latency histograms kvgate never reads
        Histogram(
            f"vllm:histogram_{i}_seconds",
            "A latency.",
            LABELS,
            buckets=[b / 10 for b in range(1, 30)],
            registry=registry,
        ).labels(*MODEL).observe(0.3)
    Gauge("vllm:num_requests_running", "Running.", LABELS, registry=registry).labels(*MODEL).set(
        running
    )
    Gauge("vllm:num_requests_waiting", "Waiting.", LABELS, registry=registry).labels(*MODEL).set(
        waiting
    )
    Gauge("vllm:kv_cache_usage_perc", "KV usage.", LABELS, registry=registry).labels(*MODEL).set(
        0.75
    )
    Counter("vllm:prefix_cache_queries", "Queries.", LABELS, registry=registry).labels(*MODEL).inc(
        queries
    )
    Counter("vllm:prefix_cache_hits", "Hits.", LABELS, registry=registry).labels(*MODEL).inc(hits)
    Gauge("process_start_time_seconds", "Start.", registry=registry).set(1_700_000_123.25)
    return generate_latest(registry).decode()


def test_vllm_names_among_histograms() -> None:
    page = vllm_page(running=3, waiting=5, queries=1000, hits=400)
    assert page.count("\n") > 400  # the histograms really are there, and skipped
    assert parse_engine_metrics(page) == EngineMetrics(
        num_running=3.0,
        num_waiting=5.0,
        kv_usage=0.75,
        prefix_queries=1000.0,
        prefix_hits=400.0,
        start_time_s=1_700_000_123.25,
    )


def test_sglang_names_summed_over_label_sets() -> None:
    registry = CollectorRegistry()
    labels = ("model_name", "tp_rank")
    running = Gauge("sglang:num_running_reqs", "Running.", labels, registry=registry)
    running.labels("m", "0").set(4)  # one series per data-parallel rank: summed
    running.labels("m", "1").set(3)
    Gauge("sglang:num_queue_reqs", "Queued.", ["model_name"], registry=registry).labels("m").set(9)
    Gauge("sglang:token_usage", "Token usage.", ["model_name"], registry=registry).labels("m").set(
        0.5
    )
    cached = Counter(
        "sglang:cached_tokens", "Cached tokens.", ["model_name", "cache_source"], registry=registry
    )
    cached.labels("m", "device").inc(300)
    cached.labels("m", "host").inc(20)
    Counter("sglang:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry).labels(
        "m"
    ).inc(900)
    metrics = parse_engine_metrics(generate_latest(registry).decode())
    assert metrics == EngineMetrics(
        num_running=7.0, num_waiting=9.0, kv_usage=0.5, prefix_queries=900.0, prefix_hits=320.0
    )
    assert metrics.start_marker is None


def test_counters_that_went_backwards_are_a_restart() -> None:
    before = parse_engine_metrics(vllm_page(running=0, waiting=0, queries=1000, hits=400))
    after = parse_engine_metrics(vllm_page(running=0, waiting=0, queries=1001, hits=401))
    assert not after.restarted_since(before)
    unmarked = EngineMetrics(prefix_queries=10.0, prefix_hits=2.0)
    assert unmarked.restarted_since(EngineMetrics(prefix_queries=11.0, prefix_hits=1.0))


def test_an_empty_or_foreign_page_says_nothing() -> None:
    assert parse_engine_metrics("") == EngineMetrics()
    assert parse_engine_metrics("# HELP other_total x\n# TYPE other_total counter\n") == (
        EngineMetrics()
    )


def test_the_scrape_asks_only_for_the_families_read_and_parses_the_same() -> None:
    """prometheus_client's own `name[]` filter (what vLLM's /metrics runs) on the scrape's
    query leaves a page of a few lines that parses to what the whole page does."""
    from urllib.parse import parse_qs, urlsplit

    from prometheus_client import exposition

    from gateway.fleet.engine_metrics import SCRAPE_HEADERS, SCRAPE_PATH

    registry = CollectorRegistry()
    Histogram("vllm:e2e_seconds", "A latency.", registry=registry).observe(0.3)
    Gauge("vllm:num_requests_waiting", "Waiting.", registry=registry).set(3)
    Counter("vllm:prefix_cache_hits", "Hits.", registry=registry).inc(7)
    names = parse_qs(urlsplit(SCRAPE_PATH).query)["name[]"]
    whole = generate_latest(registry).decode()
    asked = generate_latest(registry.restricted_registry(names)).decode()
    assert "vllm:e2e_seconds" in whole and "vllm:e2e_seconds" not in asked
    assert parse_engine_metrics(asked) == parse_engine_metrics(whole)
    assert parse_engine_metrics(asked).num_waiting == 3
    assert parse_engine_metrics(asked).prefix_hits == 7
    assert SCRAPE_HEADERS == {"accept-encoding": "identity"}  # no gzip on loopback
    assert exposition.gzip_accepted(SCRAPE_HEADERS["accept-encoding"]) is False


def test_crlf_pages_labels_with_spaces_and_nan_samples_parse() -> None:
    page = (
        "# TYPE vllm:num_requests_running gauge\r\n"
        'vllm:num_requests_running{model_name="a b}",engine="0"} 2.0\r\n'
        'vllm:num_requests_running{model_name="c",engine="1"} NaN\r\n'
        'vllm:num_requests_running_other{engine="0"} 9\r\n'
        "vllm:num_requests_waiting 4 1700000000000\r\n"
    )
    metrics = parse_engine_metrics(page)
    assert metrics.num_running == 2.0 and metrics.num_waiting == 4.0


def test_the_kv_capacity_comes_from_vllms_cache_config_info() -> None:
    """vLLM's info gauge carries the config in labels (value 1); the scrape asks for it too."""
    from urllib.parse import parse_qs, urlsplit

    from gateway.fleet.engine_metrics import SCRAPE_PATH

    registry = CollectorRegistry()
    info = ("block_size", "num_gpu_blocks", "enable_prefix_caching")
    Gauge("vllm:cache_config_info", "Cache config.", info, registry=registry).labels(
        "16", "27384", "True"
    ).set(1)
    Gauge("vllm:num_requests_running", "Running.", registry=registry).set(2)
    names = parse_qs(urlsplit(SCRAPE_PATH).query)["name[]"]
    asked = generate_latest(registry.restricted_registry(names)).decode()
    assert parse_engine_metrics(asked) == EngineMetrics(
        num_running=2.0, num_gpu_blocks=27384, kv_block_size=16
    )
    # before vLLM profiled its memory the label is "None": unknown, not a crash
    unprofiled = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert parse_engine_metrics(unprofiled).num_gpu_blocks is None
    assert parse_engine_metrics(unprofiled).kv_block_size == 16
    # a label whose name ends in another's is not it
    other = 'vllm:cache_config_info{cpu_block_size="8",block_size="32",num_gpu_blocks="9"} 1\n'
    assert parse_engine_metrics(other).kv_block_size == 32


def test_an_engines_kv_in_directory_entries() -> None:
    """Issue 42: tokens of KV x bytes per token / bytes per entry, every DP rank counted;
    nothing when the engine reports no capacity."""
    from gateway.directory.sizing import kv_entries

    def entries(blocks: int | None, block_size: int, dp: int = 1, ratio: float = 4.0) -> int | None:
        return kv_entries(blocks, block_size, dp_size=dp, bytes_per_token=ratio, block_bytes=256)

    assert entries(4096, 16) == 1024  # bench-pd's engines, 65,536 tokens, at 4 bytes a token
    assert entries(4096, 16, ratio=6.4) == 1639  # at the ratio of bench-pd's text
    assert entries(4096, 16, dp=2) == 2048
    assert entries(1, 1) == 1
    assert entries(None, 16) is None


@pytest.mark.parametrize("policy_name", ["cache_aware", "cache_pressure"])
def test_a_kv_cache_reported_full_keeps_the_conversation_it_holds(policy_name: str) -> None:
    """A replica whose engine reported its KV cache 97–100% used (`vllm:kv_cache_usage_perc`:
    the share running requests hold) was over the bound whatever its queues, so a long agent
    session's next step left the replica that held it whenever another session ran there, and
    re-prefilled 100k tokens elsewhere: live, 32 sessions at 10% KV, 0.323 → 0.465 hit ratio
    (precise cache_pressure 0.228 → 0.742) without the rule (docs/benchmarks.md "A KV cache
    reported full"). A full KV makes a new request wait for running ones, which the load
    already counts (their prefill and outstanding output); usage is not a bound of its own.
    From the scrape through the gateway's snapshot to the policy's decision."""
    policy = build_policy(policy_name)
    req = RouteRequest(90, 6_400.0, {"r0": 90})  # 6,400 tokens, 90 blocks of 64 cached on r0

    def fleet(holder: ReplicaState) -> list[ReplicaState]:
        return [holder, ReplicaState("r1", healthy=True), ReplicaState("r2", healthy=True)]

    for usage in (0.97, 1.0):
        full = ReplicaState("r0", healthy=True, metrics=EngineMetrics(kv_usage=usage))
        snapshots = [r.snapshot() for r in fleet(full)]
        kept = policy.decide(req, snapshots, random.Random(0))
        assert kept is not None and kept.replica == "r0" and kept.reason == "prefix"
    # the queue still moves it: the same request over the bound goes elsewhere
    busy = ReplicaState(
        "r0", healthy=True, pending_prefill_tokens=200_000, metrics=EngineMetrics(kv_usage=1.0)
    )
    moved = policy.decide(req, [r.snapshot() for r in fleet(busy)], random.Random(0))
    assert moved is not None and moved.replica != "r0" and moved.reason == "load_bound"


def test_the_newest_lora_requests_info_sample_names_the_adapters_in_use() -> None:
    """vLLM's info gauge, written by prometheus_client as vLLM writes it: the value is the
    report's wall time, so of two samples (an engine that kept an old label set) the newest
    counts; the mirror of a replica learns its slots and its adapters in use from it."""
    registry = CollectorRegistry()
    info = Gauge(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        registry=registry,
    )
    info.labels("2", "", "old-lora").set(1_000.0)
    info.labels("2", "chat-lora", "sql-lora,code-lora").set(2_000.0)
    page = generate_latest(registry).decode() + vllm_page(running=2, waiting=1, queries=0, hits=0)
    metrics = parse_engine_metrics(page)
    assert metrics.max_lora == 2 and metrics.num_running == 2
    assert metrics.lora_adapters_in_use() == (["sql-lora", "code-lora"], ["chat-lora"])
    state = ReplicaState("http://r")
    state.metrics = metrics
    state.observe_adapters()
    assert state.adapters.max_loras == 2
    # 3 in use, 2 slots: the running ones hold them (chat-lora waits for one)
    assert list(state.adapters.recent) == ["code-lora", "sql-lora"]
    assert parse_engine_metrics(vllm_page(running=0, waiting=0, queries=0, hits=0)).max_lora is None
