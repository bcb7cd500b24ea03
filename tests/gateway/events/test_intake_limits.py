"""Issue 45, item 8: what one broken or hostile engine's feed may cost the gateway, over real
ZMQ sockets (an engine that floods, sends an oversized message, or answers a replay forever)."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from cachemap.events import CPU, GPU, CacheEvent, EventIndex, precise_keys
from gateway.events.decode import MalformedBatch, decode_batch
from gateway.events.intake import REPLAY_SLACK, Feed, FeedConfig, FeedLimits
from gateway.fleet.engine_metrics import EngineMetrics
from gateway.server.app import build
from gateway.settings import DEFAULT_KV_EVENTS_MAX_MESSAGE_BYTES, Settings
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness.processes import free_port

DEADLINE_S = 10.0


async def until(predicate: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def stored(first: int, num_blocks: int, salt: str, medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first, first + num_blocks)),
        "parent_block_hash": None,
        "token_ids": list(range(first, first + 16 * num_blocks)),
        "block_size": 16,
        "medium": medium,
        "extra_keys": [[salt]],
    }


def batch(*events: dict[str, Any], ts: float | None = None) -> bytes:
    payload: bytes = msgspec.msgpack.encode([time.time() if ts is None else ts, list(events)])
    return payload


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


class Ticked(EventIndex):
    """The real index, noting the loop turn (`ticks[0]`, advanced by a task) of each event."""

    def __init__(self, ticks: list[int]) -> None:
        super().__init__()
        self.ticks = ticks
        self.turns: list[int] = []

    def apply(self, domain: str, event: CacheEvent) -> None:
        self.turns.append(self.ticks[0])
        super().apply(domain, event)


async def test_a_message_over_the_size_cap_is_never_read() -> None:
    """An engine sends batches of 1,000 blocks (~50 kB) between one-block ones: the SUB
    refuses the big ones (ZMQ_MAXMSGSIZE drops that connection; it reconnects), the small ones
    still arrive, nothing of a big one is indexed."""
    ctx = zmq.asyncio.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = EventIndex()
    config = FeedConfig("e", 0, "e", f"tcp://127.0.0.1:{port}", None, "")
    default = Feed(config, index, ctx)
    assert default.socket.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_KV_EVENTS_MAX_MESSAGE_BYTES
    default.close()
    feed = Feed(config, index, ctx, limits=FeedLimits(max_message_bytes=8192))
    task = asyncio.get_running_loop().create_task(feed.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        seq = 0
        while feed.stats.batches < 3:  # libzmq drops the connection at each big one
            assert loop.time() < deadline, f"the small batches never arrived: {feed.stats}"
            await pub.send_multipart(frames(seq, batch(stored(10_000 * seq, 1, "small"))))
            big = batch(stored(10_000 * seq + 1, 1000, "big"))
            assert len(big) > 8192
            await pub.send_multipart(frames(seq + 1, big))
            seq += 2
            await asyncio.sleep(0.02)
        assert feed.stats.disconnects >= 2
        assert all(index.num_blocks("e", tier) <= feed.stats.batches for tier in (GPU, CPU))
        for s in range(0, seq, 2):
            keys = precise_keys(list(range(10_000 * s + 1, 10_000 * s + 1 + 16)), "big", 16)
            assert index.lookup(keys, 0.0) == {}
    finally:
        task.cancel()
        feed.close()
        pub.close(linger=0)
        ctx.term()


async def test_a_flood_is_applied_over_several_loop_turns() -> None:
    """40 batches queued at once: one callback applies what fits its budget (at least one
    batch), the rest on later loop turns (before, all in one callback, however long)."""
    ctx = zmq.asyncio.Context()
    endpoint = f"inproc://{uuid.uuid4().hex}"
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    ticks = [0]
    index = Ticked(ticks)
    config = FeedConfig("e", 0, "e", endpoint, None, "")
    feed = Feed(config, index, ctx, limits=FeedLimits(drain_budget_s=0.0))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not feed.socket.poll(10):  # the subscription reaches the PUB on its next send
        assert loop.time() < deadline, "never subscribed"
        await pub.send_multipart(frames(0, batch()))
    feed.drain()
    for seq in range(1, 41):
        await pub.send_multipart(frames(seq, batch(stored(seq * 100, 1, "s"))))
    assert feed.socket.poll(1000)
    feed.drain()  # one read of a lookup's drain: one batch, the budget being 0
    assert len(index.turns) == 1

    async def tick() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    ticker = loop.create_task(tick())
    task = loop.create_task(feed.run())
    try:
        await until(lambda: feed.next_seq == 41, "the flood")
        assert len(index.turns) == 40 and len(set(index.turns)) > 10
    finally:
        ticker.cancel()
        task.cancel()
        feed.close()
        pub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("answer", ["duplicates", "malformed"])
async def test_a_replay_answered_forever_is_cut(answer: str) -> None:
    """The engine's replay socket answers a replay of 5 batches with frame after frame (a
    duplicate seq, or garbage) and never ends it: the replay stops after its span and a slack
    (before, it read until the engine stopped), and the held batch is applied."""
    ctx = zmq.asyncio.Context()
    port = free_port()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    index = EventIndex()
    config = FeedConfig("e", 0, "e", "inproc://unused", f"tcp://127.0.0.1:{port}", "")
    feed = Feed(config, index, ctx, replay_timeout_s=5.0, next_seq=0)
    sent = [0]

    async def engine() -> None:
        identity, *_ = await router.recv_multipart()
        frame = [b"", (0).to_bytes(8, "big"), batch()] if answer == "duplicates" else [b"x"]
        while sent[0] < 100_000:
            await router.send_multipart([identity, *frame])
            sent[0] += 1
            if sent[0] % 16 == 0:
                await asyncio.sleep(0)

    feed.next_seq = 1  # batch 0 applied: the engine's seq 0 frames are duplicates
    task = asyncio.get_running_loop().create_task(engine())
    try:
        await feed.receive(6, batch(stored(600, 1, "s")))
        assert feed.stats.cut_replays == 1 and feed.next_seq == 7
        wasted = feed.stats.duplicates + feed.stats.malformed
        assert 5 <= wasted <= 5 + REPLAY_SLACK and sent[0] < 100_000
    finally:
        task.cancel()
        feed.close()
        router.close(linger=0)
        ctx.term()


async def test_a_domain_past_the_engines_capacity_is_wiped() -> None:
    """An engine whose metrics say 8 GPU blocks announces 6, then 6 more without removing any:
    the domain is wiped (an honest engine never holds more; the index is wrong or the engine
    lies). With no capacity known, `max_blocks` bounds all tiers."""
    index = EventIndex()
    capacity: dict[str, int | None] = {"e": 8}
    limits = FeedLimits(max_blocks=10, capacity=capacity.get)
    ctx = zmq.asyncio.Context()
    feed = Feed(FeedConfig("e", 0, "e", "inproc://x", None, ""), index, ctx, limits=limits)
    await feed.receive(0, batch(stored(100, 6, "s")))
    assert index.num_blocks("e", GPU) == 6 and feed.stats.over_capacity == 0
    await feed.receive(1, batch(stored(200, 6, "s"), stored(300, 1, "s")))
    assert feed.stats.over_capacity == 1 and index.num_blocks("e", GPU) == 0
    capacity["e"] = None  # unknown: the CPU tier too counts against max_blocks
    await feed.receive(2, batch(stored(400, 6, "s"), stored(500, 6, "s", medium="CPU")))
    assert feed.stats.over_capacity == 2 and index.num_blocks("e", CPU) == 0
    await feed.receive(3, batch(stored(600, 10, "s", medium="CPU")))
    assert feed.stats.over_capacity == 2 and index.num_blocks("e", CPU) == 10
    feed.close()
    ctx.term()


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf])
def test_a_timestamp_that_is_not_finite_is_malformed(ts: float) -> None:
    with pytest.raises(MalformedBatch, match="finite"):
        decode_batch(batch(stored(1, 1, "s"), ts=ts))
    with pytest.raises(MalformedBatch, match="finite"):
        decode_batch(msgspec.msgpack.encode({"ts": ts, "events": []}))


async def test_a_gateways_feeds_take_the_engines_capacity_from_its_metrics() -> None:
    """The intake a gateway builds caps each domain at its engine's `num_gpu_blocks` as the
    metrics scrape reads it (unknown until then: `kv_events_max_blocks` alone)."""
    url = "http://127.0.0.1:18000"
    settings = Settings(
        engines=[url],
        tokenizer_dir=MODEL_DIR,
        kv_events_endpoints={url: "tcp://127.0.0.1:15557"},
        kv_events_max_blocks=5000,
        kv_events_max_message_bytes=65536,
    )
    parts = build(settings)
    assert parts.intake is not None
    limits = parts.intake.limits
    assert (limits.max_blocks, limits.max_message_bytes) == (5000, 65536)
    assert limits.capacity(url) is None
    parts.replicas.states[url].metrics = EngineMetrics(num_gpu_blocks=4096)
    assert limits.capacity(url) == 4096
    await parts.intake.close()
