"""Event intake over real ZMQ sockets from real simulated engines: each encoding indexed under
the gateway's own keys, a gap repaired by replay, a late joiner recovering the engine's buffer,
a restart (seq back at 0) and a wipe dropping the domain, a malformed batch skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from cachemap.events import CPU, EventIndex, Match, precise_keys
from gateway.events.intake import EventIntake, EventsConfig, Feed, FeedConfig
from tests.loadgen.test_kv_events import A, B, complete, events_config, free_ports
from tests.servers import Served

TOPIC = "kv"
DEADLINE_S = 10.0


@pytest.fixture
def served(start_engines: Callable[..., list[Served]]) -> Callable[..., Served]:
    """One engine with this test's settings (the shared `start_engines` fixture)."""
    return lambda **config: start_engines(1, **config)[0]


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for a condition the event loop must bring about."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kw)


async def joined(url: str, feeds: list[Feed]) -> None:
    """PUB drops what it sends before a SUB joined: reset the idle engine until each feed has
    seen its AllBlocksCleared."""

    async def reset() -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:  # httpx's 5 s ran out at load 18
            assert (await client.post(url + "/reset_prefix_cache")).status_code == 200

    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not all(f.stats.wipes for f in feeds):
        assert loop.time() < deadline, "the feeds never joined"
        await reset()
        await asyncio.sleep(0.05)


@pytest.fixture
async def intake_for() -> AsyncIterator[Callable[..., EventIntake]]:
    made: list[EventIntake] = []

    def make(replicas: list[str], config: EventsConfig, index: EventIndex) -> EventIntake:
        made.append(EventIntake(config, index, lambda: replicas))
        return made[-1]

    yield make
    for intake in made:
        await intake.close()


@pytest.mark.parametrize("encoding", ["vllm", "vllm-array", "sglang"])
async def test_each_encoding_is_indexed_under_own_keys(
    served: Callable[..., Served], intake_for: Callable[..., EventIntake], encoding: str
) -> None:
    port = free_ports(1)
    engine = served(capacity_blocks=4, kv_events=events_config(port, encoding=encoding))
    index = EventIndex()
    config = EventsConfig(endpoints={engine.url: f"tcp://127.0.0.1:{port}"}, topic=TOPIC)
    intake = intake_for([engine.url], config, index)
    await intake.start()
    await joined(engine.url, intake.feeds())
    await call(complete, engine.url, A, cache_salt="tenant-a")
    keys = precise_keys(A, "tenant-a", 16)
    await until(lambda: index.lookup(keys, 0.0) == {engine.url: Match(2, 0)}, "A's blocks")
    await call(complete, engine.url, B)  # 4 blocks: B evicts one of A's
    b = precise_keys(B, None, 16)
    await until(lambda: engine.url in index.lookup(b, 0.0), "B's blocks")
    assert index.lookup(keys, 0.0) == {engine.url: Match(1, 0)}
    assert intake.live(engine.url) and intake.feeds()[0].stats.malformed == 0


async def test_cpu_offload_keeps_an_evicted_block_on_the_cpu_tier(
    served: Callable[..., Served], intake_for: Callable[..., EventIntake]
) -> None:
    port = free_ports(1)
    engine = served(capacity_blocks=4, cpu_offload_blocks=16, kv_events=events_config(port))
    index = EventIndex()
    intake = intake_for(
        [engine.url],
        EventsConfig(endpoints={engine.url: f"tcp://127.0.0.1:{port}"}, topic=TOPIC),
        index,
    )
    await intake.start()
    await joined(engine.url, intake.feeds())
    await call(complete, engine.url, A)
    await call(complete, engine.url, B)
    keys = precise_keys(A, None, 16)
    b = precise_keys(B, None, 16)
    await until(lambda: engine.url in index.lookup(b, 0.0), "B's blocks")
    await until(lambda: index.num_blocks(engine.url, CPU) == 4, "A's and B's blocks on the CPU")
    # B's prefill evicted one of A's blocks from the GPU: A still matches, one block off-GPU
    assert index.lookup(keys, 0.0) == {engine.url: Match(2, 1)}


async def test_a_gap_is_replayed_and_a_late_joiner_recovers_the_buffer(
    served: Callable[..., Served],
) -> None:
    port = free_ports(2)
    replay = port + 1
    engine = served(kv_events=events_config(port, replay_port=replay))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw = ctx.socket(zmq.SUB)  # captures the stream; the feed gets it with one batch missing
    raw.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    raw.connect(f"tcp://127.0.0.1:{port}")
    actx = zmq.asyncio.Context()
    config = FeedConfig(
        engine.url, 0, engine.url, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", TOPIC
    )
    index = EventIndex()
    feed = Feed(config, index, actx)
    try:
        frames: list[list[bytes]] = []
        while not frames:  # join: resets until the raw socket sees one
            await call(httpx.post, engine.url + "/reset_prefix_cache")
            if raw.poll(100):
                frames.append(raw.recv_multipart())
        await call(complete, engine.url, A, cache_salt="s")
        await call(complete, engine.url, B, cache_salt="s")
        while len(frames) < 3:
            assert raw.poll(5000), "no batch"
            frames.append(raw.recv_multipart())
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs[1:] == [seqs[0] + 1, seqs[0] + 2]
        # a late joiner: its first batch is A's (seq > 0), so it replays the buffer from 0
        await feed.receive(seqs[1], frames[1][2])
        assert feed.stats.replays == 1 and feed.stats.replayed_batches == seqs[1]
        # drop A's store, as if it were wiped in between, then a gap: B arrives before A's batch
        index.clear(engine.url)
        feed.next_seq = seqs[1]
        await feed.receive(seqs[2], frames[2][2])
        assert feed.stats.gaps == 1 and feed.stats.unrepaired_gaps == 0
        assert index.lookup(precise_keys(A, "s", 16), 0.0) == {engine.url: Match(2, 0)}
        assert index.lookup(precise_keys(B, "s", 16), 0.0) == {engine.url: Match(2, 0)}
        # a malformed batch is counted and skipped, the seq still advances
        await feed.receive(seqs[2] + 1, b"\xc1 garbage")
        assert feed.stats.malformed == 1 and feed.next_seq == seqs[2] + 2
        # so is one whose token ids no tokenizer has (it raised out of the feed before)
        negative = msgspec.msgpack.encode([1.0, [["BlockStored", [9], None, [-5] * 16, 16]]])
        await feed.receive(seqs[2] + 2, negative)
        assert feed.stats.malformed == 2 and feed.next_seq == seqs[2] + 3
        # seq back at 0: the engine restarted, everything it announced is gone
        await feed.receive(0, frames[0][2])
        assert feed.stats.restarts == 1 and index.lookup(precise_keys(B, "s", 16), 0.0) == {}
    finally:
        feed.close()
        raw.close(linger=0)
        actx.term()


async def test_a_wipe_drops_the_domain_and_a_left_replica_is_dropped(
    served: Callable[..., Served], intake_for: Callable[..., EventIntake]
) -> None:
    ports = free_ports(2)
    engines = [served(kv_events=events_config(ports + i)) for i in range(2)]
    urls = [e.url for e in engines]
    index = EventIndex()
    endpoints = {u: f"tcp://127.0.0.1:{ports + i}" for i, u in enumerate(urls)}
    replicas = list(urls)
    intake = EventIntake(EventsConfig(endpoints=endpoints, topic=TOPIC), index, lambda: replicas)
    try:
        await intake.start()
        for url in urls:
            await joined(url, intake.feeds(url))
            await call(complete, url, A)
        keys = precise_keys(A, None, 16)
        await until(lambda: len(index.lookup(keys, 0.0)) == 2, "A on both")
        wipes = intake.feeds(urls[0])[0].stats.wipes
        await call(httpx.post, urls[0] + "/reset_prefix_cache")
        await until(lambda: intake.feeds(urls[0])[0].stats.wipes > wipes, "the wipe")
        assert index.lookup(keys, 0.0) == {urls[1]: Match(2, 0)}
        replicas.remove(urls[1])
        intake.refresh()
        assert index.lookup(keys, 0.0) == {} and intake.feeds(urls[1]) == []
    finally:
        await intake.close()


async def test_a_gap_a_lookups_drain_finds_is_replayed_without_another_batch(
    served: Callable[..., Served], intake_for: Callable[..., EventIntake]
) -> None:
    """A lookup's drain reads a batch whose seq asks for a replay and holds it for the feed's
    task; the task replays at once, not only when the engine next publishes (before, the
    drain took the wake-up the task's poll waited for, and the task slept until then)."""
    port = free_ports(2)
    engine = served(kv_events=events_config(port, replay_port=port + 1))
    url = engine.url
    config = EventsConfig(
        endpoints={url: f"tcp://127.0.0.1:{port}"},
        replay_endpoints={url: f"tcp://127.0.0.1:{port + 1}"},
        topic=TOPIC,
    )
    index = EventIndex()
    intake = intake_for([url], config, index)
    await intake.start()
    [feed] = intake.feeds(url)
    await joined(url, [feed])
    await call(complete, url, A, cache_salt="s")
    keys = precise_keys(A, "s", 16)
    await until(lambda: index.lookup(keys, 0.0) == {url: Match(2, 0)}, "A's blocks")
    assert feed.next_seq is not None
    feed.next_seq -= 1  # as if A's batch had been missed: the next batch is a gap
    index.clear(url)
    # the loop held (a blocking call: the engine serves from its own thread) until B's batch
    # is on the socket, so the lookup's drain reads it before the feed's reader can
    complete(url, B, cache_salt="s")
    assert feed.socket.poll(DEADLINE_S * 1000), "B's batch never reached the socket"
    intake.drain()
    assert feed.stats.replays == 0 and feed.stats.gaps == 0  # held for the task
    # the engine stays idle: A's batch is back only if the task replayed at once (the count
    # of replays goes up as the replay is asked for, before its batches are applied)
    await until(lambda: index.lookup(keys, 0.0) == {url: Match(2, 0)}, "A's batch, replayed")
    assert feed.stats.replays == 1 and feed.stats.unrepaired_gaps == 0
    assert index.lookup(precise_keys(B, "s", 16), 0.0) == {url: Match(2, 0)}
