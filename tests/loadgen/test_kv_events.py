"""KV events over real ZMQ sockets on loopback, read by this file's own decoder (untyped
MessagePack and the wire layout as vLLM and SGLang document it, not the code under test)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from loadgen.engine.kv_events import KVEventsConfig, parse_kv_events_config
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.engine.tokenizer import block_hashes
from tests.conftest import FAST, MODEL
from tests.servers import Served, start_app, wait_until

TOPIC = "kv"
POLL_MS = 5_000
"""How long a receive waits for a message that must come (a test fails, never hangs)."""


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 all free (a rank r publishes on p + r)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            held = []
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise RuntimeError("no run of free ports")


class Subscriber:
    """A SUB socket and a DEALER replay socket (a REQ socket takes one reply per request and
    a replay is many), decoding untyped MessagePack alone."""

    def __init__(self, port: int, replay_port: int | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay: zmq.Socket[bytes] | None = None
        if replay_port is not None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.connect(f"tcp://127.0.0.1:{replay_port}")

    def receive(self, timeout_ms: int = POLL_MS) -> tuple[int, list[Any]] | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        return int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    def must_receive(self) -> tuple[int, list[Any]]:
        got = self.receive()
        assert got is not None, "no KV event batch arrived"
        return got

    def replay_from(self, start: int, with_topic: bool) -> list[tuple[int, list[Any]]]:
        assert self.replay is not None
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))  # REQ's envelope, by hand
        out = []
        while True:
            assert self.replay.poll(POLL_MS), "replay did not answer"
            delimiter, *frames = self.replay.recv_multipart()
            assert delimiter == b""
            if with_topic:
                topic, *frames = frames
                assert topic == TOPIC.encode()
            seq, payload = frames
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def events_config(port: int, replay_port: int | None = None, **extra: Any) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}" if replay_port else None,
        topic=TOPIC,
        **extra,
    )


@pytest.fixture
def served() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(**config: Any) -> Served:
        config.setdefault("timing", FAST)
        started.append(start_app(create_engine_app(EngineConfig(**config))))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def synchronise(url: str, subs: list[Subscriber]) -> int:
    """PUB drops what it sends before a SUB has joined: reset the (idle) cache until every
    subscriber has seen its AllBlocksCleared. Returns the next seq of the first subscriber."""
    seen: list[int | None] = [None] * len(subs)

    def joined() -> bool:
        assert httpx.post(url + "/reset_prefix_cache").status_code == 200
        for i, sub in enumerate(subs):
            while (got := sub.receive(timeout_ms=50)) is not None:
                seen[i] = got[0]
        return all(s is not None for s in seen)

    wait_until(joined, what="the subscribers to join")
    assert seen[0] is not None
    return seen[0] + 1


def u64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "big")


def i64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "big", signed=True)


A = list(range(1000, 1040))  # 40 token ids: 2 full blocks of 16
B = list(range(2000, 2040))


@pytest.mark.parametrize("encoding", ["vllm", "vllm-array", "sglang"])
def test_each_encoding_on_the_wire_stored_reused_removed_cleared(
    served: Callable[..., Served], encoding: str
) -> None:
    port = free_ports(1)
    # 4 blocks: a request of 40 tokens + 1 output token needs 3, so B must evict one of A's
    engine = served(capacity_blocks=4, kv_events=events_config(port, encoding=encoding))
    sub = Subscriber(port)
    try:
        seq = synchronise(engine.url, [sub])
        complete(engine.url, A, cache_salt="tenant-a")
        a = block_hashes(A, 16, "tenant-a")
        got = sub.must_receive()
        assert got[0] == seq
        ts, events, rank = got[1]
        assert isinstance(ts, float) and rank == 0
        if encoding == "vllm":
            assert events == [
                {
                    "type": "BlockStored",
                    "block_hashes": [u64(a[0]), u64(a[1])],
                    "parent_block_hash": None,
                    "token_ids": A[:32],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [["tenant-a"], None],
                }
            ]
        elif encoding == "vllm-array":
            assert events == [
                [
                    "BlockStored",
                    [u64(a[0]), u64(a[1])],
                    None,
                    A[:32],
                    16,
                    None,
                    "GPU",
                    None,
                    [["tenant-a"], None],
                ]
            ]
        else:
            assert events == [
                [
                    "BlockStored",
                    [i64(a[0]), i64(a[1])],
                    None,
                    A[:32],
                    16,
                    None,
                    "GPU",
                    {"cache_salt": "tenant-a"},
                ]
            ]
        hit = complete(engine.url, A, cache_salt="tenant-a")["usage"]["prompt_tokens_details"]
        assert hit["cached_tokens"] == 32  # a reuse: announced nothing (the next batch is B's)
        complete(engine.url, B)
        b = block_hashes(B, 16, None)
        removed = sub.must_receive()
        stored = sub.must_receive()
        assert (removed[0], stored[0]) == (seq + 1, seq + 2)
        if encoding == "vllm":
            assert removed[1][1] == [
                {"type": "BlockRemoved", "block_hashes": [u64(a[1])], "medium": "GPU"}
            ]
            assert stored[1][1][0]["block_hashes"] == [u64(b[0]), u64(b[1])]
            assert "extra_keys" not in stored[1][1][0]  # unsalted: omitted, as msgspec omits it
        else:
            convert = i64 if encoding == "sglang" else u64
            assert removed[1][1] == [["BlockRemoved", [convert(a[1])], "GPU"]]
            assert stored[1][1][0][1] == [convert(b[0]), convert(b[1])]
            assert len(stored[1][1][0]) == (7 if encoding == "sglang" else 8)
        assert httpx.post(engine.url + "/reset_prefix_cache").status_code == 200
        cleared = sub.must_receive()
        assert cleared[0] == seq + 3
        expected = {"type": "AllBlocksCleared"} if encoding == "vllm" else ["AllBlocksCleared"]
        assert cleared[1][1] == [expected]
    finally:
        sub.close()


@pytest.mark.parametrize("with_topic", [True, False])
def test_replay_answers_a_missed_range_then_the_end_marker(
    served: Callable[..., Served], with_topic: bool
) -> None:
    port, replay = free_ports(1), free_ports(1)
    config = events_config(port, replay, replay_topic_frame=with_topic)
    engine = served(kv_events=config)
    sub = Subscriber(port, replay)
    try:
        seq = synchronise(engine.url, [sub])
        for prompt in (A, B):
            complete(engine.url, prompt)
        live = [sub.must_receive(), sub.must_receive()]
        assert [s for s, _ in live] == [seq, seq + 1]
        assert sub.replay_from(seq, with_topic) == live  # the same batches, byte for byte
        assert sub.replay_from(seq + 1, with_topic) == live[1:]
        assert sub.replay_from(seq + 5, with_topic) == []  # nothing yet: just the end marker
    finally:
        sub.close()


def test_seq_starts_at_zero_again_when_the_engine_restarts(served: Callable[..., Served]) -> None:
    port, replay = free_ports(1), free_ports(1)
    first = served(kv_events=events_config(port, replay))
    sub = Subscriber(port, replay)
    try:
        seq = synchronise(first.url, [sub])
        complete(first.url, A)
        assert sub.must_receive()[0] == seq
        first.stop()
        second = served(kv_events=events_config(port, replay))
        synchronise(second.url, [sub])  # the SUB reconnects by itself
        replayed = sub.replay_from(0, with_topic=True)
        assert replayed[0][0] == 0
        assert replayed[0][1][1] == [{"type": "AllBlocksCleared"}]  # the new process's first
    finally:
        sub.close()


def test_each_data_parallel_rank_publishes_on_its_own_port(served: Callable[..., Served]) -> None:
    port = free_ports(2)
    engine = served(data_parallel_size=2, kv_events=events_config(port))
    rank0, rank1 = Subscriber(port), Subscriber(port + 1)
    try:
        synchronise(engine.url, [rank0, rank1])
        body = {"model": MODEL, "prompt": A, "max_tokens": 1}
        r = httpx.post(
            engine.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}
        )
        assert r.status_code == 200
        _, (_, events, rank) = rank1.must_receive()
        assert rank == 1 and events[0]["type"] == "BlockStored"
        assert rank0.receive(timeout_ms=200) is None  # rank 0's cache did not change
        # without the header, vLLM's balancing: the least 4 × waiting + running, lowest rank
        complete(engine.url, B)
        _, (_, _, rank) = rank0.must_receive()
        assert rank == 0
        bad = httpx.post(
            engine.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "2"}
        )
        assert bad.status_code == 400 and "from 0 to 1" in bad.json()["error"]["message"]
    finally:
        rank0.close()
        rank1.close()


def test_the_cpu_tier_announces_write_through_and_keeps_what_the_gpu_evicts(
    served: Callable[..., Served],
) -> None:
    port = free_ports(1)
    engine = served(capacity_blocks=4, cpu_offload_blocks=8, kv_events=events_config(port))
    sub = Subscriber(port)
    try:
        synchronise(engine.url, [sub])
        complete(engine.url, A)
        a = [u64(h) for h in block_hashes(A, 16, None)]
        _, (_, events, _) = sub.must_receive()
        assert [(e["type"], e["medium"], e["block_hashes"]) for e in events] == [
            ("BlockStored", "GPU", a),
            ("BlockStored", "CPU", a),
        ]
        complete(engine.url, B)  # evicts A's tail block from the GPU only
        _, (_, removed, _) = sub.must_receive()
        assert removed == [{"type": "BlockRemoved", "block_hashes": [a[1]], "medium": "GPU"}]
        _, (_, stored, _) = sub.must_receive()
        assert [e["medium"] for e in stored] == ["GPU", "CPU"]
        again = complete(engine.url, A)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert again == 32  # block 0 from the GPU, block 1 loaded back from the CPU
        text = httpx.get(engine.url + "/metrics").text
        assert 'vllm:external_prefix_cache_hits_total{engine="0"' in text
    finally:
        sub.close()


def test_the_config_takes_vllms_keys_and_defaults_and_names_what_is_wrong() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.buffer_steps) == (
        "zmq",
        "tcp://*:5557",
        10_000,
    )
    assert (config.hwm, config.max_queue_size, config.topic) == (100_000, 100_000, "")
    assert config.enabled and config.encoding == "vllm" and config.topic_in_replay
    assert not parse_kv_events_config("{}").enabled  # disabled: the "null" publisher
    with pytest.raises(ValueError, match=r"unknown key.*valid keys: enable_kv_cache_events"):
        parse_kv_events_config('{"enable": true}')
    with pytest.raises(ValueError, match="'hwm' must be an integer"):
        parse_kv_events_config('{"hwm": "many"}')
    with pytest.raises(ValueError, match="encoding must be one of vllm, vllm-array, sglang"):
        parse_kv_events_config('{"encoding": "json"}')
    with pytest.raises(ValueError, match="not JSON"):
        parse_kv_events_config("{")
