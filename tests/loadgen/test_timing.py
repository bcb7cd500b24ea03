"""The engine's timing model and scheduler in virtual time: exact schedules."""

from __future__ import annotations

import pytest

from loadgen.engine.timing import FINISHED, FIRST_TOKEN, EngineCore, Job, PrefixCache, TimingModel

MODEL = TimingModel(prefill_tokens_per_s=1000.0, decode_s_per_token=0.01, max_batch=2)


def job(name: str, blocks: list[bytes], prompt: int = 100, out: int = 11) -> Job:
    return Job(name, blocks, prompt, out, block_size=10, max_cached_tokens=prompt - 1)


def run(core: EngineCore, until: float = 1e9) -> list[tuple[float, str, str]]:
    events = []
    while (t := core.next_event_time()) is not None and t <= until:
        events += [(round(at, 6), kind, j.id) for at, kind, j in core.advance(t)]
    return events


def test_prefill_is_fcfs_and_proportional_to_uncached_tokens() -> None:
    core = EngineCore(MODEL, PrefixCache(100))
    core.submit(0.0, job("a", [b"a%d" % i for i in range(10)]))
    core.submit(0.0, job("b", [b"b%d" % i for i in range(10)]))
    assert run(core) == [
        (0.1, FIRST_TOKEN, "a"),  # 100 tokens at 1000/s
        (0.2, FINISHED, "a"),  # 10 more tokens at 10 ms (scheduled before b started)
        (0.2, FIRST_TOKEN, "b"),  # queued behind a's prefill
        (0.3, FINISHED, "b"),
    ]


def test_a_sibling_that_starts_before_the_first_token_misses_and_a_later_one_hits() -> None:
    core = EngineCore(TimingModel(1000.0, 0.01, max_batch=8), PrefixCache(100))
    shared = [b"s%d" % i for i in range(10)]
    first, sibling = job("first", shared), job("sibling", shared)
    core.submit(0.0, first)
    core.submit(0.0, sibling)  # starts at 0.1, when first's KV has just landed
    late = job("late", shared)
    run(core, until=0.15)
    core.submit(0.15, late)
    run(core)
    assert first.cached_tokens == 0
    assert sibling.cached_tokens == 99  # every block, capped one token short of the prompt
    assert late.cached_tokens == 99
    assert sibling.first_token_s == pytest.approx(0.101)  # one uncached token after first's
    assert late.first_token_s == pytest.approx(0.151)  # the prefill server was free again
    for j in (first, sibling, late):
        assert j.cached_tokens + j.uncached_tokens == j.num_prompt_tokens


def test_concurrent_identical_requests_are_each_a_write_when_prefills_overlap() -> None:
    core = EngineCore(TimingModel(1000.0, 0.01, max_batch=8), PrefixCache(100))
    shared = [b"s%d" % i for i in range(10)]
    jobs = [job(f"j{i}", shared) for i in range(3)]
    for j in jobs:
        core.submit(0.0, j)
    run(core)
    assert [j.cached_tokens for j in jobs] == [0, 99, 99]  # FCFS prefill serialises them


def test_the_batch_is_bounded_and_the_queue_head_waits_for_a_slot() -> None:
    core = EngineCore(MODEL, PrefixCache(100))  # max_batch 2
    for name in "abc":
        core.submit(0.0, job(name, [name.encode()], prompt=10, out=101))
    events = run(core)
    starts = {e[2]: e[0] for e in events if e[1] == FIRST_TOKEN}
    assert starts == {"a": 0.01, "b": 0.02, "c": pytest.approx(1.02)}  # c waits for a to finish
    assert core.num_running == 0


def test_lru_eviction_at_capacity_takes_a_chains_tail_first() -> None:
    cache = PrefixCache(4)
    cache.insert([b"a0", b"a1", b"a2"])
    cache.insert([b"b0", b"b1"])  # 5 > 4: a2 goes
    assert cache.match([b"a0", b"a1", b"a2"]) == 2
    assert cache.num_evictions == 1
    cache.insert([b"c0"])  # now the least recent is b1 (a was touched by match)
    assert cache.match([b"b0", b"b1"]) == 1


def test_time_scale_divides_every_duration() -> None:
    fast = TimingModel(1000.0, 0.01, time_scale=10.0)
    assert fast.prefill_s(1000) == pytest.approx(0.1)
    assert fast.decode_s(10) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="time_scale"):
        TimingModel(time_scale=0)


def test_aborting_frees_queue_and_slots() -> None:
    core = EngineCore(MODEL, PrefixCache(100))
    a, b, c = (job(n, [n.encode()], prompt=10, out=1001) for n in "abc")
    for j in (a, b, c):
        core.submit(0.0, j)
    assert core.num_waiting == 2
    core.abort(0.0, c)  # still queued: leaves at once
    assert core.num_waiting == 1
    run(core, until=0.05)
    core.abort(0.05, a)  # decoding: its slot frees now
    assert core.num_running == 1
    assert core.counters.requests_aborted == 2
    events = run(core)
    assert [e[2] for e in events if e[1] == FINISHED] == ["b"]
