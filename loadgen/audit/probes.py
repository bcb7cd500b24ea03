"""`kvgate audit`: the prompt-cache timing audit of Gu, Li, Kuditipudi, Liang and Hashimoto
(ICML 2025), run against any OpenAI-compatible endpoint over HTTP (docs/billing.md#timing-audit).

A shared prefix cache is a timing oracle: a prompt someone else just sent comes back faster.
The audit measures it the way the paper did:

- Prompts: fresh strings of `prompt_tokens` random upper- and lower-case letters separated by
  spaces (one token per letter; drawn from the OS CSPRNG), sent as one user message, streamed,
  `max_tokens: 1`. TTFT is measured on a monotonic clock from sending to the first streamed
  choice (what vLLM sends with the first token).
- Before every probe the victim sends a prompt (`victim_requests` times): in a miss trial an
  unrelated one, so that hit and miss probes follow the same activity back to back.
- Hit procedure: the victim sends P (`victim_requests` times, each to completion, so the entry
  is visible), then the attacker sends P' = the first `prefix_fraction` of P followed by fresh
  letters (the first of them forced to differ). Miss procedure: the attacker sends a fresh
  prompt of the same length.
- `samples` of each, in a shuffled order, back to back; a one-sided two-sample
  Kolmogorov-Smirnov test, `ks_2samp(hit, miss, alternative="greater")`: the alternative is
  that the hits' CDF lies above the misses' somewhere, i.e. hits are FASTER. D+ = sup(F_hit -
  F_miss).

Two tests, one verdict:
- the positive control, victim -> control key (a second key in the victim's scope; by default
  the victim's own key): must find the cache, p < 1e-8 (and cached tokens reported, when the
  target reports usage), or the run proves nothing (VOID);
- the cross-tenant test, victim -> attacker: PASS needs p >= 0.01 and not one cached token ever
  reported to the attacker. A cached token is a deterministic FAIL; a p below 0.01 alone is
  rerun once with fresh prompts (isolation fails the KS test ~1% of the time by chance).
Exit status: 0 PASS, 1 FAIL, 2 VOID (or the audit could not run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

DEFAULT_SAMPLES = 250
"""Gu et al.'s 250 hit and 250 miss probes per test."""
DEFAULT_PROMPT_TOKENS = 5_000
"""Gu et al.'s PROMPTLENGTH: long enough that a hit saves a clearly measurable prefill."""
POSITIVE_ALPHA = 1e-8
"""The positive control must reach p < 1e-8 (D+ >~ 0.28 at 250 + 250): a real cache passes
easily, noise never does."""
NEGATIVE_ALPHA = 0.01
"""Across tenants p must stay >= 0.01 (D+ < 0.14 at 250 + 250)."""
NUM_WARMUP = 2
"""Requests per party before each test, discarded: they open the connections."""
DEFAULT_REQUEST_TIMEOUT_S = 120.0
CLIENT_KEEPALIVE_S = 1.0
"""The client drops a connection idle this long, before any server would (uvicorn: 5 s,
nginx: 75 s): reusing one the server is closing fails the request. Probes follow each other
within milliseconds, so connections stay warm while a test runs."""
LETTERS = string.ascii_letters
_ACCEPT_BELOW = 256 - 256 % len(LETTERS)
"""Random bytes at or above this are rejected, so every letter is equally likely."""
CACHE_READ_FIELDS = frozenset(
    {
        "cached_tokens",  # OpenAI chat / completions: prompt_tokens_details.cached_tokens
        "engine_cached_tokens",  # kvgate: the engine's physical hit
        "cache_read_input_tokens",  # Anthropic
        "prompt_cache_hit_tokens",  # DeepSeek
        "cachedContentTokenCount",  # Google
    }
)
PASS, FAIL, VOID = "PASS", "FAIL", "VOID"
EXIT_STATUS = {PASS: 0, FAIL: 1, VOID: 2}


class AuditError(Exception):
    """The audit could not run (a refused key, an unreachable target); the run is void."""


def random_letters(num: int) -> list[str]:
    """`num` letters, uniform over a-z and A-Z, from the OS CSPRNG."""
    out: list[str] = []
    while len(out) < num:
        out.extend(LETTERS[b % len(LETTERS)] for b in os.urandom(num) if b < _ACCEPT_BELOW)
    return out[:num]


def probe_of(prompt: Sequence[str], prefix_fraction: float) -> list[str]:
    """P': the first `prefix_fraction` of P, then fresh letters, the first forced to differ."""
    keep = round(len(prompt) * prefix_fraction)
    if keep >= len(prompt):
        return list(prompt)
    suffix = random_letters(len(prompt) - keep)
    if suffix[0] == prompt[keep]:
        others = LETTERS.replace(prompt[keep], "")
        suffix[0] = others[os.urandom(1)[0] % len(others)]
    return [*prompt[:keep], *suffix]


def cache_read_tokens(usage: Any) -> int:
    """The largest cache-read count anywhere in a usage object (any provider's field name)."""
    found = 0
    if isinstance(usage, dict):
        for name, value in usage.items():
            if name in CACHE_READ_FIELDS and isinstance(value, int | float):
                found = max(found, int(value))
            else:
                found = max(found, cache_read_tokens(value))
    elif isinstance(usage, list):
        for item in usage:
            found = max(found, cache_read_tokens(item))
    return found


@dataclass(frozen=True)
class AuditConfig:
    target: str
    victim_key: str
    attacker_key: str
    control_key: str | None = None
    """A second key in the victim's scope; None: the victim's own key."""
    samples: int = DEFAULT_SAMPLES
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    model: str | None = None
    """None: the first model the target lists for the victim."""
    prefix_fraction: float = 1.0
    victim_requests: int = 1
    victim_user: str | None = None
    attacker_user: str | None = None
    """`user` fields to send (per-user scopes): the control sends the victim's."""
    rerun_on_fail: bool = True
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise ValueError("samples must be at least 2")
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be positive")
        if not 0.0 < self.prefix_fraction <= 1.0:
            raise ValueError("prefix_fraction must be in (0, 1]")
        if self.victim_requests < 1:
            raise ValueError("victim_requests must be at least 1")


@dataclass
class Sample:
    ttft_s: float
    cached_tokens: int
    reported_usage: bool


@dataclass
class AuditTest:
    name: str
    hit_ttft_s: list[float] = field(default_factory=list)
    miss_ttft_s: list[float] = field(default_factory=list)
    probe_cached_tokens: list[int] = field(default_factory=list)
    """Cache reads reported on every probe (hit and miss procedures) of the probing key."""
    reported_usage: bool = False
    statistic: float = 0.0
    p_value: float = 1.0
    average_precision: float = 0.0
    elapsed_s: float = 0.0

    @property
    def hit_median_ms(self) -> float:
        return statistics.median(self.hit_ttft_s) * 1e3

    @property
    def miss_median_ms(self) -> float:
        return statistics.median(self.miss_ttft_s) * 1e3

    @property
    def max_cached_tokens(self) -> int:
        return max(self.probe_cached_tokens, default=0)


@dataclass
class AuditReport:
    config: AuditConfig
    model: str
    positive: AuditTest
    negative: AuditTest
    negative_first: AuditTest | None
    """The first cross-tenant run when it failed on p alone and was rerun."""
    verdict: str
    reasons: list[str]

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]


def ks_greater(hit: Sequence[float], miss: Sequence[float]) -> tuple[float, float]:
    """D+ = sup(F_hit - F_miss) and its p-value: small when hits are faster."""
    try:
        from scipy.stats import ks_2samp
    except ImportError:  # pragma: no cover - scipy comes with the dev and audit extras
        raise AuditError("the audit needs scipy: pip install 'kvgate[audit]'") from None
    result = ks_2samp(hit, miss, alternative="greater")
    return float(result.statistic), float(result.pvalue)


def average_precision(hit: Sequence[float], miss: Sequence[float]) -> float:
    """How well TTFT alone picks out the hits: rank by TTFT, fastest first, and average the
    precision at each hit (0.5 is chance for equal counts, 1.0 perfect separation)."""
    ranked = sorted([(t, True) for t in hit] + [(t, False) for t in miss], key=lambda x: x[0])
    found = 0
    total = 0.0
    for rank, (_, is_hit) in enumerate(ranked, start=1):
        if is_hit:
            found += 1
            total += found / rank
    return total / found if found else 0.0


class _Client:
    """One party (victim, control, attacker): its own connection, key and end user."""

    def __init__(self, config: AuditConfig, key: str, user: str | None, model: str) -> None:
        self.url = config.target.rstrip("/") + "/v1/chat/completions"
        self.headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        self.user = user
        self.model = model
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=CLIENT_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def send(self, letters: Sequence[str], who: str) -> Sample:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": " ".join(letters)}],
            "max_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.user is not None:
            body["user"] = self.user
        payload = orjson.dumps(body)
        start = time.monotonic()
        ttft = 0.0
        usage: Any = None
        async with self.session.post(self.url, data=payload, headers=self.headers) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                raise AuditError(f"the {who}'s request got HTTP {resp.status}: {text}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    raise AuditError(f"the {who}'s stream failed: {chunk['error']}")
                if not ttft and chunk.get("choices"):
                    ttft = time.monotonic() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if not ttft:
            raise AuditError(f"the {who}'s stream ended without a token")
        return Sample(ttft, cache_read_tokens(usage), usage is not None)

    async def close(self) -> None:
        await self.session.close()


async def _run_test(
    name: str, config: AuditConfig, victim: _Client, prober: _Client, prober_role: str
) -> AuditTest:
    result = AuditTest(name)
    for client, role in ((victim, "victim"), (prober, prober_role)):
        for _ in range(NUM_WARMUP):
            await client.send(random_letters(config.prompt_tokens), role)
    trials = ["hit"] * config.samples + ["miss"] * config.samples
    random.SystemRandom().shuffle(trials)
    started = time.monotonic()
    for trial in trials:
        prompt = random_letters(config.prompt_tokens)
        # the victim sends before every probe, hit or miss: back to back, what came just before
        # a probe (a busy engine, warm connections) must be the same on both sides, so that the
        # only difference is whether the probe shares the victim's prefix
        victims = prompt if trial == "hit" else random_letters(config.prompt_tokens)
        for _ in range(config.victim_requests):
            await victim.send(victims, "victim")
        if trial == "hit":
            sample = await prober.send(probe_of(prompt, config.prefix_fraction), prober_role)
            result.hit_ttft_s.append(sample.ttft_s)
        else:
            sample = await prober.send(prompt, prober_role)
            result.miss_ttft_s.append(sample.ttft_s)
        result.probe_cached_tokens.append(sample.cached_tokens)
        result.reported_usage |= sample.reported_usage
    result.elapsed_s = time.monotonic() - started
    result.statistic, result.p_value = ks_greater(result.hit_ttft_s, result.miss_ttft_s)
    result.average_precision = average_precision(result.hit_ttft_s, result.miss_ttft_s)
    return result


async def first_model(config: AuditConfig) -> str:
    url = config.target.rstrip("/") + "/v1/models"
    headers = {"authorization": f"Bearer {config.victim_key}"}
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.get(url, headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:300].decode(errors="replace")
                    raise AuditError(f"GET {url} with the victim's key: HTTP {resp.status}: {text}")
                models = orjson.loads(await resp.read()).get("data") or []
        except aiohttp.ClientError as exc:
            raise AuditError(f"cannot reach {config.target}: {exc}") from None
    if not models:
        raise AuditError(f"{url} lists no models; pass --model")
    return str(models[0]["id"])


def _negative_fails(test: AuditTest) -> bool:
    return test.p_value < NEGATIVE_ALPHA or test.max_cached_tokens > 0


def judge(
    positive: AuditTest, negative: AuditTest, negative_first: AuditTest | None
) -> tuple[str, list[str]]:
    """FAIL when isolation visibly broke (that needs no control); else VOID when the positive
    control did not find the cache; else PASS."""
    reasons: list[str] = []
    if negative.max_cached_tokens > 0:
        reasons.append(
            f"the attacker was told of cached tokens ({negative.max_cached_tokens} at most, "
            f"{sum(1 for c in negative.probe_cached_tokens if c)} responses)"
        )
    if negative.p_value < NEGATIVE_ALPHA:
        again = " (and again on the rerun)" if negative_first is not None else ""
        reasons.append(
            f"the attacker's hit probes were faster: p = {negative.p_value:.3g} < "
            f"{NEGATIVE_ALPHA}{again}"
        )
    if reasons:
        return FAIL, reasons
    if positive.p_value >= POSITIVE_ALPHA:
        reasons.append(
            f"the positive control did not find the cache: p = {positive.p_value:.3g} >= "
            f"{POSITIVE_ALPHA:g}; the run cannot show isolation (is prefix caching on? is the "
            "prefill long enough to time?)"
        )
    elif positive.reported_usage and positive.max_cached_tokens == 0:
        reasons.append("the positive control's probes never reported a cached token")
    if reasons:
        return VOID, reasons
    reasons.append(
        f"the positive control found the cache (p = {positive.p_value:.3g} < {POSITIVE_ALPHA:g}"
        f"); across tenants p = {negative.p_value:.3g} >= {NEGATIVE_ALPHA} and no cached token "
        f"was reported to the attacker in {len(negative.probe_cached_tokens)} responses"
    )
    return PASS, reasons


async def run_audit(config: AuditConfig) -> AuditReport:
    """Run the positive control, then the cross-tenant test (rerun once on a fail by p alone)."""
    model = config.model or await first_model(config)
    victim = _Client(config, config.victim_key, config.victim_user, model)
    control = _Client(config, config.control_key or config.victim_key, config.victim_user, model)
    attacker = _Client(config, config.attacker_key, config.attacker_user, model)
    try:
        positive = await _run_test("positive control", config, victim, control, "control")
        negative = await _run_test("cross-tenant", config, victim, attacker, "attacker")
        first = None
        if config.rerun_on_fail and negative.max_cached_tokens == 0 and _negative_fails(negative):
            first = negative
            negative = await _run_test("cross-tenant (rerun)", config, victim, attacker, "attacker")
    except aiohttp.ClientError as exc:
        raise AuditError(f"{config.target}: {type(exc).__name__}: {exc}") from None
    finally:
        for client in (victim, control, attacker):
            await client.close()
    verdict, reasons = judge(positive, negative, first)
    return AuditReport(config, model, positive, negative, first, verdict, reasons)


def format_report(report: AuditReport) -> str:
    c = report.config
    lines = [
        f"kvgate audit of {c.target} (model {report.model}): {c.prompt_tokens}-letter prompts, "
        f"{c.samples} hit + {c.samples} miss probes per test, prefix fraction "
        f"{c.prefix_fraction}, {c.victim_requests} victim request(s) per hit",
        "",
    ]
    header = ("test", "D+", "p", "hit median", "miss median", "AP", "probe cached tokens", "time")
    rows = [header]
    tests = [report.positive, report.negative]
    if report.negative_first is not None:
        tests.insert(1, report.negative_first)
    for t in tests:
        nonzero = sum(1 for x in t.probe_cached_tokens if x)
        cached = (
            f"max {t.max_cached_tokens}, {nonzero}/{len(t.probe_cached_tokens)} nonzero"
            if t.reported_usage
            else "not reported"
        )
        rows.append(
            (
                t.name,
                f"{t.statistic:.3f}",
                f"{t.p_value:.3g}",
                f"{t.hit_median_ms:.1f} ms",
                f"{t.miss_median_ms:.1f} ms",
                f"{t.average_precision:.2f}",
                cached,
                f"{t.elapsed_s:.0f} s",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    lines += ["", f"verdict: {report.verdict}", *(f"  - {r}" for r in report.reasons)]
    return "\n".join(lines)


def report_json(report: AuditReport) -> dict[str, Any]:
    def test(t: AuditTest) -> dict[str, Any]:
        return {
            "name": t.name,
            "statistic": t.statistic,
            "p_value": t.p_value,
            "hit_median_ms": t.hit_median_ms,
            "miss_median_ms": t.miss_median_ms,
            "average_precision": t.average_precision,
            "max_cached_tokens": t.max_cached_tokens,
            "elapsed_s": t.elapsed_s,
        }

    config = {k: v for k, v in asdict(report.config).items() if not k.endswith("_key")}
    return {
        "config": config,
        "model": report.model,
        "positive": test(report.positive),
        "negative": test(report.negative),
        "negative_first": test(report.negative_first) if report.negative_first else None,
        "verdict": report.verdict,
        "reasons": report.reasons,
    }


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="base URL (a kvgate, a router, an engine)")
    parser.add_argument("--victim-key", required=True, help="API key of the victim")
    parser.add_argument("--attacker-key", required=True, help="API key of another tenant")
    parser.add_argument(
        "--control-key", help="a second key in the victim's scope (default: the victim's key)"
    )
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="probes of each kind")
    parser.add_argument(
        "--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="tokens per probe prompt"
    )
    parser.add_argument("--model", help="default: the first model the target lists")
    parser.add_argument(
        "--prefix-fraction", type=float, default=1.0, help="share of P the probe repeats"
    )
    parser.add_argument(
        "--victim-requests", type=int, default=1, help="times the victim sends P before a probe"
    )
    parser.add_argument("--victim-user", help="'user' of the victim's requests (per-user scope)")
    parser.add_argument("--attacker-user", help="'user' of the attacker's requests")
    parser.add_argument("--no-rerun", action="store_true", help="no rerun after a fail by p")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_audit_command(args: argparse.Namespace) -> int:
    try:
        config = AuditConfig(
            target=args.target,
            victim_key=args.victim_key,
            attacker_key=args.attacker_key,
            control_key=args.control_key,
            samples=args.samples,
            prompt_tokens=args.prompt_tokens,
            model=args.model,
            prefix_fraction=args.prefix_fraction,
            victim_requests=args.victim_requests,
            victim_user=args.victim_user,
            attacker_user=args.attacker_user,
            rerun_on_fail=not args.no_rerun,
        )
        report = asyncio.run(run_audit(config))
    except (ValueError, AuditError) as exc:
        print(f"kvgate audit: {exc}", file=sys.stderr)
        return EXIT_STATUS[VOID]
    print(json.dumps(report_json(report), indent=2) if args.json else format_report(report))
    return report.exit_status
