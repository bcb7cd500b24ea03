"""KV cache events, published as vLLM and SGLang publish them: ZMQ PUB, msgpack payloads.

Configured with vLLM's flag, `--kv-events-config '<json>'`, with vLLM's keys and defaults
(`vllm/config/kv_events.py`): `enable_kv_cache_events` (false), `publisher` ("zmq" when
enabled, else "null"), `endpoint` ("tcp://*:5557"; bound when it contains `*` or `::` or is
ipc:// or inproc://, else connected), `replay_endpoint` (none), `buffer_steps` (10,000 batches
kept for replay), `hwm` (100,000), `max_queue_size` (100,000), `topic` (""). Two keys are ours:
`encoding` ("vllm", "vllm-array" or "sglang") and `replay_topic_frame` (null: the encoding's).
Data-parallel rank r publishes on port + r (and replays on replay port + r), as vLLM and SGLang
offset them. `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends the raw 16-byte hashes, as vLLM's
switch of that name does; by default a hash is a 64-bit int (its first 8 bytes, big-endian).

The wire, every encoding: a multipart message (topic, seq, payload), seq an 8-byte big-endian
count from 0 when the publisher starts (a process start, per rank), one message per engine
step that changed the cache. Payloads (msgpack), field for field as the engines send them:

    vllm        [ts, [event, ...], data_parallel_rank], each event a map tagged by "type":
                {"type": "BlockStored", "block_hashes": [u64], "parent_block_hash": u64|nil,
                 "token_ids": [int], "block_size": int, "lora_id": nil, "medium": "GPU"|"CPU",
                 "lora_name": adapter|nil, "extra_keys": [[lora?, salt], [lora?], ...] only when
                 a block has one (vLLM's order: the adapter's name in every block, then
                 [image identifier, offset] per image the block holds, then the salt in
                 block 0; lora_id is left nil: kvgate keys on the name, as vLLM's hash does)}
                {"type": "BlockRemoved", "block_hashes": [u64], "medium": ...}
                {"type": "AllBlocksCleared"}
                (vLLM >= the 2026 switch to maps, vllm-project/vllm#42892: the outer batch stays
                positional; msgspec's omit_defaults drops extra_keys/group_idx when unset)
    vllm-array  the same batch, each event a positional array led by its tag (before #42892):
                ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
                 lora_name(, extra_keys)], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]
    sglang      [ts, [event, ...], attn_dp_rank] (SGLang's `disaggregation/kv_events.py`):
                ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium] plus a
                trailing {"cache_salt": salt} when salted (BlockStoredWithMetadata; no LoRA:
                SGLang's events name an adapter only by lora_id),
                ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]; hashes are signed
                int64 (`hash_str_to_int64`), media "GPU" and "CPU_PINNED".

Replay (a ROUTER on `replay_endpoint`): a request is the start seq as 8 big-endian bytes; the
answer is every buffered batch from that seq on, then an end marker of seq -1 and an empty
payload. Current vLLM frames each reply like the PUB stream, (topic, seq, payload); older vLLM
and SGLang send (seq, payload). `replay_topic_frame` picks; by default "vllm" sends the topic.

Publishing never blocks the engine: the engine encodes a batch and hands it to the publisher
thread over an inproc socket bounded at `max_queue_size` batches; a batch that does not fit is
dropped and counted, and its seq is skipped, so a subscriber sees the gap.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import orjson
import zmq

from cachemap.events import rank_endpoint as offset_endpoint
from loadgen.engine.kvpool import CPU, CacheEvent, Cleared, Removed, Stored

ENCODINGS = ("vllm", "vllm-array", "sglang")
PUBLISHERS = ("null", "zmq")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SGLANG_MEDIUM = {CPU: "CPU_PINNED"}
_SHUTDOWN_TIMEOUT_S = 1.0
"""How long closing waits for the publisher thread to send what is queued (vLLM's too)."""
_inproc_ids = itertools.count()


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "vllm"
    replay_topic_frame: bool | None = None

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def topic_in_replay(self) -> bool:
        if self.replay_topic_frame is not None:
            return self.replay_topic_frame
        return self.encoding == "vllm"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config`'s JSON, checked key by key (a ValueError names what is wrong)."""
    try:
        raw = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(
            f"--kv-events-config: unknown key(s) {', '.join(unknown)}; "
            f"valid keys: {', '.join(known)}"
        )
    kinds: dict[str, tuple[type, ...]] = {
        "enable_kv_cache_events": (bool,),
        "replay_topic_frame": (bool, type(None)),
        "replay_endpoint": (str, type(None)),
    }
    for key, value in raw.items():
        want = kinds.get(key) or ((int,) if known[key].type == "int" else (str,))
        if not isinstance(value, want) or (want == (int,) and isinstance(value, bool)):
            raise ValueError(f"--kv-events-config: {key!r} must be {_kind(want)}, got {value!r}")
    values = dict(raw)
    values.setdefault("publisher", "zmq" if values.get("enable_kv_cache_events") else "null")
    config = KVEventsConfig(**values)
    if config.publisher not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}")
    if config.encoding not in ENCODINGS:
        raise ValueError(f"--kv-events-config: encoding must be one of {', '.join(ENCODINGS)}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, key) < 1:
            raise ValueError(f"--kv-events-config: {key} must be at least 1")
    return config


def _kind(types: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", str: "a string", type(None): "null"}
    return " or ".join(names[t] for t in types)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc address; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# -- encodings ----------------------------------------------------------------------------
def _int_hashes() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") not in ("0", "false")


def block_hash_u64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "big")


def block_hash_i64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "big", signed=True)


def encode_batch(events: Sequence[CacheEvent], ts: float, rank: int, encoding: str) -> bytes:
    """One batch's payload in `encoding` (see the module docstring)."""
    body: list[Any]
    if encoding == "sglang":
        body = [_sglang_event(e) for e in events]
    elif encoding == "vllm-array":
        body = [_vllm_array_event(e) for e in events]
    else:
        body = [_vllm_map_event(e) for e in events]
    packed: bytes = msgspec.msgpack.encode([ts, body, rank])
    return packed


def _hashes(hashes: Sequence[bytes], signed: bool = False) -> list[Any]:
    if not _int_hashes():
        return list(hashes)
    convert = block_hash_i64 if signed else block_hash_u64
    return [convert(h) for h in hashes]


def _parent(parent: bytes | None, signed: bool = False) -> Any:
    return None if parent is None else _hashes([parent], signed)[0]


def _extra_keys(e: Stored) -> list[Any] | None:
    """vLLM's per-block extra keys (`generate_block_hash_extra_keys`): the LoRA adapter's name
    in every block's, then each image the block holds as [identifier, offset], then the salt in
    block 0's; None when no block has one."""
    lora = [e.lora_name] if e.lora_name is not None else []
    if e.cache_salt is None and not lora and not e.mm_keys:
        return None
    out: list[Any] = []
    for i in range(len(e.hashes)):
        keys: list[Any] = [*lora]
        if e.mm_keys:
            keys.extend([identifier, offset] for identifier, offset in e.mm_keys[i])
        if i == 0 and e.cache_salt is not None:
            keys.append(e.cache_salt)
        out.append(keys or None)
    return out


def _vllm_map_event(e: CacheEvent) -> dict[str, Any]:
    if isinstance(e, Stored):
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": _hashes(e.hashes),
            "parent_block_hash": _parent(e.parent),
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": None,
            "medium": e.medium,
            "lora_name": e.lora_name,
        }
        extra = _extra_keys(e)
        if extra is not None:
            event["extra_keys"] = extra
        return event
    if isinstance(e, Removed):
        return {"type": "BlockRemoved", "block_hashes": _hashes(e.hashes), "medium": e.medium}
    assert isinstance(e, Cleared)
    return {"type": "AllBlocksCleared"}


def _vllm_array_event(e: CacheEvent) -> list[Any]:
    if isinstance(e, Stored):
        event: list[Any] = [
            "BlockStored",
            _hashes(e.hashes),
            _parent(e.parent),
            list(e.token_ids),
            e.block_size,
            None,
            e.medium,
            e.lora_name,
        ]
        extra = _extra_keys(e)
        if extra is not None:
            event.append(extra)
        return event
    if isinstance(e, Removed):
        return ["BlockRemoved", _hashes(e.hashes), e.medium]
    return ["AllBlocksCleared"]


def _sglang_event(e: CacheEvent) -> list[Any]:
    if isinstance(e, Stored):
        event: list[Any] = [
            "BlockStored",
            _hashes(e.hashes, signed=True),
            _parent(e.parent, signed=True),
            list(e.token_ids),
            e.block_size,
            None,
            _SGLANG_MEDIUM.get(e.medium, e.medium),
        ]
        if e.cache_salt is not None:
            event.append({"cache_salt": e.cache_salt})
        return event
    if isinstance(e, Removed):
        return [
            "BlockRemoved",
            _hashes(e.hashes, signed=True),
            _SGLANG_MEDIUM.get(e.medium, e.medium),
        ]
    return ["AllBlocksCleared"]


# -- the publisher ------------------------------------------------------------------------
class ZmqPublisher:
    """One rank's PUB socket, replay ROUTER and publisher thread (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = (
            offset_endpoint(config.replay_endpoint, rank) if config.replay_endpoint else None
        )
        self.num_dropped = 0
        self._seq = 0
        self._topic = config.topic.encode()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        self._inbox = ctx.socket(zmq.PULL)
        self._outbox = ctx.socket(zmq.PUSH)
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
            inbox = f"inproc://kvgate-kv-events-{os.getpid()}-{next(_inproc_ids)}"
            for sock in (self._inbox, self._outbox):
                sock.set_hwm(config.max_queue_size)
                sock.setsockopt(zmq.LINGER, 0)
            self._inbox.bind(inbox)
            self._outbox.connect(inbox)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"KV events: cannot open {self.endpoint}: {exc}") from None
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-rank{rank}", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[CacheEvent], ts: float) -> None:
        """Hand one step's events to the publisher thread; never blocks (see the docstring)."""
        payload = encode_batch(events, ts, self.rank, self.config.encoding)
        seq = self._seq.to_bytes(8, "big")
        self._seq += 1
        try:
            self._outbox.send_multipart((seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1

    def close(self) -> None:
        """Send what is queued (up to a second), then close the sockets."""
        with contextlib.suppress(zmq.Again):
            self._outbox.send(b"", flags=zmq.NOBLOCK)
        self._thread.join(_SHUTDOWN_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay, self._inbox, self._outbox):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self._inbox:
                    frames = self._inbox.recv_multipart()
                    if len(frames) == 1:
                        return  # close()
                    seq, payload = frames
                    self._pub.send_multipart((self._topic, seq, payload))
                    self._buffer.append((seq, payload))
                else:
                    self._serve_replay()

    def _serve_replay(self) -> None:
        """Answer one replay request: the buffered batches from its seq on, then the marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        envelope = frames[:2] if len(frames) == 3 and frames[1] == b"" else frames[:1]
        start = frames[-1]
        head = [*envelope, self._topic] if self.config.topic_in_replay else envelope
        if len(frames) in (2, 3) and len(start) == 8:
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if int.from_bytes(seq, "big") >= first:
                    self._replay.send_multipart((*head, seq, payload))
        self._replay.send_multipart((*head, END_SEQ, b""))
