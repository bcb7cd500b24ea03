"""The max-rate ramp: which step comes next, when a step holds, and one that cannot."""

from __future__ import annotations

import math

import httpx
import orjson
import pytest

from loadgen.bench.fast_engine import PrefixCache, fast_engines
from loadgen.bench.rate import RateOptions, Step, next_rate, ramp, sustained
from loadgen.harness import processes

OPTIONS = RateOptions(start_rps=20.0, factor=1.5, max_steps=3, step_s=1.0, p99_ttft_s=0.25)


def step(rate: float, held: bool) -> Step:
    return Step(rate, 10, 10 if held else 0, 0 if held else 10, 10.0, 0.01, 0.02, held)


def test_the_ramp_multiplies_until_a_step_fails_then_refines_once() -> None:
    assert next_rate([], OPTIONS) == 20.0
    assert next_rate([step(20, True)], OPTIONS) == 30.0
    assert next_rate([step(20, True), step(30, True)], OPTIONS) == 45.0
    # 45 failed: one more step between the last that held and it, then stop either way
    refine = next_rate([step(20, True), step(30, True), step(45, False)], OPTIONS)
    assert refine == pytest.approx(math.sqrt(30 * 45))
    assert (
        next_rate([step(20, True), step(30, True), step(45, False), step(36.7, True)], OPTIONS)
        is None
    )
    assert (
        next_rate([step(20, True), step(30, True), step(45, False), step(36.7, False)], OPTIONS)
        is None
    )
    # every step held: max_steps ends it (the table says "≥ 45")
    assert next_rate([step(20, True), step(30, True), step(45, True)], OPTIONS) is None
    # not even the first held: nothing to refine towards
    assert next_rate([step(20, False)], OPTIONS) is None
    assert next_rate([], RateOptions(max_steps=0)) is None


def test_a_step_holds_on_few_errors_and_a_short_tail() -> None:
    assert sustained(errors=1, sent=100, ttft_p99_s=0.25, options=OPTIONS)
    assert not sustained(errors=2, sent=100, ttft_p99_s=0.01, options=OPTIONS)  # > 1% failed
    assert not sustained(errors=0, sent=100, ttft_p99_s=0.26, options=OPTIONS)  # a queue built
    assert not sustained(errors=0, sent=0, ttft_p99_s=0.0, options=OPTIONS)
    with pytest.raises(ValueError, match="--rate-factor must be above 1"):
        RateOptions(factor=1.0)


def test_a_target_that_refuses_every_connection_sustains_nothing() -> None:
    body = orjson.dumps({"model": "m", "messages": [], "stream": True})
    url = f"http://127.0.0.1:{processes.free_port()}"  # nothing listens there
    result = ramp([url], None, [body], RateOptions(start_rps=20.0, max_steps=3, step_s=0.25))
    assert result.max_sustained_rps is None and not result.reached_last_step
    (only,) = result.steps  # the first step failed and there is nothing below it to refine to
    assert only.sent == 5 and only.errors == 5 and only.ok == 0 and not only.sustained
    assert only.first_error.startswith("ClientConnectorError")


def test_a_stand_in_reports_the_prefix_it_has_seen_as_cached_as_an_engine_would() -> None:
    # without it, a gateway predicting a shared prefix reads "no cached token" on every answer
    # and suspects the replica of a restart each time: a probe, a scrape and an expiry a request
    cache = PrefixCache(chunk_bytes=4, max_entries=100)
    assert cache.cached_bytes("a", b"abcdefgh1234") == 0  # never seen
    assert cache.cached_bytes("a", b"abcdefgh5678xy") == 8  # the whole chunks in common
    assert cache.cached_bytes("a", b"abcdefgh5678xy") == 12  # a partial chunk is never cached
    assert cache.cached_bytes("b", b"abcdefgh5678xy") == 0  # another replica's cache
    assert cache.cached_bytes("a", b"bcdefgh5678") == 0
    full = PrefixCache(chunk_bytes=4, max_entries=8)
    full.cached_bytes("a", b"x" * 40)  # more chunks than it keeps: it starts again
    assert full.cached_bytes("a", b"x" * 8) == 0 and full.cached_bytes("a", b"x" * 8) == 8


@pytest.mark.e2e
def test_the_stand_in_engines_stream_at_once_and_the_ramp_holds_at_low_rates() -> None:
    body = {
        "model": "kvgate-sim-8b",
        "messages": [{"role": "user", "content": "hello " * 100}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with fast_engines(2) as stand_ins:
        answer = httpx.post(stand_ins.urls[1] + "/v1/chat/completions", json=body, timeout=5.0)
        events = [e for e in answer.text.split("\n\n") if e]
        assert answer.status_code == 200 and events[-1] == "data: [DONE]"
        chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert [c["choices"][0]["delta"]["content"] for c in chunks[:3]] == [" tok"] * 3
        assert chunks[3]["usage"]["completion_tokens"] == 3 and chunks[3]["choices"] == []
        assert chunks[3]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = httpx.post(stand_ins.urls[1] + "/v1/chat/completions", json=body, timeout=5.0)
        usage = orjson.loads(again.text.split("\n\n")[-3].removeprefix("data: "))["usage"]
        assert 0.8 * usage["prompt_tokens"] <= usage["prompt_tokens_details"]["cached_tokens"]
        assert httpx.get(stand_ins.urls[0] + "/v1/models").json()["data"][0]["owned_by"] == "vllm"
        result = ramp(
            stand_ins.urls,
            None,
            [orjson.dumps(body)],
            RateOptions(start_rps=10.0, max_steps=2, step_s=0.5, p99_ttft_s=3.0),
        )
    assert [s.offered_rps for s in result.steps] == [10.0, 15.0]
    assert result.reached_last_step and result.max_sustained_rps == 15.0
    assert all(s.errors == 0 and s.ok == s.sent for s in result.steps)
