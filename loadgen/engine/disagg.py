"""Prefill/decode disaggregation in the simulated engine: vLLM's NixlConnector as a router sees it.

An engine started with `--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": R}'`
plays the prefill role (`kv_producer`), the decode role (`kv_consumer`) or either (`kv_both`,
what vLLM's own P/D examples start both sides with). The exchange is vLLM's (its
`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py` and
`docs/features/nixl_connector_usage.md`):

    router ──▶ prefill   the client's request, `stream: false`, `max_tokens: 1`, and
                         kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
                         remote_engine_id/remote_block_ids/remote_host/remote_port: null}
    prefill ──▶ router   the completion with a top-level `kv_transfer_params`:
                         {do_remote_prefill: true, do_remote_decode: false, remote_engine_id,
                          remote_block_ids, remote_host, remote_port, remote_request_id, tp_size}
                         and it HOLDS those blocks (not evictable) until a decode instance has read
                         them or VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s) passes
    router ──▶ decode    the client's request with those params; the decode instance pulls the
                         blocks its own prefix cache lacks, then decodes (its prefill is the tail)

The pull is NIXL's side channel in vLLM (a ZMQ handshake on VLLM_NIXL_SIDE_CHANNEL_PORT, then
RDMA reads); here it is one `POST /kv_transfer/pull` on the prefill instance's HTTP port (so
`remote_port` is that port), and the read itself is time: `latency + bytes / bandwidth`, bytes =
blocks pulled × block size × KV bytes per token. A pull that cannot be served (another engine's
id, a request the prefill instance never held, already read or timed out, the instance gone) is
handled by `kv_load_failure_policy`, as vLLM's: `recompute` (default) prefills locally,
`fail` answers 500 before any byte so that a router can retry elsewhere. Malformed params are a
400. Blocks pulled are stored in the decode instance's cache like computed ones (KV events
announce them). An engine without a connector ignores `kv_transfer_params`, as vLLM does.

SGLang's protocol (`--disaggregation-mode prefill|decode`; sglang-router `--pd-disaggregation`)
is also played: the router sends the request to a prefill and a decode instance at once, both
carrying `bootstrap_host`, `bootstrap_port` (the prefill's) and `bootstrap_room`. The prefill
instance prefills (one token) and holds the blocks under the room; the decode instance pulls
them from `bootstrap_host:bootstrap_port` — the same side channel, so the bootstrap port is the
prefill instance's HTTP port here — waiting (up to BOOTSTRAP_WAIT_S) for the prefill to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from loadgen.engine.kvpool import BlockPool
from loadgen.engine.prompts import BadRequest

PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"
BOTH = "kv_both"
ROLES = (PRODUCER, CONSUMER, BOTH)
CONNECTORS = ("NixlConnector",)
FAILURE_POLICIES = ("recompute", "fail")
PULL_PATH = "/kv_transfer/pull"

DEFAULT_PULL_GB_PER_S = 25.0
"""A 200 Gb/s RDMA NIC's payload rate: 25 GB/s."""
DEFAULT_PULL_LATENCY_MS = 2.0
"""Per request: the side channel's round trip and the read's set-up (handshakes are cached)."""
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
"""An 8B Llama in bf16: 32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 128 KiB."""
DEFAULT_ABORT_TIMEOUT_S = 480.0
"""vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: a prefill instance frees unread blocks after it."""

BOOTSTRAP_WAIT_S = 60.0
MAX_ABANDONED_ROOMS = 10_000
"""SGLang rooms remembered as given up by their decode instance (bounded: the oldest go)."""
"""How long a decode instance's pull waits for the prefill of its room (SGLang: they start at
once); wall seconds, as the router's own timeouts are."""

_CONFIG_KEYS = ("kv_connector", "kv_role", "engine_id", "kv_load_failure_policy")


@dataclass(frozen=True)
class KVTransferConfig:
    """The engine's `--kv-transfer-config` (vLLM's keys) and the simulation's transfer model."""

    kv_connector: str = "NixlConnector"
    kv_role: str = BOTH
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_load_failure_policy: str = "recompute"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    """Where decode instances pull from: the engine's own HTTP address (set at start)."""
    pull_gb_per_s: float = DEFAULT_PULL_GB_PER_S
    pull_latency_ms: float = DEFAULT_PULL_LATENCY_MS
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S
    bootstrap_wait_s: float = BOOTSTRAP_WAIT_S
    """SGLang: how long (wall seconds) a room's pull waits for its prefill to finish."""
    sglang: bool = False
    """SGLang's bootstrap protocol (`--disaggregation-mode`) instead of vLLM's params."""

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}")
        if self.pull_gb_per_s <= 0 or self.pull_latency_ms < 0 or self.kv_bytes_per_token < 1:
            raise ValueError("the pull's bandwidth and KV bytes per token must be positive")
        if self.abort_timeout_s <= 0 or self.bootstrap_wait_s <= 0:
            raise ValueError("abort_timeout_s and bootstrap_wait_s must be positive")

    @property
    def produces(self) -> bool:
        return self.kv_role in (PRODUCER, BOTH)

    @property
    def consumes(self) -> bool:
        return self.kv_role in (CONSUMER, BOTH)


def parse_kv_transfer_config(text: str, **simulation: Any) -> KVTransferConfig:
    """vLLM's JSON flag (unknown keys refused, naming the known ones) plus the simulation's."""
    try:
        raw = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(raw) - set(_CONFIG_KEYS) - {"kv_connector_extra_config"})
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown keys {unknown}; known: {_CONFIG_KEYS}")
    known = {k: v for k, v in raw.items() if k in _CONFIG_KEYS and v is not None}
    return KVTransferConfig(**known, **simulation)


@dataclass(frozen=True)
class TransferRequest:
    """What a request's `kv_transfer_params` ask of this engine."""

    remote_decode: bool = False
    """Prefill for another instance: answer with params, hold the blocks."""
    remote_prefill: bool = False
    """Decode after another instance's prefill: pull what is missing first."""
    engine_id: str = ""
    request_id: str = ""
    host: str = ""
    port: int = 0
    num_blocks: int = 0


def parse_transfer_params(body: dict[str, Any]) -> TransferRequest | None:
    """The request's `kv_transfer_params`, checked (None: none, or nothing asked)."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise BadRequest("'kv_transfer_params' must be an object")
    if params.get("do_remote_decode") is True:
        return TransferRequest(remote_decode=True)
    if params.get("do_remote_prefill") is not True:
        return None
    engine_id, block_ids = params.get("remote_engine_id"), params.get("remote_block_ids")
    host, port = params.get("remote_host"), params.get("remote_port")
    request_id = params.get("remote_request_id")
    if not (
        isinstance(engine_id, str)
        and isinstance(request_id, str)
        and isinstance(host, str)
        and isinstance(port, int)
        and not isinstance(port, bool)
        and isinstance(block_ids, list)
        and all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids)
    ):
        raise BadRequest(
            "kv_transfer_params with do_remote_prefill needs remote_engine_id, "
            "remote_request_id, remote_host (strings), remote_port (an integer) and "
            "remote_block_ids (a list of integers)"
        )
    return TransferRequest(
        remote_prefill=True,
        engine_id=engine_id,
        request_id=request_id,
        host=host,
        port=port,
        num_blocks=len(block_ids),
    )


def parse_bootstrap(body: dict[str, Any], prefill: bool) -> TransferRequest | None:
    """SGLang's `bootstrap_host/port/room` (None: a request served whole)."""
    room, host, port = (
        body.get("bootstrap_room"),
        body.get("bootstrap_host"),
        body.get("bootstrap_port"),
    )
    if room is None:
        return None
    if not isinstance(room, int) or isinstance(room, bool):
        raise BadRequest("'bootstrap_room' must be an integer")
    if prefill:
        return TransferRequest(remote_decode=True, request_id=f"room-{room}")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        raise BadRequest("a decode request needs 'bootstrap_host' and an integer 'bootstrap_port'")
    return TransferRequest(remote_prefill=True, request_id=f"room-{room}", host=host, port=port)


@dataclass
class _Held:
    hashes: tuple[bytes, ...]
    pool: BlockPool
    expiry: asyncio.TimerHandle | None = None


@dataclass
class TransferCounters:
    """vLLM's NIXL connector metrics (`vllm:nixl_*`), as the simulation counts them."""

    num_transfers: int = 0
    num_failed_transfers: int = 0
    bytes_transferred: int = 0
    blocks_transferred: int = 0
    num_held: int = 0
    """Requests whose blocks a prefill instance holds for a decode instance right now."""
    num_expired: int = 0


class Connector:
    """One engine's connector: the blocks it holds for decode instances (producer) and the
    pulls it makes (consumer).

    Invariants: a request's blocks are held once, released once (by the pull or the timeout,
    whichever comes first); a pull never reports more blocks than the producer held.
    """

    def __init__(self, config: KVTransferConfig, time_scale: float, block_size: int) -> None:
        self.config = config
        self.time_scale = time_scale
        self.block_size = block_size
        self.counters = TransferCounters()
        self._held: dict[str, _Held] = {}
        self._block_ids = itertools.count()
        self._client: httpx.AsyncClient | None = None
        self.on_release: Callable[[], None] | None = None
        """Called when held blocks are freed (the engine's queue may have waited for them)."""
        self._arrivals: dict[str, asyncio.Event] = {}
        """SGLang: rooms a decode instance waits for (its pull came before the prefill ended)."""
        self._abandoned: dict[str, None] = {}
        """SGLang: rooms whose decode instance stopped waiting (its pull timed out): their
        prefill's blocks are not held when it ends (SGLang's sender fails the room), else they
        would pin the cache until the abort timeout and stall the queue behind them."""

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.bootstrap_wait_s + 10.0 if self.config.sglang else 10.0)
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def stop(self) -> None:
        for request_id in list(self._held):
            self._release(request_id)
        if self._client is not None:
            await self._client.aclose()

    def parse(self, body: dict[str, Any]) -> TransferRequest | None:
        """The request's transfer params, when they ask something of this engine's role."""
        transfer = (
            parse_bootstrap(body, self.config.produces)
            if self.config.sglang
            else parse_transfer_params(body)
        )
        if transfer is None:
            return None
        wanted = self.config.produces if transfer.remote_decode else self.config.consumes
        return transfer if wanted else None

    # -- producer ------------------------------------------------------------------------------
    def hold(self, request_id: str, pool: BlockPool, hashes: Sequence[bytes]) -> dict[str, Any]:
        """After a remote-decode prefill: hold the leading blocks still cached and answer with
        the params a decode instance pulls them by."""
        kept = tuple(hashes[: pool.match(hashes)])
        if request_id in self._abandoned:  # its decode instance gave up waiting
            del self._abandoned[request_id]
            self.counters.num_expired += 1
            return self._params(request_id, len(kept))
        pool.acquire(kept)
        loop = asyncio.get_running_loop()
        held = _Held(kept, pool)
        held.expiry = loop.call_later(
            self.config.abort_timeout_s / self.time_scale, self._expire, request_id
        )
        self._held[request_id] = held
        self.counters.num_held = len(self._held)
        arrival = self._arrivals.get(request_id)
        if arrival is not None:
            arrival.set()
        return self._params(request_id, len(kept))

    def _params(self, request_id: str, num_blocks: int) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_block_ids": [next(self._block_ids) for _ in range(num_blocks)],
            "remote_host": self.config.side_channel_host,
            "remote_port": self.config.side_channel_port,
            "remote_request_id": request_id,
            "tp_size": 1,
        }

    def _expire(self, request_id: str) -> None:
        if request_id in self._held:
            self.counters.num_expired += 1
            self._release(request_id)

    def _release(self, request_id: str) -> int:
        held = self._held.pop(request_id)
        if held.expiry is not None:
            held.expiry.cancel()
        held.pool.release(held.hashes, 0)
        self.counters.num_held = len(self._held)
        if self.on_release is not None:
            self.on_release()
        return len(held.hashes)

    async def serve_pull(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The side channel: a decode instance reads a held request's blocks (they are freed);
        SGLang's waits for its room's prefill first."""
        engine_id, request_id = body.get("engine_id"), body.get("request_id")
        if self.config.sglang:  # rooms, not engine ids; the prefill may still be running
            if isinstance(request_id, str) and request_id not in self._held:
                arrival = self._arrivals.setdefault(request_id, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrival.wait(), self.config.bootstrap_wait_s)
                self._arrivals.pop(request_id, None)
                if request_id not in self._held:  # gave up: its prefill holds nothing for it
                    self._abandoned[request_id] = None
                    while len(self._abandoned) > MAX_ABANDONED_ROOMS:
                        del self._abandoned[next(iter(self._abandoned))]
        elif engine_id != self.config.engine_id:
            return 404, {"error": f"engine {engine_id!r} is not this engine"}
        if not isinstance(request_id, str) or request_id not in self._held:
            return 404, {"error": f"no blocks held for request {request_id!r} (read or expired)"}
        return 200, {"num_blocks": self._release(request_id)}

    # -- consumer ------------------------------------------------------------------------------
    async def pull(self, params: TransferRequest, num_local_blocks: int) -> int | None:
        """Pull a remote prefill's blocks (those past `num_local_blocks`, which this engine
        already holds); returns the leading blocks now available (local or pulled), or None
        when the pull failed."""
        assert self._client is not None, "the connector is started with the engine"
        url = f"http://{params.host}:{params.port}{PULL_PATH}"
        payload = {"engine_id": params.engine_id, "request_id": params.request_id}
        try:
            response = await self._client.post(url, json=payload)
            num_blocks = response.json().get("num_blocks") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            num_blocks = None
        if not isinstance(num_blocks, int):
            self.counters.num_failed_transfers += 1
            return None
        pulled = max(num_blocks - num_local_blocks, 0)
        num_bytes = pulled * self.block_size * self.config.kv_bytes_per_token
        seconds = self.config.pull_latency_ms / 1000 + num_bytes / (self.config.pull_gb_per_s * 1e9)
        await asyncio.sleep(seconds / self.time_scale)  # the simulated read, not a synchronisation
        self.counters.num_transfers += 1
        self.counters.bytes_transferred += num_bytes
        self.counters.blocks_transferred += pulled
        return max(num_blocks, num_local_blocks)


def describe(config: KVTransferConfig | None) -> str:
    if config is None:
        return "P/D off"
    if config.sglang:
        return f"SGLang disaggregation {'prefill' if config.produces else 'decode'}"
    return f"{config.kv_connector} {config.kv_role} (engine {config.engine_id[:8]})"


def as_dict(config: KVTransferConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
