"""The pod view's channel and how a follower adopts it (gateway.fleet.podview,
`ReplicaSet.adopt`): real AF_UNIX datagram socket pairs, real stand-in replicas on loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest

from cachemap.layouts import EngineLayout
from gateway.fleet.engine_metrics import EngineMetrics
from gateway.fleet.podview import (
    VIEW_CHUNK_BYTES,
    MemberEntry,
    MembersAssembly,
    MembersPart,
    ViewEntry,
    ViewReceiver,
    ViewSender,
    decode,
    decode_message,
    encode,
    encode_members,
)
from gateway.fleet.replicas import ReplicaSet
from loadgen.bench.idle import StandInLog, stand_ins


def entry(i: int, **kw: object) -> ViewEntry:
    fields: dict[str, object] = {
        "url": f"http://10.0.{i // 250}.{i % 250}:8000",
        "healthy": True,
        "since_s": 100.0 + i,
        "models": ("m",),
        "max_model_len": 32768,
        "metrics": EngineMetrics(num_waiting=3.0, num_running=1.0, start_time_s=1.7e9),
        "scraped_s": 99.0,
    }
    return ViewEntry(**(fields | kw))  # type: ignore[arg-type]


def test_a_large_fleet_is_split_into_datagrams_that_each_decode_alone() -> None:
    entries = [entry(i) for i in range(1000)]
    datagrams = list(encode(entries))
    assert len(datagrams) > 1
    assert all(len(d) <= VIEW_CHUNK_BYTES for d in datagrams)
    assert [e for d in datagrams for e in decode(d)] == entries
    bare = ViewEntry("http://x:1", healthy=False, since_s=5.0)
    assert decode(next(encode([bare]))) == [bare]


def test_an_endpoint_set_applies_only_whole_and_only_when_newer() -> None:
    """Discovery's endpoint sets (one watch per pod): a large set spans datagrams, each
    bounded; a follower applies it once every part of one number is in, never half of it (half
    a set would remove the other half's replicas), and never an older set after a newer."""
    members = [
        MemberEntry(f"http://10.1.{i // 250}.{i % 250}:8000", i % 3 != 0, f"uid-{i}", f"vllm-{i}")
        for i in range(1000)
    ]
    members[1] = MemberEntry("http://annotated:8000", True, "u", "p", EngineLayout(6000, None, 2))
    datagrams = encode_members(7, members)
    assert len(datagrams) > 1 and all(len(d) <= VIEW_CHUNK_BYTES + 64 for d in datagrams)
    parts = [decode_message(d) for d in datagrams]
    assert all(isinstance(p, MembersPart) for p in parts)
    assembly = MembersAssembly()
    *first, last = [p for p in parts if isinstance(p, MembersPart)]
    assert all(assembly.add(p) is None for p in reversed(first))  # in any order
    assert assembly.add(last) == members
    assert assembly.add(last) is None  # a duplicate of an applied set
    older = decode_message(encode_members(6, members[:1])[0])
    assert isinstance(older, MembersPart) and assembly.add(older) is None
    empty = decode_message(encode_members(8, [])[0])  # every discovered replica left
    assert isinstance(empty, MembersPart) and assembly.add(empty) == []
    # the view's own datagrams still decode as view entries
    assert decode_message(next(encode([entry(0)]))) == [entry(0)]
    for bad in (b'{"k":"members","v":9,"i":3,"n":2,"e":[]}', b'{"k":"other"}', b"[{}]"):
        with pytest.raises((ValueError, KeyError, TypeError)):
            decode_message(bad)


async def test_a_full_queue_drops_without_blocking_and_the_receiver_counts_bad_datagrams() -> None:
    send, receive = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender = ViewSender([send])
    for _ in range(5000):  # nobody reads: the queue fills, sends are dropped, none blocks
        sender.send([entry(0)])
    assert sender.dropped > 0 and sender.sent > 0
    got: list[list[ViewEntry]] = []
    arrived = asyncio.Event()

    async def adopt(entries: list[ViewEntry]) -> None:
        got.append(entries)
        if len(got) == sender.sent:
            arrived.set()

    receiver = ViewReceiver(receive, adopt)
    task = asyncio.create_task(receiver.run())
    try:
        await asyncio.wait_for(arrived.wait(), 10)
        assert receiver.received == sender.sent and got[0] == [entry(0)]
        arrived.clear()
        send.send(b"{not json")
        sender.send([entry(1)])  # datagrams arrive in order: the bad one was read first
        await asyncio.wait_for(arrived.wait(), 10)
        assert receiver.malformed == 1 and got[-1] == [entry(1)]
    finally:
        task.cancel()
        sender.close()
        receiver.close()


async def _restarted(_: str) -> None:
    return None


@pytest.fixture
def log() -> StandInLog:
    return StandInLog()


async def test_the_newer_evidence_of_up_or_down_wins(log: StandInLog) -> None:
    with stand_ins(1, log) as urls:
        follower = ReplicaSet(
            urls, interval_s=60.0, timeout_s=1.0, unhealthy_after=2, on_restart=_restarted
        )
        async with aiohttp.ClientSession() as session:
            await follower.start(session)
            try:
                state = follower.states[urls[0]]
                assert state.healthy
                follower.mark_down(urls[0], "a connection failed here")
                # worker 0's view from before our failure does not bring it back...
                old = time.monotonic() - 10.0
                await follower.adopt([entry(0, url=urls[0], since_s=old)])
                assert not state.healthy
                # ...its next answer does, and its figures are read as our own scrape
                state.num_prefilling = 2
                now = time.monotonic()
                figures = EngineMetrics(num_waiting=7.0, start_time_s=1.7e9)
                await follower.adopt(
                    [entry(0, url=urls[0], since_s=now, metrics=figures, scraped_s=now)]
                )
                assert state.healthy and state.metrics == figures
                assert state.own_waiting_at_scrape == 2
                assert follower._covered(state, time.monotonic())
                # worker 0 saw it go down after the last answer this worker had
                await follower.adopt([entry(0, url=urls[0], healthy=False, since_s=now + 1)])
                assert not state.healthy
                # a replica this worker does not route to is ignored
                await follower.adopt([entry(1)])
                assert list(follower.states) == urls
            finally:
                await follower.stop()
