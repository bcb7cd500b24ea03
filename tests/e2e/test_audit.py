"""The timing audit (Gu et al.): its parts, then its verdicts against real servers — PASS through
kvgate, FAIL straight at an engine whose one cache everybody shares (the audit has power), VOID
when the positive control cannot see the cache."""

from __future__ import annotations

import asyncio
import collections
import string
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.tenancy.tenant_file import add_key
from kvgate_cli import main
from loadgen.audit.probes import (
    FAIL,
    PASS,
    VOID,
    AuditConfig,
    AuditReport,
    AuditTest,
    average_precision,
    cache_read_tokens,
    judge,
    ks_greater,
    probe_of,
    random_letters,
    run_audit,
)
from loadgen.engine.timing import TimingModel
from loadgen.engine.tokenizer import count_tokens
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY
from tests.servers import Served

SUITE_SAMPLES = 30
"""30 + 30 probes per test in the suite (250 + 250 in `make audit`): complete separation gives
p = 1/C(60, 30) ~ 8.5e-18, far below the positive control's 1e-8."""
AUDIT_TIMING = TimingModel(time_scale=5.0)
"""A 5,000-token miss takes ~77 ms of prefill on these engines, a hit ~0: a hit is clearly
faster. Both also pay the engine's real, unscaled tokenization (~10-20 ms for 5,000 letters on
a loaded machine), which at 10x (~38 ms of prefill) left hits under 3x faster in 1 run in 3."""
SAVED_MS = 35
"""What a hit must save of the miss's ~77 ms prefill at the median (about half): a load adds
about the same to hits and misses, so the difference stands where a ratio did not (hits 64 ms,
misses 123 ms, under 3x, at a load average of 18 under pytest-xdist)."""


def test_prompts_are_uniform_random_letters_one_token_each() -> None:
    letters = random_letters(5000)
    assert len(letters) == 5000 and set(letters) <= set(string.ascii_letters)
    assert count_tokens(" ".join(letters)) == 5000  # the engine's BPE: " X" is one token
    counts = collections.Counter(random_letters(52_000))
    assert len(counts) == 52 and max(counts.values()) < 1400  # ~1,000 each
    assert random_letters(100) != random_letters(100)


def test_a_probe_keeps_the_prefix_and_then_differs_at_once() -> None:
    prompt = random_letters(1000)
    assert probe_of(prompt, 1.0) == prompt
    for _ in range(50):
        probe = probe_of(prompt, 0.95)
        assert len(probe) == 1000 and probe[:950] == prompt[:950] and probe[950] != prompt[950]


def test_cache_reads_are_found_under_any_providers_name() -> None:
    assert cache_read_tokens(None) == 0
    assert cache_read_tokens({"prompt_tokens": 10, "prompt_tokens_details": None}) == 0
    assert cache_read_tokens({"prompt_tokens_details": {"cached_tokens": 64}}) == 64
    assert cache_read_tokens({"cache_read_input_tokens": 5, "engine_cached_tokens": 7}) == 7
    assert cache_read_tokens({"x": [{"prompt_cache_hit_tokens": 3}]}) == 3


def test_the_ks_test_is_one_sided_towards_faster_hits() -> None:
    fast, slow = [0.001 * i for i in range(1, 31)], [0.05 + 0.001 * i for i in range(30)]
    statistic, p = ks_greater(fast, slow)
    assert statistic == 1.0 and p < 1e-16
    statistic, p = ks_greater(slow, fast)  # hits SLOWER than misses is no evidence of a cache
    assert statistic == 0.0 and p == 1.0
    assert average_precision(fast, slow) == 1.0
    assert average_precision(slow, fast) < 0.5


def _test(p: float, cached: int = 0, reported: bool = True) -> AuditTest:
    return AuditTest("t", p_value=p, probe_cached_tokens=[0, cached], reported_usage=reported)


def test_the_verdict() -> None:
    assert judge(_test(1e-12, 4992), _test(0.4), None)[0] == PASS
    assert judge(_test(1e-12, 0, reported=False), _test(0.4), None)[0] == PASS
    verdict, reasons = judge(_test(1e-12, 4992), _test(0.4, cached=16), None)
    assert verdict == FAIL and "told of cached tokens (16 at most, 1 responses)" in reasons[0]
    verdict, reasons = judge(_test(1e-12, 4992), _test(0.003), _test(0.002))
    assert verdict == FAIL and "(and again on the rerun)" in reasons[0]
    verdict, reasons = judge(_test(1e-5, 4992), _test(0.4), None)
    assert verdict == VOID and "did not find the cache" in reasons[0]
    assert judge(_test(1e-12, 0), _test(0.4), None)[0] == VOID  # usage said: nothing cached
    assert judge(_test(1e-5, 0), _test(0.4, cached=1), None)[0] == FAIL  # a leak needs no control


def _audit(target: str, victim: str, attacker: str, **extra: object) -> AuditReport:
    config = AuditConfig(target, victim, attacker, samples=SUITE_SAMPLES, **extra)  # type: ignore[arg-type]
    return asyncio.run(run_audit(config))


@pytest.mark.e2e
def test_kvgate_passes_the_audit_and_a_shared_cache_fails_it(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    engines = start_engines(2, timing=AUDIT_TIMING)
    tenants_file = tmp_path / "tenants.yaml"
    control, _, _ = add_key(tenants_file, "victims")
    victim, _, _ = add_key(tenants_file, "victims")
    gateway = start_gateway(engines, tenants_file=tenants_file, debug_headers=False)

    report = _audit(gateway.url, victim, OTHER_KEY, control_key=control)
    assert report.verdict == PASS, report.reasons
    assert report.exit_status == 0
    positive, negative = report.positive, report.negative
    assert positive.p_value < 1e-8 and positive.max_cached_tokens > 4900
    assert positive.miss_median_ms - positive.hit_median_ms > SAVED_MS
    assert negative.p_value >= 0.01 and negative.max_cached_tokens == 0
    assert len(negative.probe_cached_tokens) == 2 * SUITE_SAMPLES

    # the same audit straight at an engine: no cache_salt, so victim and attacker share a cache
    broken = _audit(engines[0].url, victim, OTHER_KEY)
    assert broken.verdict == FAIL and broken.exit_status == 1
    assert broken.negative.p_value < 1e-8 and broken.negative.max_cached_tokens > 4900
    assert broken.negative_first is None  # a cached token is a deterministic fail: no rerun


@pytest.mark.e2e
def test_the_audit_command_prints_its_numbers_and_exits_by_verdict(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command's table and exit status; a quick void run (engines too fast to time, small
    prompts): what each verdict exits with is checked on the reports above (PASS 0, FAIL 1)."""
    engines = start_engines(1, timing=TimingModel(time_scale=10_000.0))
    gateway = start_gateway(engines, debug_headers=False)
    args = ["audit", "--target", gateway.url, "--victim-key", TENANT_KEY]
    args += ["--attacker-key", OTHER_KEY, "--samples", "10", "--prompt-tokens", "300"]
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "verdict: VOID" in out and "did not find the cache" in out
    for column in ("D+", "p", "hit median", "miss median", "AP"):
        assert column in out
    # a refused key makes a void run, with the reason
    assert main([*args[:4], "sk-wrong", *args[5:], "--model", MODEL]) == 2
    assert "the victim's request got HTTP 401" in capsys.readouterr().err


@pytest.mark.e2e
def test_without_a_timeable_prefill_the_run_is_void(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    # engines 10,000x faster: a miss is as quick as a hit, so the positive control finds nothing
    engines = start_engines(1, timing=TimingModel(time_scale=10_000.0))
    gateway = start_gateway(engines, debug_headers=False)
    report = _audit(gateway.url, TENANT_KEY, OTHER_KEY, prompt_tokens=500)
    assert report.verdict == VOID
    assert report.positive.max_cached_tokens > 0 and report.positive.p_value >= 1e-8
