"""Precise mode's costs (issue 16; docs/benchmarks-archive.md).

    python -m tools.precise_cost ingest [NUM_BLOCKS] [BLOCKS_PER_EVENT]
                                                        event ingest, blocks indexed per second
    python -m tools.precise_cost keying [TURNS]         CPU per request, precise vs approximate
    python -m tools.precise_cost long [PROMPTS]         the same on one-message prompts sharing
                                                        beginnings (bench point 2's shape)
    python -m tools.precise_cost wipe [TRIALS] [shared] stale lookups after a wipe, time to detect
                                                        (shared: through the index in Redis)
    python -m tools.precise_cost images [REQUESTS] [KB] keying a chat with an image of KB kilobytes
                                                        against the same chat without it
    python -m tools.precise_cost redis [NUM_BLOCKS]     event blocks written into a shared Redis
    python -m tools.precise_cost shared [NUM_BLOCKS]    the same through the event index in Redis
                                                        (`EventWriter`): a server and a cluster
    python -m tools.precise_cost route [TURNS]          a continuation's lookups past its keying,
                                                        the prediction walked or not
    python -m tools.precise_cost fleet [REPLICAS ...]   the intake's per-request work (drain every
                                                        candidate's sockets, which of them are live)
                                                        against the fleet's size
    python -m tools.precise_cost speculation [PROMPTS]  speculation's own CPU a new prompt: its
                                                        entries made, confirmed by its store, swept

`ingest`: NUM_BLOCKS (131,072) blocks in vLLM map-encoded batches of one BlockStored of
BLOCKS_PER_EVENT (64) blocks each (a 1,024-token prefill; a decode step's batch holds a block or
a few, one per sequence that filled one), every other chain a continuation of the previous one
(its parent resolved through the engine-hash map), then as many BlockRemoved: timed (1)
decoding and applying on one core (the work on the gateway's event loop), (2) the same batches
through a real ZMQ PUB socket on loopback into a `Feed` (socket, seq tracking and all), from
another process as an engine publishes, publish of the first to indexed of the last, and this
process's CPU over it (the feed's own work); (3) the first half of the batches (the stores, at
most 4,000) again, paced at one every 0.5 ms as a live engine's decode steps come: the CPU a
batch then, and the event loop's thread's share (each batch its own wake-up).

`keying`: one agent conversation of TURNS turns (a 2,000-token system prompt, each turn ~300
tokens of user text and a ~100-token reply, up to ~40k tokens), each turn keyed three ways: the
approximate chain over the canonical rendering's bytes; the precise path (the new messages
rendered from the cached prefix, tokenized by segments, the token blocks hashed, the event index
looked up); and the precise path rendering every chat whole (`incremental=False`, the design
before). CPU time of the process (the tokenizer's threads included); the first turn (everything
tokenized) and the median continuation apart, and the BPE alone of each continuation's new text.

`speculation`: PROMPTS (300) new 730-block prompts (bench point 2's), each placed on one of 4
domains with its token bytes (`EventIndex.speculate`), the store of the one placed 8 before
applied (one in 5 never stored: its entries expire), every domain swept after each placement.
Thread CPU a prompt of the placements, of the stores less the domain table's `hold` (timed
apart: the same in any tree, and most of a store), and of the sweeps, with the entries
confirmed and expired. Imports nothing of `tools`: to compare another checkout, run this file
with that checkout first on PYTHONPATH.

`images`: REQUESTS (200) chats of a 2,000-word system prompt and a user turn of 30 words and one
image of KB (100) kilobytes of random bytes as a data URL, each its own image, keyed by the
precise path (the placeholder expanded, the image decoded and hashed, the blocks hashed with
their extra keys, the event index looked up) and the same chats without the image part
(the chain cache's path), alternating; and the approximate chain over the canonical rendering
(which holds the base64 text); then each request again (the image's identifier cached,
`ImageIds`). CPU time of the process, medians after the first request, and the image's
decode + SHA-256 alone.
"""

from __future__ import annotations

import array
import asyncio
import base64
import hashlib
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import orjson
import zmq
import zmq.asyncio

from cachemap.events import BlockRemoved, BlockStored, EventIndex, precise_keys
from cachemap.keys import chain_hashes, root_hash, token_bytes
from cachemap.memory import MemoryIndex
from cachemap.tokenizer import ModelTokenizer
from gateway.api.openai.parse import parse_chat
from gateway.events.decode import decode_batch
from gateway.events.intake import EventIntake, EventsConfig, Feed, FeedConfig
from gateway.events.precise import PreciseKeys, PromptTokens
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words

BLOCKS_PER_EVENT = 64
DEFAULT_BLOCKS = 131_072
DEFAULT_TURNS = 100


def batches(num_blocks: int, per_event: int = BLOCKS_PER_EVENT) -> list[bytes]:
    out = []
    num_events = num_blocks // per_event
    for e in range(num_events):
        base = e * per_event
        parent = base - 1 if e % 2 else None
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(range(base, base + per_event)),
            "parent_block_hash": parent,
            "token_ids": [(base * 16 + i) % 4000 for i in range(16 * per_event)],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        if parent is None:
            event["extra_keys"] = [[f"salt{e}"]] + [None] * (per_event - 1)
        out.append(msgspec.msgpack.encode([time.time(), [event], 0]))
    for e in range(num_events):
        base = e * per_event
        removed = {
            "type": "BlockRemoved",
            "block_hashes": list(range(base, base + per_event)),
            "medium": "GPU",
        }
        out.append(msgspec.msgpack.encode([time.time(), [removed], 0]))
    return out


def ingest_in_process(payloads: list[bytes]) -> float:
    index = EventIndex()
    started = time.perf_counter()
    for payload in payloads:
        for event in decode_batch(payload).events:
            index.apply("r", event)
    elapsed = time.perf_counter() - started
    assert index.stats.unresolved_parents == 0 and index.num_blocks("r") == 0
    return elapsed


def _publish(payloads: list[bytes], ports: Any, go: Any, gap_s: float = 0.0) -> None:
    """The engine's side, in a process of its own: bind a PUB socket, send a probe (an empty
    batch at seq 0) every 10 ms until told to go, then every payload at seq 1, 2, ... (one
    every `gap_s`, kept by a spin: a sleep that short oversleeps)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(len(payloads) + 1000)
    ports.put(pub.bind_to_random_port("tcp://127.0.0.1"))
    probe = msgspec.msgpack.encode([time.time(), [], 0])
    while not go.wait(0.01):
        pub.send_multipart((b"", (0).to_bytes(8, "big"), probe))
    due = time.perf_counter()
    for seq, payload in enumerate(payloads, 1):
        due += gap_s
        while gap_s and time.perf_counter() < due:
            pass
        pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
    pub.close(linger=-1)  # until every batch is handed to the subscriber
    ctx.term()


async def ingest_over_zmq(payloads: list[bytes], gap_s: float = 0.0) -> tuple[float, float, float]:
    """(wall seconds from the go to the last batch indexed, this process's CPU seconds over
    them: the feed's own work, the publisher being another process, as an engine is; the
    event loop's thread alone, without ZMQ's I/O thread)."""
    spawn = multiprocessing.get_context("spawn")
    ports, go = spawn.Queue(), spawn.Event()
    publisher = spawn.Process(target=_publish, args=(payloads, ports, go, gap_s), daemon=True)
    publisher.start()
    ctx = zmq.asyncio.Context()
    try:
        port = ports.get(timeout=60)
        feed = Feed(FeedConfig("r", 0, "r", f"tcp://127.0.0.1:{port}", None, ""), EventIndex(), ctx)
        task = asyncio.create_task(feed.run())
        try:
            deadline = time.monotonic() + 600
            while feed.stats.batches == 0:  # joined: a probe arrived
                assert time.monotonic() < deadline, "no probe reached the feed"
                await asyncio.sleep(0.005)
            started = time.perf_counter()
            cpu_started, loop_started = time.process_time(), time.thread_time()
            go.set()
            while feed.next_seq != 1 + len(payloads):
                assert time.monotonic() < deadline, "the feed stopped indexing"
                await asyncio.sleep(0.05 if gap_s else 0.001)  # paced: few wake-ups of its own
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            loop_cpu = time.thread_time() - loop_started
        finally:  # the socket closed before the context ends, even when an assert failed
            task.cancel()
            feed.close()
        assert feed.stats.gaps == 0, "the PUB dropped batches (HWM)"
    finally:
        go.set()
        publisher.join(timeout=60)
        if publisher.is_alive():
            publisher.kill()
        ctx.term()
    return elapsed, cpu, loop_cpu


PACED_GAP_S = 0.0005
"""The paced arm's batch interval: 2,000 batches a second, one at a time (a decode step's)."""
PACED_BATCHES = 4000


def ingest(num_blocks: int, per_event: int = BLOCKS_PER_EVENT) -> None:
    if not 1 <= per_event <= num_blocks:
        raise SystemExit(f"BLOCKS_PER_EVENT must be 1..NUM_BLOCKS ({num_blocks}), got {per_event}")
    payloads = batches(num_blocks, per_event)
    total = 2 * (num_blocks // per_event) * per_event  # stored + removed
    local = statistics.median(ingest_in_process(payloads) for _ in range(3))
    runs = [asyncio.run(ingest_over_zmq(payloads)) for _ in range(3)]
    wire = statistics.median(r[0] for r in runs)
    feed_cpu = statistics.median(r[1] for r in runs)
    per_batch = f"{len(payloads):,} batches of {per_event} block{'s' * (per_event > 1)}"
    print(f"blocks (stored + removed): {total:,} in {per_batch}")
    print(
        f"decode + index, one core : {total / local:,.0f} blocks/s ({local * 1e3:.0f} ms, "
        f"{local / len(payloads) * 1e6:.1f} us a batch)"
    )
    print(
        f"ZMQ PUB -> Feed -> index : {total / wire:,.0f} blocks/s ({wire * 1e3:.0f} ms, "
        f"{wire / len(payloads) * 1e6:.1f} us a batch)"
    )
    print(
        f"  of which the feed's CPU: {total / feed_cpu:,.0f} blocks/s per core "
        f"({feed_cpu / len(payloads) * 1e6:.1f} us a batch; the publisher is another process)"
    )
    # live, batches come one at a time: each costs the loop a wake-up, not a share of a burst
    paced = payloads[: min(PACED_BATCHES, len(payloads) // 2)]  # stores only
    _, cpu, loop_cpu = asyncio.run(ingest_over_zmq(paced, PACED_GAP_S))
    print(
        f"paced, a batch every {PACED_GAP_S * 1e3:g} ms ({len(paced):,} batches): "
        f"{cpu / len(paced) * 1e6:.1f} us of CPU a batch, {loop_cpu / len(paced) * 1e6:.1f} on "
        "the event loop's thread (its wake-ups included)"
    )


async def keying(turns: int) -> None:
    tokenizer = ModelTokenizer(MODEL_DIR)
    arms = {
        "precise": PreciseKeys(PromptTokens(tokenizer), EventIndex(), None),
        "whole": PreciseKeys(PromptTokens(tokenizer, incremental=False), EventIndex(), None),
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": words("bench-system", 2000)}]
    cpu_us: dict[str, list[float]] = {"approximate": [], "precise": [], "whole": [], "bpe": []}
    tokens: list[int] = []
    new_tokens: list[int] = []
    # CPU time of the process (`process_time`: the tokenizer's own threads included)
    clock = time.process_time
    for turn in range(turns):
        messages.append({"role": "user", "content": words(f"bench-user{turn}", 300)})
        body = {"model": "m", "messages": messages}
        parsed = parse_chat(orjson.dumps(body), 1 << 24)
        started = clock()
        chain_hashes(parsed.rendered, root_hash(b"salt", "m"))
        cpu_us["approximate"].append((clock() - started) * 1e6)
        for name, precise in sorted(arms.items(), reverse=turn % 2 == 1):  # alternate order
            started = clock()
            ids, keys = await precise.keys(body, True, "salt")
            precise.view(keys, ["r"])
            cpu_us[name].append((clock() - started) * 1e6)
        tokens.append(len(ids))
        # the BPE alone of what a continuation adds (the reply before it and its user turn)
        texts = [m["content"] for m in messages[-2 if turn else -1 :]]
        started = clock()
        new_tokens.append(sum(len(i) for i in tokenizer.encode_many(texts)))
        cpu_us["bpe"].append((clock() - started) * 1e6)
        messages.append({"role": "assistant", "content": words(f"bench-reply{turn}", 100)})

    def median(name: str) -> float:
        return statistics.median(cpu_us[name][1:])

    print(f"turns: {turns}, prompt tokens: first {tokens[0]:,}, last {tokens[-1]:,}; CPU time")
    first = cpu_us["precise"][0]
    print(
        f"first turn   precise {first:,.0f} us ({first / tokens[0]:.2f} us/token), "
        f"approximate {cpu_us['approximate'][0]:,.0f} us"
    )
    print(
        f"continuation precise {median('precise'):,.0f} us, rendered whole {median('whole'):,.0f}"
        f" us, approximate {median('approximate'):,.0f} us (medians); "
        f"precise - approximate {median('precise') - median('approximate'):,.0f} us"
    )
    print(
        f"  of which the BPE of the new text: {median('bpe'):,.0f} us "
        f"({statistics.median(new_tokens[1:]):,.0f} new tokens per continuation)"
    )
    print(
        f"last turn    precise {cpu_us['precise'][-1]:,.0f} us, rendered whole "
        f"{cpu_us['whole'][-1]:,.0f} us, approximate {cpu_us['approximate'][-1]:,.0f} us"
    )


async def images(requests: int, kilobytes: int) -> None:
    tokenizer = ModelTokenizer(MODEL_DIR)
    arms = {
        "image": PreciseKeys(PromptTokens(tokenizer), EventIndex(), None),
        "text": PreciseKeys(PromptTokens(tokenizer), EventIndex(), None),
    }
    system = {"role": "system", "content": words("bench-mm-system", 2000)}
    names = ("image", "text", "image again", "text again", "approximate", "hash")
    cpu_us: dict[str, list[float]] = {name: [] for name in names}
    clock = time.process_time
    tokens: list[int] = []
    for i in range(requests):
        image = os.urandom(kilobytes * 1024)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        question = {"type": "text", "text": words(f"bench-mm-user{i}", 30)}
        picture = {"type": "image_url", "image_url": {"url": url}}
        bodies = {
            "image": {
                "model": "m",
                "messages": [system, {"role": "user", "content": [question, picture]}],
            },
            "text": {"model": "m", "messages": [system, {"role": "user", "content": [question]}]},
        }
        for again in ("", " again"):  # a new image, then the same request (its id cached)
            for name, precise in sorted(arms.items(), reverse=i % 2 == 1):  # alternate order
                started = clock()
                ids, keys = await precise.keys(bodies[name], True, "salt")
                precise.view(keys, ["r"])
                cpu_us[name + again].append((clock() - started) * 1e6)
                if name == "image" and not again:
                    tokens.append(len(ids))
        parsed = parse_chat(orjson.dumps(bodies["image"]), 1 << 26)
        started = clock()
        chain_hashes(parsed.rendered, root_hash(b"salt", "m"))
        cpu_us["approximate"].append((clock() - started) * 1e6)
        started = clock()
        hashlib.sha256(base64.b64decode(url.split(",", 1)[1], validate=True)).hexdigest()
        cpu_us["hash"].append((clock() - started) * 1e6)
    assert arms["image"].stats.image_requests == 2 * requests
    assert arms["image"].images.hits == requests

    def median(name: str) -> float:
        return statistics.median(cpu_us[name][1:] or cpu_us[name])

    print(
        f"requests: {requests}, one {kilobytes} KB image each, {tokens[0]:,} prompt tokens "
        f"({arms['image'].mm_tokens_per_image} of the image); CPU time, medians"
    )
    print(
        f"a new image: precise {median('image'):,.0f} us, without it {median('text'):,.0f} us: "
        f"the image costs {median('image') - median('text'):,.0f} us "
        f"(its decode + SHA-256 alone {median('hash'):,.0f} us)"
    )
    print(
        f"the same request again (identifier cached): precise {median('image again'):,.0f} us, "
        f"without the image {median('text again'):,.0f} us: the image costs "
        f"{median('image again') - median('text again'):,.0f} us"
    )
    print(f"approximate with the image {median('approximate'):,.0f} us")


LONG_SHARED_WORDS = 8_000
"""`long`: the words a group of prompts shares before each's own (bench point 2's prompts are one
~11.7k-token user message, a shared prefix and its own rest)."""
LONG_OWN_WORDS = 3_500
LONG_GROUP = 4
"""Prompts per shared beginning: the first of a group is all new."""


async def long_prompts(prompts: int) -> None:
    """`prompts` one-message chats in groups of `LONG_GROUP` sharing `LONG_SHARED_WORDS` words,
    keyed with long segments cut at word boundaries (the default) and encoded whole
    (`chunking=False`, before); CPU time of the process, the tokenizer's threads included."""
    tokenizer = ModelTokenizer(MODEL_DIR)
    arms = {
        "cut": PreciseKeys(PromptTokens(tokenizer), EventIndex(), None),
        "whole": PreciseKeys(PromptTokens(tokenizer, chunking=False), EventIndex(), None),
    }
    clock = time.process_time
    cpu_s = dict.fromkeys(arms, 0.0)
    firsts = dict.fromkeys(arms, 0.0)
    tokens = first_tokens = 0
    for i in range(prompts):
        text = words(f"long-shared{i // LONG_GROUP}", LONG_SHARED_WORDS) + words(
            f"long-own{i}", LONG_OWN_WORDS
        )
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        for name, precise in sorted(arms.items(), reverse=i % 2 == 1):  # alternate order
            started = clock()
            ids, _ = await precise.keys(body, True, "salt")
            elapsed = clock() - started
            cpu_s[name] += elapsed
            if i % LONG_GROUP == 0:
                firsts[name] += elapsed
        tokens += len(ids)
        first_tokens += len(ids) if i % LONG_GROUP == 0 else 0
    later_tokens = tokens - first_tokens
    print(f"prompts: {prompts} in groups of {LONG_GROUP}, {tokens / prompts:,.0f} tokens each")
    for name in arms:
        total, first = cpu_s[name], firsts[name]
        print(
            f"{name:<6} {total / prompts * 1e3:6.2f} ms/prompt "
            f"({total / tokens * 1e6:.2f} us/token);"
            f" a group's first {first / first_tokens * 1e6:.2f} us/token, the rest "
            f"{(total - first) / later_tokens * 1e6:.2f} us/token"
        )


async def wipe(trials: int, shared: bool = False) -> None:
    """A real engine (a `kvgate engine` process) and a `Feed`: per trial, a prompt is
    stored, the engine is reset, and the moment its 200 comes back a lookup is made (what a
    request sent right after the wipe would see), then again after draining the feed's socket
    (what a routing decision does first), then the time until the index is empty. Then as many
    trials with the reset sent through the gateway (`Keying.reset_prefix_cache`, what the admin
    port's POST /reset_prefix_cache runs), the lookup made when it returns (in process only).
    `shared`: the feed writes the event index in a real redis-server (`EventWriter`) and the
    lookups are an `EventReader`'s (a wipe is then in Redis once the owner wrote its epoch)."""
    import tempfile
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    import httpx

    from cachemap.memory import MemoryDirectory, MemoryIndex
    from cachemap.redis.client import open_redis
    from cachemap.redis.events import EventReader, EventWriter
    from gateway.directory.routing import RoutingDirectory
    from gateway.events.intake import EventSink
    from gateway.pipeline.keying import Keying, RouteKeys
    from gateway.request.tokens import TokenEstimator
    from loadgen.harness.processes import free_port, start_engine, stop, wait_ready
    from loadgen.harness.redis_servers import RedisServer

    port = free_port()
    config = orjson.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    engine = start_engine(
        free_port(), ["--kv-events-config", config.decode(), "--time-scale", "1000"]
    )
    wait_ready(engine.url, "/health", engine.popen, 60)
    url = engine.url
    prompt = list(range(100, 100 + 16 * 8))  # _forwarded_resets sends the same
    keys = precise_keys(prompt, None, 16)
    tmp = tempfile.TemporaryDirectory()
    server = RedisServer(Path(tmp.name))
    index = EventIndex()
    sink: EventSink = index
    writer = None
    holds: Callable[[], Awaitable[bool]]
    if shared:
        server.start()
        redis = await open_redis(server.url, cluster=False)
        writer = EventWriter(redis, block_size=16)
        await writer.adopt(url)
        reader = EventReader(redis)
        sink = writer

        async def holds() -> bool:
            return url in await reader.lookup(keys)

    else:

        async def holds() -> bool:
            return bool(index.lookup(keys, 0.0))

    ctx = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{port}"
    commit = writer.commit if writer is not None else None
    feed = Feed(FeedConfig(url, 0, url, endpoint, None, ""), sink, ctx, commit=commit)
    task = asyncio.create_task(feed.run())
    keying = Keying(
        RouteKeys(256, 1),
        RoutingDirectory(MemoryDirectory(MemoryIndex())),
        TokenEstimator(4.0),
        PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), index, None),
    )
    stale = stale_drained = forwarded_stale = 0
    detect_s: list[float] = []
    body = {"model": "kvgate-sim-8b", "prompt": prompt, "max_tokens": 1}
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            while feed.stats.wipes == 0:
                await client.post("/reset_prefix_cache")
                await asyncio.sleep(0.01)
            for _ in range(trials):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                deadline = time.monotonic() + 10
                while not await holds():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.0005)
                started = time.perf_counter()
                assert (await client.post("/reset_prefix_cache")).status_code == 200
                if await holds():
                    stale += 1
                if not shared:
                    feed.drain()  # what a routing decision does first (PreciseKeys.view)
                if await holds():
                    stale_drained += 1
                while await holds():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.0002)
                detect_s.append(time.perf_counter() - started)
            if not shared:
                forwarded_stale = await _forwarded_resets(client, feed, keying, keys, trials)
    finally:
        task.cancel()
        feed.close()
        ctx.term()
        stop([engine])
        if writer is not None:
            await writer.close()
        server.stop()
        tmp.cleanup()
    detect_s.sort()
    where = "Redis (EventWriter -> EventReader)" if shared else "in process"
    print(
        f"{where}: trials: {trials}; lookups still matching when the reset's 200 came back: {stale}"
    )
    if not shared:
        print(
            "  ... after draining the feed's socket first, as a routing decision does: "
            f"{stale_drained}"
        )
        print(
            "  ... the reset sent through the gateway (Keying.reset_prefix_cache): "
            f"{forwarded_stale}"
        )
    p50, p99 = detect_s[len(detect_s) // 2], detect_s[int(len(detect_s) * 0.99)]
    print(f"reset request sent -> index empty: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")


async def _forwarded_resets(
    client: Any, feed: Feed, keying: Any, keys: list[Any], trials: int
) -> int:
    """`wipe`'s second half: resets sent through the gateway; the lookups still matching."""
    import aiohttp

    url = feed.config.replica
    body = {"model": "kvgate-sim-8b", "prompt": list(range(100, 228)), "max_tokens": 1}
    stale = 0
    index = feed.index
    assert isinstance(index, EventIndex)
    async with aiohttp.ClientSession() as session:
        for _ in range(trials):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            deadline = time.monotonic() + 10
            while not index.lookup(keys, 0.0):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.0005)
            assert await keying.reset_prefix_cache(session, url) == 200
            feed.drain()
            if index.lookup(keys, 0.0):
                stale += 1
    return stale


async def into_redis(num_blocks: int) -> None:
    """The other option for who ingests: one owner per engine writing what its events say into
    the shared directory (a real redis-server on a unix socket, `RedisDirectory`'s one script
    call per chain): each stored event's own keys recorded, each removal dropped, 32 events in
    flight at a time."""
    import tempfile
    from pathlib import Path

    from cachemap.redis.client import open_redis
    from cachemap.redis.directory import RedisDirectory
    from gateway.events.decode import decode_batch
    from loadgen.harness.redis_servers import RedisServer

    payloads = batches(num_blocks)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            directory = RedisDirectory(await open_redis(server.url, cluster=False))
            await directory.start()
            index = EventIndex()
            started = time.perf_counter()
            pending: list[Any] = []
            blocks = 0
            for payload in payloads:
                for event in decode_batch(payload).events:
                    if isinstance(event, BlockStored):
                        keys = index.store("r", event)
                        pending.append(directory.record("r", keys))
                    elif isinstance(event, BlockRemoved):
                        owned = [index.own_key("r", h) for h in event.block_hashes]
                        index.remove("r", event)
                        pending.append(directory.drop("r", [k for k in owned if k is not None]))
                    blocks += len(getattr(event, "block_hashes", ()))
                if len(pending) >= 32:
                    await asyncio.gather(*pending)
                    pending = []
            await asyncio.gather(*pending)
            elapsed = time.perf_counter() - started
            await directory.close()
        finally:
            server.stop()
    print(f"blocks (stored + removed) into Redis: {blocks:,} in {elapsed * 1e3:.0f} ms")
    print(f"one owner writing the shared directory: {blocks / elapsed:,.0f} blocks/s")


LOOKUPS = 500


async def shared_ingest(
    url: str, cluster: bool, payloads: list[bytes]
) -> tuple[int, float, float, float]:
    """Decode, apply and write `payloads` through one `EventWriter` the way a `Feed` does (a
    commit per batch: the writer flushes in the background and waits at its backlog bound);
    returns (blocks, wall seconds, this process's CPU seconds, the median of `LOOKUPS`
    lookups of a 64-block chain by an `EventReader`, the request path's cost). Checked: the
    stored half is in Redis (the lookups' match) and the removed half left nothing."""
    from cachemap.redis.client import open_redis
    from cachemap.redis.events import EventReader, EventWriter

    client = await open_redis(url, cluster=cluster)
    writer = EventWriter(client, block_size=16)
    domain = f"bench-{time.time_ns()}"
    await writer.adopt(domain)
    half = len(payloads) // 2
    blocks = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for seq, payload in enumerate(payloads):
        for event in decode_batch(payload).events:
            writer.apply(domain, event)
            blocks += len(getattr(event, "block_hashes", ()))
        await writer.commit(domain, seq + 1, False)
        if seq == half - 1:
            await writer.flush()
            wall_mid, cpu_mid = time.perf_counter() - wall, time.process_time() - cpu
            first = precise_keys([i % 4000 for i in range(16 * BLOCKS_PER_EVENT)], "salt0", 16)
            reader = EventReader(client)
            times = []
            for _ in range(LOOKUPS):
                started = time.perf_counter()
                match = (await reader.lookup(first))[domain]
                times.append(time.perf_counter() - started)
                assert match.depth == BLOCKS_PER_EVENT
            wall, cpu = time.perf_counter() - wall_mid, time.process_time() - cpu_mid
    await writer.flush()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert writer.num_blocks(domain) == 0 and writer.stats.unresolved_parents == 0
    assert writer.pending_blocks() == 0
    assert domain not in await reader.lookup(first)  # the removals reached Redis too
    await writer.close()
    await client.aclose()
    return blocks, wall, cpu, statistics.median(times)


async def shared(num_blocks: int) -> None:
    import tempfile
    from pathlib import Path

    from loadgen.harness.processes import cpu_seconds
    from loadgen.harness.redis_servers import RedisServer, redis_cluster

    def server_cpu(servers: list[RedisServer]) -> float:
        return sum(cpu_seconds(s.proc.pid) for s in servers if s.proc is not None)

    payloads = batches(num_blocks)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            before = server_cpu([server])
            runs = [await shared_ingest(server.url, False, payloads) for _ in range(3)]
            redis_s = (server_cpu([server]) - before) / len(runs)
        finally:
            server.stop()
    report("one redis-server (unix socket)", runs, redis_s)
    with redis_cluster() as cluster:
        before = server_cpu(cluster.nodes)
        runs = [await shared_ingest(cluster.url, True, payloads) for _ in range(3)]
        redis_s = (server_cpu(cluster.nodes) - before) / len(runs)
    report("a 3-master Redis Cluster (loopback TCP)", runs, redis_s)
    print(f"in-process EventIndex, the same lookup: {local_lookup_us():,.1f} us median")


def route(turns: int, conversations: int = 30, domains: int = 4) -> None:
    """A continuation's lookups once its keys are known, on an events-fed gateway: the event
    index's lookup and the placement's speculation, with the prediction's lookup beside them
    (before: always walked, and the speculation finding its chain's holders again) and without
    (now: every candidate's events flow, the speculation reusing the lookup's holders). Each
    conversation's turns are stored on its domain by BlockStored events as the engine would
    announce them, and recorded in the prediction as the gateway does; both are timed alike
    and the record is not. Thread CPU time, medians over every continuation, arms alternated."""
    index = EventIndex(speculative_ttl_s=2.0)
    prediction = MemoryIndex(capacity_blocks=1 << 22, ttl_s=1e9, clock=lambda: 0.0)
    names = [f"r{d}" for d in range(domains)]
    ids = [[(c * 7919 + i) % 4000 for i in range(16 * 128)] for c in range(conversations)]
    per_turn = 16 * 27  # ~430 new tokens a turn, as in `keying`
    costs: dict[str, list[float]] = {"before": [], "now": []}
    engine_hash = 0
    stored: list[list[int]] = [[] for _ in range(conversations)]  # engine hashes, per block
    clock = time.thread_time
    for turn in range(turns):
        for c in range(conversations):
            domain = names[c % domains]
            n = 16 * 128 + turn * per_turn
            while len(ids[c]) < n:
                ids[c].append((len(ids[c]) * 31 + c) % 4000)
            keys = precise_keys(ids[c][:n], f"salt{c}", 16)
            arms = ("before", "now") if (turn + c) % 2 else ("now", "before")
            for arm in arms:
                started = clock()
                if arm == "before":
                    prediction.lookup_detail(keys)
                index.lookup(keys, float(turn))
                if arm == "before":
                    index._last_held = None  # the speculation finds the holders again
                index.speculate(domain, keys, float(turn))
                if turn:
                    costs[arm].append((clock() - started) * 1e6)
            prediction.record(domain, keys)
            start = len(stored[c])
            hashes = list(range(engine_hash, engine_hash + len(keys) - start))
            parent = stored[c][-1] if start else None
            engine_hash += len(hashes)
            stored[c] += hashes
            if hashes:
                index.store(
                    domain,
                    BlockStored(
                        hashes,
                        parent,
                        ids[c][16 * start : 16 * len(keys)],
                        16,
                        cache_salt=None if start else f"salt{c}",
                    ),
                )
    blocks = len(precise_keys(ids[0][: 16 * 128 + (turns - 1) * per_turn], "s", 16))
    print(
        f"{conversations} conversations x {turns} turns on {domains} domains, up to {blocks} "
        f"blocks a prompt; {sum(index.num_blocks(d) for d in names):,} blocks indexed"
    )
    for arm, values in costs.items():
        print(f"  {arm:<6} {statistics.median(values):7.1f} us per continuation (median)")
    saved = statistics.median(costs["before"]) - statistics.median(costs["now"])
    print(f"  saved  {saved:7.1f} us")


FLEET_SIZES = (4, 16, 64, 256)
FLEET_CALLS = 2_000


async def fleet(sizes: Sequence[int], calls: int = FLEET_CALLS) -> None:
    """What a precise request's events view costs at each fleet size, past the index's
    lookup: the sockets drained (`EventIntake.drain`, nothing waiting on them), the live
    replicas picked and each one's match read (`PreciseKeys.view`), with every replica a
    candidate and its events flowing, and two of them holding the request's 64-block chain.
    One SUB socket per replica, connected to a loopback port nothing listens on (no batch
    arrives; each feed is marked as having applied one). Thread CPU time, median of `calls`;
    the index's lookup alone beside it."""
    print(f"calls: {calls:,} per fleet size, every replica a candidate, 2 holding the chain")
    tokenizer = ModelTokenizer(MODEL_DIR)
    ids = [(i * 31) % 4000 for i in range(16 * BLOCKS_PER_EVENT)]
    for size in sizes:
        replicas = [f"http://10.0.{n // 256}.{n % 256}:8000" for n in range(size)]
        endpoints = {r: f"tcp://127.0.0.1:{1 + n}" for n, r in enumerate(replicas)}
        index = EventIndex()
        intake = EventIntake(EventsConfig(endpoints=endpoints), index, replicas.copy)
        precise = PreciseKeys(PromptTokens(tokenizer), index, intake)
        intake.refresh()
        try:
            for feed in intake.feeds():
                feed.stats.last_batch_s = 0.0  # as if its engine had published
            for n, replica in enumerate(replicas[:2]):
                hashes = list(range(n * BLOCKS_PER_EVENT, (n + 1) * BLOCKS_PER_EVENT))
                index.store(replica, BlockStored(hashes, None, ids, 16, cache_salt="s"))
            keys = precise_keys(ids, "s", 16)
            views, lookups = [], []
            for _ in range(calls):
                started = time.thread_time()
                view = precise.view(keys, replicas)
                views.append(time.thread_time() - started)
                started = time.thread_time()
                index.lookup(keys, 0.0)
                lookups.append(time.thread_time() - started)
            assert len(view.live) == size and set(view.overlap) == set(replicas[:2])
        finally:
            await intake.close()
        view_us, lookup_us = statistics.median(views) * 1e6, statistics.median(lookups) * 1e6
        print(
            f"  {size:4d} replicas: {view_us:7.1f} us a request "
            f"(the index's lookup alone {lookup_us:5.1f})"
        )


def report(what: str, runs: list[tuple[int, float, float, float]], redis_s: float) -> None:
    blocks = runs[0][0]
    wall = statistics.median(r[1] for r in runs)
    cpu = statistics.median(r[2] for r in runs)
    lookup = statistics.median(r[3] for r in runs)
    print(f"{what}: {blocks:,} blocks (stored + removed), median of {len(runs)}")
    print(f"  {blocks / wall:,.0f} blocks/s wall ({wall * 1e3:.0f} ms)")
    print(f"  {blocks / cpu:,.0f} blocks/s per core of the writer ({cpu * 1e3:.0f} ms CPU)")
    print(f"  redis-server CPU per run (all nodes, incl. the lookups): {redis_s * 1e3:.0f} ms")
    print(f"  a 64-block lookup (epochs + script, one pipeline): {lookup * 1e6:,.0f} us median")


def local_lookup_us() -> float:
    """The in-process index's lookup of the same 64-block chain, for comparison."""
    index = EventIndex()
    for payload in batches(2 * BLOCKS_PER_EVENT)[:2]:
        for event in decode_batch(payload).events:
            index.apply("r", event)
    first = precise_keys([i % 4000 for i in range(16 * BLOCKS_PER_EVENT)], "salt0", 16)
    times = []
    for _ in range(LOOKUPS):
        started = time.perf_counter()
        assert index.lookup(first, 0.0)["r"].depth == BLOCKS_PER_EVENT
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


class _HoldTimed:
    """A domain's maps with `hold`'s thread CPU added up (`speculation`)."""

    def __init__(self, maps: Any) -> None:
        self.maps = maps
        self.spent = 0.0

    def hold(self, *args: Any) -> int:
        start = time.thread_time()
        try:
            return int(self.maps.hold(*args))
        finally:
            self.spent += time.thread_time() - start

    def __len__(self) -> int:
        return len(self.maps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.maps, name)


def speculation(prompts: int, blocks: int = 730, domains: int = 4, in_flight: int = 8) -> None:
    rng = random.Random(7)
    index = EventIndex(speculative_ttl_s=1.0)
    timed = {}
    for d in range(domains):
        state = index._domain(f"d{d}")
        state.maps = timed[d] = _HoldTimed(state.maps)  # type: ignore[assignment]
    placed: list[tuple[list[int], list[bytes]]] = []
    engine_hashes = iter(range(1, 1 << 62))
    spent = {"placements": 0.0, "stores less hold": 0.0, "sweeps": 0.0}
    clock = time.thread_time
    for p in range(prompts):
        ids = [rng.randrange(1, 150_000) for _ in range(16 * blocks + 5)]
        keys = precise_keys(ids, "", 16)
        placed.append((ids, keys))
        now = p * 0.05
        start = clock()
        index.speculate(f"d{p % domains}", keys, now, token_bytes(ids[: 16 * blocks]))
        spent["placements"] += clock() - start
        if p >= in_flight and (p - in_flight) % 5:
            ids, keys = placed[p - in_flight]
            hashes = [next(engine_hashes) for _ in keys]
            event = BlockStored(hashes, None, array.array("I", ids[: 16 * blocks]), 16)
            domain = (p - in_flight) % domains
            held = timed[domain].spent
            start = clock()
            index.store(f"d{domain}", event)
            spent["stores less hold"] += clock() - start - (timed[domain].spent - held)
        start = clock()
        for d in range(domains):
            index.sweep(f"d{d}", now)
        spent["sweeps"] += clock() - start
    parts = ", ".join(f"{name} {s / prompts * 1e6:.0f}" for name, s in spent.items())
    total = sum(spent.values()) / prompts * 1e6
    stats = index.stats
    print(
        f"speculation a new {blocks}-block prompt: {parts}, sum {total:.0f} us (thread CPU); "
        f"entries confirmed {stats.speculative_confirmed}, expired {stats.speculative_expired}"
    )


def main(argv: list[str]) -> int:
    modes = (
        "ingest",
        "keying",
        "long",
        "wipe",
        "redis",
        "shared",
        "images",
        "route",
        "fleet",
        "speculation",
    )
    if not argv or argv[0] not in modes:
        print(__doc__)
        return 2
    if argv[0] == "ingest":
        ingest(
            int(argv[1]) if len(argv) > 1 else DEFAULT_BLOCKS,
            int(argv[2]) if len(argv) > 2 else BLOCKS_PER_EVENT,
        )
    elif argv[0] == "redis":
        asyncio.run(into_redis(int(argv[1]) if len(argv) > 1 else DEFAULT_BLOCKS))
    elif argv[0] == "shared":
        asyncio.run(shared(int(argv[1]) if len(argv) > 1 else DEFAULT_BLOCKS))
    elif argv[0] == "images":
        count = int(argv[1]) if len(argv) > 1 else 200
        asyncio.run(images(count, int(argv[2]) if len(argv) > 2 else 100))
    elif argv[0] == "route":
        route(int(argv[1]) if len(argv) > 1 else DEFAULT_TURNS)
    elif argv[0] == "fleet":
        asyncio.run(fleet([int(n) for n in argv[1:]] or FLEET_SIZES))
    elif argv[0] == "speculation":
        speculation(int(argv[1]) if len(argv) > 1 else 300)
    elif argv[0] == "long":
        asyncio.run(long_prompts(int(argv[1]) if len(argv) > 1 else 40))
    elif argv[0] == "wipe":
        asyncio.run(wipe(int(argv[1]) if len(argv) > 1 else 200, "shared" in argv[2:]))
    else:
        asyncio.run(keying(int(argv[1]) if len(argv) > 1 else DEFAULT_TURNS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
