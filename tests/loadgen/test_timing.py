"""The engine's timing model and scheduler in virtual time: exact schedules.

Rates are powers of two (1,024 tokens/s, 1/64 s steps) so every time below is exact in binary.
"""

from __future__ import annotations

import itertools

import pytest

from loadgen.engine.kvpool import CPU, GPU, BlockPool, Cleared, Removed, Stored
from loadgen.engine.timing import (
    FINISHED,
    FIRST_TOKEN,
    TOKEN,
    EngineCore,
    Job,
    PrefixCache,
    TimingModel,
)

STEP = 1 / 64
MODEL = TimingModel(
    prefill_tokens_per_s=1024.0,
    decode_s_per_token=STEP,
    max_batch=2,
    decode_s_per_seq=0.0,
    decode_s_per_context_token=0.0,
)
WIDE = TimingModel(1024.0, STEP, max_batch=8, decode_s_per_seq=0.0, decode_s_per_context_token=0.0)


def job(name: str, blocks: list[bytes], prompt: int = 128, out: int = 11, **extra: object) -> Job:
    return Job(name, blocks, prompt, out, block_size=16, max_cached_tokens=prompt - 1, **extra)  # type: ignore[arg-type]


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def run(core: EngineCore, until: float = 1e9) -> list[tuple[float, str, str]]:
    events = []
    while (t := core.next_event_time()) is not None and t <= until:
        events += [(at, kind, j.id) for at, kind, j in core.advance(t)]
    return events


def test_prefill_is_fcfs_and_proportional_to_uncached_tokens() -> None:
    core = EngineCore(MODEL, BlockPool(100))
    core.submit(0.0, job("a", chain("a", 8)))
    core.submit(0.0, job("b", chain("b", 8)))
    assert run(core) == [
        (0.125, FIRST_TOKEN, "a"),  # 128 tokens at 1,024/s
        (0.25, FIRST_TOKEN, "b"),  # queued behind a's prefill
        (0.28125, FINISHED, "a"),  # 10 more tokens in 10 steps of 1/64 s
        (0.40625, FINISHED, "b"),  # b joined at the step boundary 0.25
    ]


def test_decode_slows_with_the_batch_and_its_context_as_the_model_says() -> None:
    model = TimingModel(
        1e9, decode_s_per_token=0.010, decode_s_per_seq=0.002, decode_s_per_context_token=1e-5
    )
    assert model.step_s(1, 0) == pytest.approx(0.012)
    assert model.step_s(4, 0) == pytest.approx(0.018)
    assert model.step_s(1, 1000) == pytest.approx(0.022)  # 1,000 tokens of KV add 10 ms

    def gaps(num_others: int, prompt: int) -> list[float]:
        """The last request's inter-token gaps: its prefill (~1 ns) ends while the first
        request's first step runs, so it and the others join at that step's end, in lockstep."""
        core = EngineCore(model, BlockPool(1000), stream_tokens=True)
        core.submit(0.0, job("warm", [], prompt=10, out=100))
        jobs = [job(f"j{i}", [], prompt=prompt, out=4) for i in range(num_others + 1)]
        for j in jobs:
            core.submit(0.0, j)
        times = [at for at, kind, j in core.advance(10.0) if j is jobs[-1] and kind != FIRST_TOKEN]
        return [b - a for a, b in itertools.pairwise(times)]

    # alone beside the warm request (batch 2): 10 ms + 2 × 2 ms + 1e-5 s per token of context:
    # 23 tokens (12 + 11) at the second step, 25 at the third
    assert gaps(0, 10) == pytest.approx([0.01425, 0.01427])
    # in a batch of 5 the same steps cost 6 ms more: 56 + 5 then 61 + 5 tokens of context
    assert gaps(3, 10) == pytest.approx([0.02061, 0.02066])
    # and long prompts cost their KV read: 1,000-token prompts, batch 2
    assert gaps(0, 1000) == pytest.approx([0.014 + 1015e-5, 0.014 + 1017e-5])


def test_running_requests_hold_kv_so_a_request_waits_for_blocks_not_just_for_a_slot() -> None:
    """10 blocks of 16 tokens; a needs all of them (80 prompt + 80 output tokens)."""
    pool = BlockPool(10)
    core = EngineCore(WIDE, pool)
    a = job("a", chain("a", 5), prompt=80, out=80, final_hashes=chain("a", 10))
    b = job("b", chain("b", 1), prompt=16, out=16)
    core.submit(0.0, a)
    core.submit(0.0, b)
    assert core.num_running == 1 and core.num_waiting == 1  # a slot is free, blocks are not
    assert pool.usage == 1.0  # vLLM's meaning: the share of blocks running requests use
    run(core, until=a.first_token_s or 0)
    assert len(pool) == 5  # the prompt's blocks are stored at the first token, still held
    run(core)
    assert b.start_s == a.finish_s  # b started the moment a released its blocks
    assert pool.usage == 0.0  # nothing runs: the cached blocks count as free
    # a's 10 blocks were cached when it ended; b took 2 blocks and evicted a's chain tail first
    assert pool.match(chain("a", 10)) == 8
    assert pool.num_evictions == 2
    assert b.cached_tokens == 0


def test_a_sibling_that_starts_before_the_first_token_misses_and_a_later_one_hits() -> None:
    core = EngineCore(WIDE, BlockPool(100))
    shared = chain("s", 8)
    first, sibling = job("first", shared), job("sibling", shared)
    core.submit(0.0, first)
    core.submit(0.0, sibling)  # starts at 0.125, when first's KV has just landed
    late = job("late", shared)
    run(core, until=0.15)
    core.submit(0.15, late)
    run(core)
    assert first.cached_tokens == 0
    assert sibling.cached_tokens == 127  # every block, capped one token short of the prompt
    assert late.cached_tokens == 127
    assert sibling.first_token_s == 0.125 + 1 / 1024  # one uncached token after first's
    assert late.first_token_s == 0.15 + 1 / 1024
    for j in (first, sibling, late):
        assert j.cached_tokens + j.uncached_tokens == j.num_prompt_tokens


def test_concurrent_identical_requests_are_each_a_write_when_prefills_overlap() -> None:
    core = EngineCore(WIDE, BlockPool(100))
    jobs = [job(f"j{i}", chain("s", 8)) for i in range(3)]
    for j in jobs:
        core.submit(0.0, j)
    run(core)
    assert [j.cached_tokens for j in jobs] == [0, 127, 127]  # FCFS prefill serialises them


def test_the_batch_is_bounded_and_the_queue_head_waits_for_a_slot() -> None:
    core = EngineCore(MODEL, BlockPool(100))  # max_batch 2
    for name in "abc":
        core.submit(0.0, job(name, [], prompt=16, out=65))
    events = run(core)
    starts = {e[2]: e[0] for e in events if e[1] == FIRST_TOKEN}
    # a's first token at 1/64; b's at 2/64; a ends 64 steps after its first; c waits for it
    assert starts == {"a": 1 / 64, "b": 2 / 64, "c": 65 / 64 + 1 / 64}
    assert core.num_running == 0


def test_one_token_per_step_and_the_last_one_finishes() -> None:
    core = EngineCore(MODEL, BlockPool(100), stream_tokens=True)
    core.submit(0.0, job("a", [], prompt=16, out=4))
    assert run(core) == [
        (1 / 64, FIRST_TOKEN, "a"),
        (2 / 64, TOKEN, "a"),
        (3 / 64, TOKEN, "a"),
        (4 / 64, FINISHED, "a"),
    ]
    assert core.counters.num_steps == 3
    assert core.counters.busy_decode_s == 3 / 64


def test_events_stored_once_reused_silently_evicted_as_they_happen_and_cleared() -> None:
    pool = BlockPool(4, record_events=True)
    assert pool.log is not None
    core = EngineCore(WIDE, pool)
    ids = list(range(100, 100 + 48))
    a = job("a", chain("a", 2), prompt=32, out=1, token_ids=ids, cache_salt="t1")
    core.submit(0.0, a)
    assert core.reset_prefix_cache() is False  # refused while a holds blocks, as vLLM does
    run(core)
    assert pool.log.take() == [
        Stored((b"a0", b"a1"), None, tuple(ids[:32]), 16, GPU, "t1"),
    ]
    again = job("again", chain("a", 2), prompt=32, out=1)
    core.submit(1.0, again)
    run(core)
    assert pool.log.take() == []  # a hit re-announces nothing
    b = job("b", chain("b", 3), prompt=48, out=1, token_ids=list(range(48)))
    core.submit(2.0, b)  # needs 3 of 4 blocks: evicts a's tail (a1), then a0 at its store
    run(core)
    assert pool.log.take() == [
        Removed((b"a1", b"a0"), GPU),
        Stored((b"b0", b"b1", b"b2"), None, tuple(range(48)), 16, GPU, None),
    ]
    assert core.reset_prefix_cache() is True
    assert pool.log.take() == [Cleared()]
    assert len(pool) == 0


def test_write_through_cpu_offload_keeps_what_the_gpu_evicts_and_a_cpu_hit_is_cheap() -> None:
    model = TimingModel(1024.0, 0.0, decode_s_per_seq=0.0, decode_s_per_context_token=0.0)
    pool = BlockPool(4, cpu_blocks=6, record_events=True)
    assert pool.log is not None and pool.cpu is not None
    core = EngineCore(model, pool)
    a = job("a", chain("a", 3), prompt=49, out=1)
    core.submit(0.0, a)
    run(core)
    stored = pool.log.take()
    assert [(type(e).__name__, e.medium) for e in stored] == [  # type: ignore[union-attr]
        ("Stored", GPU),
        ("Stored", CPU),
    ]
    b = job("b", chain("b", 3), prompt=49, out=1)
    core.submit(1.0, b)  # evicts a's 3 GPU blocks; the CPU keeps them
    run(core)
    events = pool.log.take()
    assert Removed((b"a2", b"a1", b"a0"), GPU) in events
    assert not any(isinstance(e, Removed) and e.medium == CPU for e in events)
    again = job("again", chain("a", 3), prompt=49, out=1)
    core.submit(2.0, again)
    run(core)
    assert again.cached_tokens == 48 and again.cpu_cached_tokens == 48
    # 1 uncached token plus 48 loaded at 7% of a prefill
    assert again.first_token_s == pytest.approx(2.0 + (1 + 48 * 0.07) / 1024)
    c = job("c", chain("c", 4), prompt=64, out=1)
    core.submit(3.0, c)  # 4 more blocks on a CPU of 6: the CPU evicts its least recent (b's)
    run(core)
    assert Removed((b"b2", b"b1", b"b0", b"a2"), CPU) in pool.log.take()


def test_lru_eviction_at_capacity_takes_a_chains_tail_first() -> None:
    cache = PrefixCache(4)
    cache.insert([b"a0", b"a1", b"a2"])
    cache.insert([b"b0", b"b1"])  # 5 > 4: a2 goes
    assert cache.match([b"a0", b"a1", b"a2"]) == 2
    assert cache.num_evictions == 1
    cache.insert([b"c0"])  # now the least recent is b1 (a was touched by match)
    assert cache.match([b"b0", b"b1"]) == 1


def test_time_scale_divides_every_duration() -> None:
    fast = TimingModel(1000.0, 0.01, time_scale=10.0, decode_s_per_seq=0.002)
    assert fast.prefill_s(1000) == pytest.approx(0.1)
    assert fast.step_s(1, 0) == pytest.approx(0.0012)
    with pytest.raises(ValueError, match="time_scale"):
        TimingModel(time_scale=0)
    with pytest.raises(ValueError, match="decode_s_per_seq"):
        TimingModel(decode_s_per_seq=-1)


def test_aborting_frees_queue_slots_and_blocks() -> None:
    pool = BlockPool(200)  # room for three requests of 64 blocks
    core = EngineCore(MODEL, pool)
    a, b, c = (job(n, [], prompt=16, out=1001) for n in "abc")
    for j in (a, b, c):
        core.submit(0.0, j)
    assert core.num_waiting == 2  # b waits for a's prefill, c for a slot too (max_batch 2)
    core.abort(0.0, c)  # still queued: leaves at once
    assert core.num_waiting == 1
    run(core, until=0.05)
    used = pool.num_used
    core.abort(0.05, a)  # decoding: its slot and its 64 blocks free now
    assert core.num_running == 1 and pool.num_used == used - a.num_blocks
    assert core.counters.requests_aborted == 2
    events = run(core)
    assert [e[2] for e in events if e[1] == FINISHED] == ["b"]
    assert pool.num_used == 0


def test_a_request_larger_than_the_cache_holds_all_of_it_runs_alone_and_stores_what_fits() -> None:
    pool = BlockPool(4)
    core = EngineCore(WIDE, pool)
    big = job("big", chain("g", 6), prompt=96, out=16)  # needs 7 blocks of a cache of 4
    small = job("small", [], prompt=16, out=1)
    core.submit(0.0, big)
    core.submit(0.0, small)
    assert pool.usage == 1.0 and core.num_waiting == 1
    run(core)
    assert big.finish_s is not None and small.start_s == big.finish_s
    assert pool.match(chain("g", 6)) <= 4
