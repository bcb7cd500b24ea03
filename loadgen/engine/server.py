"""The simulated engine replica: looks like vLLM to any router, runs `timing.EngineCore`.

Endpoints (vLLM's, plus the SGLang probes that sglang-router uses):
  GET  /health /ping /v1/models /version /server_info /get_server_info /model_info
       /get_model_info /metrics /get_load /load
  POST /tokenize /detokenize /v1/completions/render /v1/chat/completions/render
       /v1/completions /v1/chat/completions   (SSE when "stream": true)
       /reset_prefix_cache
       /v1/load_lora_adapter /v1/unload_lora_adapter   (with VLLM_ALLOW_RUNTIME_LORA_UPDATING)

LoRA adapters (`--lora-modules`, `--max-loras`, `--lora-load-s`): `loadgen.engine.lora`.

Prompts are rendered with the model's chat template and tokenized with its BPE
(`loadgen.engine.prompts`, `loadgen.engine.tokenizer`; once per app, shared by the ranks, as
vLLM's API server tokenizes for all of them); the prefix cache hashes those token ids.
Generation is deterministic: exactly `max_tokens` tokens (as with vLLM's `ignore_eos`) of the
vocabulary's single-token words, seeded by the prompt, `finish_reason: "length"`.
`usage.prompt_tokens_details.cached_tokens` is present unless `report_cached_tokens` is off.
`cache_salt` is mixed into block 0 of the prefix cache, as in vLLM.

Streaming is vLLM's: one SSE event per engine step that gave the request tokens: one token
while the client keeps up, everything generated since the last event when it lags (nothing is
held back on a timer); `--stream-interval N` waits for N new tokens (or the last one).

`--data-parallel-size N` runs N ranks behind the one port, each with its own EngineCore, cache
and KV-event publisher (`kv_events`, port + rank); the `X-data-parallel-rank` header picks one,
otherwise vLLM's internal load balancing does: the rank with the least 4 × waiting + running,
the lowest on ties (`DPLBAsyncMPClient.get_core_engine_for_request`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mmh3
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cachemap.multimodal import DEFAULT_TOKENS_PER_IMAGE, Placeholder, extras_of
from loadgen.engine.disagg import (
    CONSUMER,
    DEFAULT_ABORT_TIMEOUT_S,
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_PULL_GB_PER_S,
    DEFAULT_PULL_LATENCY_MS,
    PRODUCER,
    PULL_PATH,
    Connector,
    KVTransferConfig,
    TransferRequest,
    parse_kv_transfer_config,
)
from loadgen.engine.disagg import describe as describe_transfer
from loadgen.engine.kv_events import KVEventsConfig, ZmqPublisher, parse_kv_events_config
from loadgen.engine.kvpool import BlockPool
from loadgen.engine.lora import (
    DEFAULT_LORA_LOAD_S,
    DEFAULT_MAX_LORAS,
    AdapterError,
    AdapterRegistry,
    AdapterSlots,
    lora_info_labels,
    parse_lora_module,
    runtime_updating_from_env,
)
from loadgen.engine.prompts import (
    BadRequest,
    RenderedPrompts,
    detokenize_response,
    render_response,
    tokenize_response,
)
from loadgen.engine.timing import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_CPU_HIT_COST_FRAC,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_TOKENS_PER_S,
    FINISHED,
    FIRST_TOKEN,
    EngineCore,
    Job,
    TimingModel,
    add_decode_arguments,
    decode_from_args,
)
from loadgen.engine.tokenizer import MODEL_DIR, block_hashes, default_tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MODEL = "kvgate-sim-8b"
DEFAULT_MAX_MODEL_LEN = 131_072
DEFAULT_CHAT_MAX_TOKENS = 64
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_STREAM_INTERVAL = 1
"""vLLM's `--stream-interval` default: every step's tokens go out at once."""
VLLM_VERSION = "0.11.0"
DP_RANK_HEADER = "X-data-parallel-rank"


SEEN_HEADERS_KEPT = 256
"""Headers of the last 256 generation requests are kept for tests (a few KB each at most)."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    timing: TimingModel = field(default_factory=TimingModel)
    fail_first_bytes: int = 0
    """Test hook (SGLang's mock_worker has the same): this many generation requests fail with a
    500 before any byte, after their prefill time (an engine dying mid-prefill), writing no KV."""
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    data_parallel_size: int = 1
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    cpu_offload_blocks: int = 0
    """Blocks of the write-through CPU tier (0: none)."""
    hang_first_bytes: int = 0
    """Test hook: this many generation requests are accepted and never answered — not a header,
    not a byte — until the client leaves (a hung engine)."""
    stall_after_tokens: int | None = None
    """Test hook: every streamed answer stops sending after this many tokens, its connection
    open, until the client leaves (an engine stalled mid-stream)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served beside the base model (vLLM `--lora-modules name=path`): a request
    whose `model` is one is computed with it, so its blocks chain from the adapter's name (and
    its KV events carry `lora_name`); `/v1/models` lists each with the base as its `parent`."""
    max_loras: int = DEFAULT_MAX_LORAS
    """Adapters resident in a rank's GPU slots at once (vLLM `--max-loras`; 0: no limit):
    `loadgen.engine.lora`."""
    lora_load_s: float = DEFAULT_LORA_LOAD_S
    """A cold load's cost, in seconds of the simulated GPU (divided by `time_scale`)."""
    enable_lora: bool = False
    """vLLM's `--enable-lora` (implied by adapters at start or runtime updating)."""
    runtime_lora_updating: bool = False
    """`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` answer (vLLM: the
    VLLM_ALLOW_RUNTIME_LORA_UPDATING environment variable)."""
    mm_tokens_per_image: int = DEFAULT_TOKENS_PER_IMAGE
    """Placeholder tokens each image of a chat expands into (`cachemap.multimodal`)."""
    report_cached_tokens: bool = True
    """`usage.prompt_tokens_details.cached_tokens` in every answer (vLLM reports it only with
    `--enable-prompt-tokens-details`; False: the usage has no `prompt_tokens_details`)."""
    kv_transfer: KVTransferConfig | None = None
    """Prefill/decode disaggregation (vLLM `--kv-transfer-config`, `loadgen.engine.disagg`):
    None serves every request whole and ignores `kv_transfer_params`, as vLLM does."""

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if self.cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks must be non-negative")
        if self.mm_tokens_per_image < 1:
            raise ValueError("mm_tokens_per_image must be at least 1")
        if self.model in self.lora_modules or len(set(self.lora_modules)) < len(self.lora_modules):
            raise ValueError("a LoRA adapter's name must differ from the model's and the others'")
        if self.max_loras < 0 or self.lora_load_s < 0:
            raise ValueError("max_loras and lora_load_s must be non-negative")

    @property
    def lora_enabled(self) -> bool:
        """vLLM's `--enable-lora`: adapters at start, or loadable at run time."""
        return self.enable_lora or bool(self.lora_modules) or self.runtime_lora_updating


def _error(message: str, status: int) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


@dataclass
class _Waiter:
    """What a handler awaits: the first token, the last, and every step in between."""

    first: asyncio.Future[None]
    done: asyncio.Future[None]
    progress: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    """One data-parallel rank: its scheduler and cache, their asyncio driver, its KV-event
    publisher, and counters for /metrics."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        pool = BlockPool(
            config.capacity_blocks,
            config.cpu_offload_blocks,
            record_events=config.kv_events.enabled,
        )
        self.core = EngineCore(config.timing, pool, stream_tokens=True)
        self.adapters = AdapterSlots(
            config.max_loras, config.lora_load_s / config.timing.time_scale
        )
        self._holding: set[str] = set()
        """Jobs holding their adapter's slot (released once: at their end or abort)."""
        self.start_time = time.time()
        self.num_failures_left = config.fail_first_bytes
        self.publisher: ZmqPublisher | None = None
        self._waiters: dict[str, _Waiter] = {}
        self.num_hangs_left = config.hang_first_bytes
        self.stall_after_tokens = config.stall_after_tokens
        self.num_stalled = 0
        """Streams stalled right now (`stall_after_tokens`) whose client has not left."""
        self._wakeup: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.last_traceparent: str | None = None
        """The W3C `traceparent` of the last generation request (vLLM continues it when it
        traces): lets a test see what a router passed on."""
        self.seen_headers: list[dict[str, str]] = []
        """The headers of recent generation requests (the last SEEN_HEADERS_KEPT): lets a test
        see that a router never passes a tenant's key on."""

    @property
    def load(self) -> int:
        """vLLM's DP load-balancing score: a waiting request weighs four running ones."""
        return 4 * self.core.num_waiting + self.core.num_running

    # -- driver ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.config.kv_events.enabled:
            self.publisher = ZmqPublisher(self.config.kv_events, self.rank)
        self._wakeup = asyncio.Event()
        self._driver = asyncio.create_task(self._drive())

    async def stop(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        if self.publisher is not None:
            self._flush()
            self.publisher.close()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            self._flush()
            due = self.core.next_event_time()
            self._wakeup.clear()
            if due is None:
                await self._wakeup.wait()
                continue
            delay = due - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), delay)
                continue
            for _, kind, job in self.core.advance(loop.time()):
                waiter = self._waiters.get(job.id)
                if waiter is None:
                    continue
                waiter.progress.set()
                target = waiter.first if kind == FIRST_TOKEN else waiter.done
                if kind != FINISHED and kind != FIRST_TOKEN:
                    continue
                if not target.done():
                    target.set_result(None)
                if kind == FINISHED:
                    self._waiters.pop(job.id, None)
                    self.release_adapter(job)

    def _flush(self) -> None:
        """Publish the cache events of the steps just run as one batch (vLLM: one per step)."""
        log = self.core.cache.log
        if log is not None and log.events and self.publisher is not None:
            self.publisher.publish(log.take(), time.time())

    def submit(self, job: Job) -> _Waiter:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), loop.create_future())
        self._waiters[job.id] = waiter
        self.core.submit(loop.time(), job)
        assert self._wakeup is not None
        self._wakeup.set()
        return waiter

    async def hold_adapter(self, job: Job) -> None:
        """Before the job's prefill: its adapter in a GPU slot (a wait, a cold load)."""
        if job.lora_name is None:
            return
        await self.adapters.acquire(job.lora_name)
        self._holding.add(job.id)

    def release_adapter(self, job: Job) -> None:
        if job.id in self._holding:
            self._holding.discard(job.id)
            assert job.lora_name is not None
            self.adapters.release(job.lora_name)

    def abort(self, job: Job) -> None:
        self.release_adapter(job)
        self.core.abort(asyncio.get_running_loop().time(), job)
        self._waiters.pop(job.id, None)
        assert self._wakeup is not None
        self._wakeup.set()

    def blocks_freed(self) -> None:
        """A KV connector freed blocks it held: the scheduler looks at its queue again."""
        self.core.blocks_freed(asyncio.get_running_loop().time())
        if self._wakeup is not None:
            self._wakeup.set()

    def reset_prefix_cache(self) -> bool:
        done = self.core.reset_prefix_cache()
        if done:
            self._flush()
        return done

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._ids)}"


# -- request parsing ----------------------------------------------------------------------
def _int_field(body: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"'{name}' must be an integer >= {minimum}")
    return value


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# -- metrics --------------------------------------------------------------------------------
class _EngineCollector(Collector):
    """vLLM's metric names, one series per data-parallel rank (label `engine`, as vLLM's)."""

    def __init__(self, engines: Sequence[Engine], connector: Connector | None = None) -> None:
        self.engines = engines
        self.connector = connector

    def collect(self) -> Iterable[Any]:
        labels = ["model_name", "engine"]
        ranks = [([e.config.model, str(e.rank)], e) for e in self.engines]
        offload = self.engines[0].config.cpu_offload_blocks > 0

        def gauge(name: str, doc: str, value: Callable[[Engine], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for values, e in ranks:
                g.add_metric(values, value(e))
            return g

        def counter(name: str, doc: str, value: Callable[[Engine], float]) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            for values, e in ranks:
                c.add_metric(values, value(e))
            return c

        yield gauge("vllm:num_requests_running", "Requests in the batch.", _running)
        yield gauge("vllm:num_requests_waiting", "Requests queued.", _waiting)
        usage_doc = "KV cache usage: blocks running requests use (1 = full; cached ones are free)."
        yield gauge("vllm:kv_cache_usage_perc", usage_doc, _usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV cache usage (deprecated name).", _usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up.", _queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found on the GPU.", _gpu_hits)
        if offload:
            yield counter(
                "vllm:external_prefix_cache_queries", "Prompt tokens looked up.", _queries
            )
            yield counter(
                "vllm:external_prefix_cache_hits", "Prompt tokens loaded from the CPU.", _cpu_hits
            )
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", _queries)
        yield counter("vllm:generation_tokens", "Tokens generated.", _generated)
        yield counter("vllm:request_success", "Requests finished.", _finished)
        yield counter("vllm:num_preemptions", "Preemptions (never: requests reserve KV).", _zero)
        # vLLM's info gauge: the cache config in labels, value 1 (num_gpu_blocks per rank)
        info_labels = ["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching"]
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels
        )
        first = self.engines[0].config
        info.add_metric(
            [
                str(first.block_size),
                str(first.capacity_blocks),
                str(first.cpu_offload_blocks),
                "True",
            ],
            1.0,
        )
        yield info
        if first.lora_enabled:  # vLLM: only with --enable-lora; the value is the report's time
            labels_now = lora_info_labels(first.max_loras, (e.adapters for e in self.engines))
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=list(labels_now),
            )
            lora.add_metric(list(labels_now.values()), time.time())
            yield lora
        if self.connector is not None:
            yield from _transfer_metrics(self.connector)
        start = GaugeMetricFamily("process_start_time_seconds", "Start time (Unix s).")
        start.add_metric([], self.engines[0].start_time)
        yield start


def _transfer_metrics(connector: Connector) -> Iterable[Any]:
    """The KV connector's counters, under vLLM's NIXL metric names."""
    c = connector.counters
    for name, doc, value in (
        ("vllm:nixl_num_transfers", "KV pulls completed.", c.num_transfers),
        ("vllm:nixl_num_failed_transfers", "KV pulls refused or failed.", c.num_failed_transfers),
        (
            "vllm:nixl_bytes_transferred",
            "KV bytes pulled from prefill instances.",
            c.bytes_transferred,
        ),
        ("vllm:nixl_blocks_transferred", "KV blocks pulled.", c.blocks_transferred),
        ("vllm:nixl_num_expired", "Held requests freed unread (abort timeout).", c.num_expired),
    ):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], value)
        yield family
    held = GaugeMetricFamily("vllm:nixl_num_held_requests", "Requests whose blocks are held.")
    held.add_metric([], c.num_held)
    yield held


def _running(e: Engine) -> float:
    return e.core.num_running


def _waiting(e: Engine) -> float:
    return e.core.num_waiting + e.adapters.num_waiting  # waiting for an adapter's slot too


def _usage(e: Engine) -> float:
    return e.core.cache.usage


def _queries(e: Engine) -> float:
    return e.core.counters.prompt_tokens


def _gpu_hits(e: Engine) -> float:
    return e.core.counters.cached_tokens - e.core.counters.cpu_cached_tokens


def _cpu_hits(e: Engine) -> float:
    return e.core.counters.cpu_cached_tokens


def _generated(e: Engine) -> float:
    return e.core.counters.generation_tokens


def _finished(e: Engine) -> float:
    return e.core.counters.requests_finished


def _zero(e: Engine) -> float:
    return 0.0


# -- the app ------------------------------------------------------------------------------
OFF_LOOP_BYTES = 64 * 1024
"""A request body at least this long is parsed and tokenized in the tokenizer thread (~16k
tokens: an encode of ~40 ms or more, which held /health on the loop); a shorter one inline."""


def _tokenizer_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="engine-tokenizer")


class _EngineApp:
    """The HTTP surface of the simulated replica: vLLM's endpoints (and SGLang's probes) over
    one `Engine` per data-parallel rank, a method each."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engines = [Engine(config, rank) for rank in range(config.data_parallel_size)]
        self.engine = self.engines[0]
        self.connector: Connector | None = None
        if config.kv_transfer is not None:
            self.connector = Connector(
                config.kv_transfer, config.timing.time_scale, config.block_size
            )
            self.connector.on_release = self.blocks_freed
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(self.engines, self.connector))
        self.prompts = RenderedPrompts(
            config.mm_tokens_per_image
        )  # the API server's: every rank's requests are here
        self.local_tokenizer = str(MODEL_DIR)  # a Hugging Face tokenizer directory (routers)
        self.adapters = AdapterRegistry(
            config.model, ((name, f"/adapters/{name}") for name in config.lora_modules)
        )
        self.tokenizer_thread = _tokenizer_thread()
        """Prompts are rendered and tokenized here, one at a time in arrival order, never on
        the event loop: vLLM's API server tokenizes in a worker thread too, so its /health and
        /metrics answer in milliseconds while a 100k-token prompt is encoded (~0.3 s here on a
        quiet machine, seconds at a load of 10 on two cores: gateways' 1-s probes failed and
        marked the whole fleet down). The BPE releases the GIL while it encodes. A stop shuts
        it down and leaves a fresh one (its thread starts with its first call): the app may be
        served again (a restarted engine)."""

    async def off_loop(self, request: Request, call: Callable[[], T]) -> T:
        """`call()` in the tokenizer thread (its exceptions raise here) when the request's
        body is long (`OFF_LOOP_BYTES`), else inline: a short prompt's encode (~2 ms for
        2,000 tokens) is cheaper than the thread's two hand-offs of the GIL, which the tests'
        in-process engines share with their clients' threads."""
        if len(await request.body()) < OFF_LOOP_BYTES:  # read already: starlette keeps it
            return call()
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, call)

    def blocks_freed(self) -> None:
        for e in self.engines:
            e.blocks_freed()

    def model_card(self, adapter: str | None = None) -> dict[str, Any]:
        """The base model's card, or an adapter's (vLLM: `root` its path, `parent` the base)."""
        config = self.config
        return {
            "id": adapter or config.model,
            "object": "model",
            "created": int(self.engine.start_time),
            "owned_by": "vllm",
            "root": self.adapters.paths.get(adapter, "") if adapter else config.model,
            "parent": config.model if adapter else None,
            "max_model_len": config.max_model_len,
        }

    def server_info(self) -> dict[str, Any]:
        config, t = self.config, self.config.timing
        return {
            "model_path": self.local_tokenizer,
            "tokenizer_path": self.local_tokenizer,
            "served_model_name": config.model,
            "version": VLLM_VERSION,
            "start_time": self.engine.start_time,
            "max_model_len": config.max_model_len,
            "block_size": config.block_size,
            "num_gpu_blocks": config.capacity_blocks,
            "max_num_seqs": t.max_batch,
            "max_running_requests": t.max_batch,
            "prefill_tokens_per_s": t.prefill_tokens_per_s,
            "decode_s_per_token": t.decode_s_per_token,
            "decode_s_per_seq": t.decode_s_per_seq,
            "decode_s_per_context_token": t.decode_s_per_context_token,
            "time_scale": t.time_scale,
            "stream_interval": config.stream_interval,
            "data_parallel_size": config.data_parallel_size,
            "dp_size": config.data_parallel_size,
            "cpu_offload_blocks": config.cpu_offload_blocks,
            "kv_events_config": orjson.dumps(dataclasses.asdict(config.kv_events)).decode(),
            "max_loras": config.max_loras,
            "lora_load_s": config.lora_load_s,
            "lora_loads": sum(e.adapters.num_loads for e in self.engines),
            "lora_evictions": sum(e.adapters.num_evictions for e in self.engines),
        }

    # -- probes ------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        cards = [self.model_card(), *(self.model_card(a) for a in self.adapters.names())]
        return JSONResponse({"object": "list", "data": cards})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def info(self, request: Request) -> Response:
        return JSONResponse(self.server_info())

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.local_tokenizer,
                "tokenizer_path": self.local_tokenizer,
                "served_model_name": self.config.model,
                "is_generation": True,
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    def num_requests(self) -> int:
        return sum(e.core.num_running + e.core.num_waiting for e in self.engines)

    async def get_load(self, request: Request) -> Response:
        return JSONResponse({"load": self.num_requests()})

    async def load(self, request: Request) -> Response:
        return JSONResponse({"server_load": self.num_requests()})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime load: the adapter is registered (listed, servable); its weights
        reach a GPU slot with the first request that needs them."""
        return await self._update_adapters(request, self.adapters.load)

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._update_adapters(request, self.adapters.unload)

    async def _update_adapters(self, request: Request, change: Callable[[object], str]) -> Response:
        try:
            body = await _json_body(request)
            message = change(body)
        except BadRequest as exc:
            return _error(str(exc), exc.status)
        except AdapterError as exc:
            return _error(str(exc), exc.status)
        for e in self.engines:  # an unloaded adapter leaves its slots once idle
            for name in list(e.adapters.resident):
                if name not in self.adapters:
                    e.adapters.forget(name)
        return Response(message, media_type="text/plain")

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's endpoint: every rank forgets its cache (GPU and CPU), announced as one
        AllBlocksCleared each; refused, as vLLM refuses, while requests hold blocks."""
        busy = [e.rank for e in self.engines if e.core.cache.num_used]
        if busy:
            ranks = ", ".join(map(str, busy))
            return _error(f"requests are running on rank(s) {ranks}: the cache was not reset", 409)
        for e in self.engines:
            e.reset_prefix_cache()
        return Response(status_code=200)

    # -- tokenizer endpoints -----------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            limit = self.config.max_model_len
            return JSONResponse(
                await self.off_loop(request, lambda: tokenize_response(body, limit, self.prompts))
            )
        except BadRequest as exc:
            return _error(str(exc), exc.status)

    async def detokenize(self, request: Request) -> Response:
        try:
            return JSONResponse(detokenize_response(await _json_body(request)))
        except BadRequest as exc:
            return _error(str(exc), exc.status)

    async def render_chat(self, request: Request) -> Response:
        return await self.render(request, chat=True)

    async def render_completion(self, request: Request) -> Response:
        return await self.render(request, chat=False)

    async def render(self, request: Request, chat: bool) -> Response:
        try:
            body = await _json_body(request)
            model = self.config.model
            return JSONResponse(
                await self.off_loop(
                    request, lambda: render_response(body, chat, model, self.prompts)
                )
            )
        except BadRequest as exc:
            return _error(str(exc), exc.status)

    # -- generation --------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await _json_body(request)
            rank = _pick_rank(self.engines, request)
            config, prompts, adapters = rank.config, self.prompts, self.adapters
            return await _generate(
                rank,
                body,
                lambda: self.off_loop(
                    request, lambda: _parse_generation(config, body, chat, prompts, adapters)
                ),
                request,
                self.connector,
            )
        except BadRequest as exc:
            return _error(str(exc), exc.status)

    async def kv_transfer_pull(self, request: Request) -> Response:
        """The simulated NIXL side channel (`loadgen.engine.disagg`)."""
        if self.connector is None or not self.connector.config.produces:
            return _error("this engine holds no KV for decode instances", 404)
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(str(exc), exc.status)
        status, answer = await self.connector.serve_pull(body)
        return JSONResponse(answer, status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        started: list[Engine] = []
        if self.connector is not None:
            await self.connector.start()
        try:
            for e in self.engines:
                await e.start()
                started.append(e)
            yield
        finally:
            for e in started:
                await e.stop()
            if self.connector is not None:
                await self.connector.stop()
            self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            self.tokenizer_thread = _tokenizer_thread()  # for a next serving (no thread yet)

    def routes(self) -> list[Route]:
        runtime = []
        if self.config.runtime_lora_updating:  # vLLM attaches them only when allowed
            runtime = [
                Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            ]
        return [
            *runtime,
            Route("/health", self.health),
            Route("/ping", self.health),
            Route("/v1/models", self.models),
            Route("/version", self.version),
            Route("/server_info", self.info),
            Route("/get_server_info", self.info),
            Route("/model_info", self.model_info),
            Route("/get_model_info", self.model_info),
            Route("/metrics", self.metrics),
            Route("/get_load", self.get_load),
            Route("/load", self.load),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route(PULL_PATH, self.kv_transfer_pull, methods=["POST"]),
        ]


def create_engine_app(config: EngineConfig | None = None) -> Starlette:
    surface = _EngineApp(config or EngineConfig())
    app = Starlette(routes=surface.routes(), lifespan=surface.lifespan)
    app.state.engine = surface.engine
    app.state.engines = surface.engines
    app.state.prompts = surface.prompts
    return app


def _pick_rank(engines: Sequence[Engine], request: Request) -> Engine:
    """The `X-data-parallel-rank` header's rank, or vLLM's least-loaded one (see the module
    docstring)."""
    header = request.headers.get(DP_RANK_HEADER)
    if header is None:
        return min(engines, key=lambda e: (e.load, e.rank))
    try:
        rank = int(header)
    except ValueError:
        rank = -1
    if not 0 <= rank < len(engines):
        raise BadRequest(
            f"{DP_RANK_HEADER} must be an integer from 0 to {len(engines) - 1}, got {header!r}"
        )
    return engines[rank]


@dataclass(frozen=True)
class _Generation:
    """A generation request, parsed and checked."""

    chat: bool
    tokens: Sequence[int]
    max_tokens: int
    salt: str | None
    stream: bool
    include_usage: bool
    lora_name: str | None = None
    images: tuple[Placeholder, ...] = ()
    """Each image's placeholder span in `tokens` (its identifier keys the blocks it fills)."""


def _parse_generation(
    config: EngineConfig,
    body: dict[str, Any],
    chat: bool,
    prompts: RenderedPrompts,
    adapters: Container[str] = (),
) -> _Generation:
    model = body.get("model")
    if model is not None and model != config.model and model not in adapters:
        raise BadRequest(f"The model `{model}` does not exist.", status=404)
    tokens, images = prompts.prompt(body, chat)
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _int_field(body, "max_completion_tokens", 0, 1) if chat else 0
    max_tokens = max_tokens or _int_field(body, "max_tokens", default_max, 1)
    if _int_field(body, "n", 1, 1) != 1:
        raise BadRequest("only n=1 is supported")
    total = len(tokens) + max_tokens
    if total > config.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {total} tokens ({len(tokens)} in the messages, "
            f"{max_tokens} in the completion)."
        )
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string")
    options = body.get("stream_options")
    return _Generation(
        chat=chat,
        tokens=tokens,
        max_tokens=max_tokens,
        salt=salt,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        lora_name=model if model is not None and model in adapters else None,
        images=images,
    )


def _make_job(engine: Engine, gen: _Generation, body: dict[str, Any]) -> tuple[Job, list[str]]:
    """The job for the core, and the output tokens it will produce (deterministic)."""
    config, tokens = engine.config, gen.tokens
    size = config.block_size
    extras = extras_of(gen.images, (len(tokens) + gen.max_tokens) // size, size)
    hashes = block_hashes(tokens, size, gen.salt, lora_name=gen.lora_name, extras=extras)
    max_cached = (len(tokens) - 1) // config.block_size * config.block_size
    seed = mmh3.hash(hashes[-1] if hashes else repr(list(tokens[-8:])).encode(), signed=False)
    output = default_tokenizer().output_ids(seed, gen.max_tokens)
    pieces = default_tokenizer().pieces(output)
    ids = [*tokens, *output]  # what the blocks hold, and what the KV events announce
    final = block_hashes(ids, size, gen.salt, resume=hashes, lora_name=gen.lora_name, extras=extras)
    job = Job(
        id=engine.next_id("chatcmpl" if gen.chat else "cmpl"),
        block_hashes=hashes,
        num_prompt_tokens=len(tokens),
        num_output_tokens=gen.max_tokens,
        block_size=config.block_size,
        max_cached_tokens=max(max_cached, 0),
        final_hashes=final,
        token_ids=ids,
        cache_salt=gen.salt,
        lora_name=gen.lora_name,
        images=gen.images,
    )
    return job, pieces


@dataclass
class _Reply:
    """How one job's answer is framed (OpenAI's completion and chat-completion shapes)."""

    job: Job
    gen: _Generation
    pieces: list[str]
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    report_cached_tokens: bool = True

    def usage(self) -> dict[str, Any]:
        job = self.job
        usage: dict[str, Any] = {
            "prompt_tokens": job.num_prompt_tokens,
            "completion_tokens": self.gen.max_tokens,
            "total_tokens": job.num_prompt_tokens + self.gen.max_tokens,
        }
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens}
        return usage

    def choice(self, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if not self.gen.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if not delta:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return {
            "index": 0,
            "delta": {"content": text} if text or finish else {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": finish,
        }

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.job.id,
            "object": "chat.completion" if self.gen.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice("".join(self.pieces), "length", delta=False)],
            "usage": self.usage(),
        }

    def chunk(self, **fields: Any) -> bytes:
        head = {
            "id": self.job.id,
            "object": "chat.completion.chunk" if self.gen.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        return b"data: " + orjson.dumps({**head, **fields}) + b"\n\n"


async def _generate(
    engine: Engine,
    body: dict[str, Any],
    parse: Callable[[], Awaitable[_Generation]],
    request: Request,
    connector: Connector | None = None,
) -> Response:
    """Serve one generation on one rank.

    1. Parse: the prompt's tokens, max_tokens, salt, streaming options, its adapter, transfer
       params.
    2. Pull: a remote prefill's blocks this rank lacks (decode role, `disagg`).
    3. Submit: the adapter to a GPU slot (`loadgen.engine.lora`), then the job (its blocks,
       its output) to the rank's scheduler.
    4. Answer: the whole completion when it finishes (with transfer params and the blocks held
       for a decode instance, prefill role), or the SSE stream step by step.
    """
    engine.last_traceparent = request.headers.get("traceparent")
    engine.seen_headers.append(dict(request.headers))
    del engine.seen_headers[:-SEEN_HEADERS_KEPT]
    gen = await parse()  # `_parse_generation`, off the event loop
    transfer = connector.parse(body) if connector is not None else None
    if transfer is not None and transfer.remote_decode and transfer.request_id:
        gen = dataclasses.replace(gen, max_tokens=1)  # SGLang's prefill: its first token only
    failing = engine.num_failures_left > 0
    if failing:
        engine.num_failures_left -= 1
    if engine.num_hangs_left > 0:  # hung: nothing is sent until the client gives up
        engine.num_hangs_left -= 1
        while (await request.receive())["type"] != "http.disconnect":
            pass
        return Response(status_code=499)
    job, pieces = _make_job(engine, gen, body)
    if transfer is not None and transfer.remote_prefill:
        assert connector is not None
        if not await _maybe_pull(engine, connector, transfer, job):
            return _error("KV transfer failed: the remote prefill's blocks could not be read", 500)
    await engine.hold_adapter(job)
    waiter = engine.submit(job)
    if failing:  # the engine dies during the prefill: nothing is cached, the client gets a 500
        job.block_hashes, job.final_hashes = (), ()
        await waiter.first
        engine.abort(job)
        return _error("simulated failure before the first byte", 500)
    config = engine.config
    reply = _Reply(job, gen, pieces, config.model, report_cached_tokens=config.report_cached_tokens)
    if not gen.stream:
        try:
            await waiter.done
        except asyncio.CancelledError:
            engine.abort(job)
            raise
        whole = reply.whole()
        if transfer is not None and transfer.remote_decode:
            assert connector is not None
            held_as = transfer.request_id or job.id
            hold = connector.hold(held_as, engine.core.cache, job.block_hashes)
            whole["kv_transfer_params"] = hold
        return JSONResponse(whole)
    if transfer is not None and transfer.remote_decode and transfer.request_id:
        assert connector is not None  # SGLang's prefill streams too: hold when it is done
        hold_after = (connector, transfer.request_id)
    else:
        hold_after = None
    return StreamingResponse(
        _stream(engine, reply, waiter, hold_after), media_type="text/event-stream"
    )


async def _maybe_pull(
    engine: Engine, connector: Connector, transfer: TransferRequest, job: Job
) -> bool:
    """Pull what the job's prompt lacks here; False when the pull failed and the policy is
    `fail` (with `recompute` the job just prefills locally, as vLLM's policy of that name)."""
    num_local = engine.core.cache.match(job.block_hashes)
    available = await connector.pull(transfer, num_local)
    if available is None:
        return connector.config.kv_load_failure_policy != "fail"
    job.num_external_blocks = available
    return True


async def _stream(
    engine: Engine,
    reply: _Reply,
    waiter: _Waiter,
    hold_after: tuple[Connector, str] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE stream: one event per engine step that produced tokens (see the module
    docstring); the last token's event carries `finish_reason`, as vLLM's does."""
    job, gen = reply.job, reply.gen
    interval = engine.config.stream_interval
    try:
        await waiter.first
        if gen.chat:
            yield reply.chunk(choices=[reply.choice("", None, delta=True)])
        sent = 0
        stall_at = engine.stall_after_tokens
        while sent < gen.max_tokens:
            if stall_at is not None and sent >= stall_at:
                engine.num_stalled += 1
                try:
                    await asyncio.Event().wait()  # stalled: until the client leaves
                finally:
                    engine.num_stalled -= 1
            ready = job.num_generated
            if stall_at is not None:
                ready = min(ready, stall_at)
            if ready - sent >= interval or (job.finish_s is not None and ready > sent):
                finish = "length" if ready >= gen.max_tokens else None
                text = "".join(reply.pieces[sent:ready])
                sent = ready
                yield reply.chunk(choices=[reply.choice(text, finish, delta=True)])
                continue
            waiter.progress.clear()
            await waiter.progress.wait()
        if hold_after is not None:
            hold_after[0].hold(hold_after[1], engine.core.cache, job.block_hashes)
        if gen.include_usage:
            yield reply.chunk(choices=[], usage=reply.usage())
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        engine.abort(job)
        raise
    finally:
        if job.finish_s is None:
            engine.abort(job)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=8100, help="HTTP port")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model name it serves")
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=DEFAULT_CAPACITY_BLOCKS,
        help="KV cache size, in blocks",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV block (vLLM's --block-size)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help="longest prompt + output accepted, in tokens (vLLM's flag)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help="simulated prefill speed",
    )
    add_decode_arguments(parser)
    parser.add_argument(
        "--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="requests decoded together"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run this many times faster than the simulated GPU",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=DEFAULT_STREAM_INTERVAL,
        help="tokens per SSE event (vLLM's flag; 1: every engine step's tokens at once)",
    )
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="ranks behind this port (vLLM's flag)"
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV events JSON, e.g. '{\"enable_kv_cache_events\": true}' (docs/engine.md)",
    )
    parser.add_argument(
        "--cpu-offload-blocks", type=int, default=0, help="write-through CPU tier (0: none)"
    )
    parser.add_argument(
        "--cpu-hit-cost-frac",
        type=float,
        default=DEFAULT_CPU_HIT_COST_FRAC,
        help="a block loaded from the CPU tier costs this fraction of prefilling it",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served as models: name=path or vLLM's JSON form (the path is not read)",
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag)"
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help="adapters resident in a rank's GPU slots at once (vLLM's flag; 0: no limit)",
    )
    parser.add_argument(
        "--lora-load-s",
        type=float,
        default=DEFAULT_LORA_LOAD_S,
        help="seconds a cold adapter load takes on the simulated GPU",
    )
    parser.add_argument(
        "--mm-tokens-per-image",
        type=int,
        default=DEFAULT_TOKENS_PER_IMAGE,
        help="placeholder tokens each image_url part of a chat expands into",
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help='vLLM\'s P/D JSON, e.g. \'{"kv_connector": "NixlConnector", "kv_role": '
        '"kv_producer"}\' (kv_producer | kv_consumer | kv_both; docs/disaggregation.md)',
    )
    parser.add_argument(
        "--kv-pull-gb-per-s",
        type=float,
        default=DEFAULT_PULL_GB_PER_S,
        help="decode role: the simulated KV transfer's bandwidth",
    )
    parser.add_argument(
        "--kv-pull-latency-ms",
        type=float,
        default=DEFAULT_PULL_LATENCY_MS,
        help="decode role: the simulated KV transfer's fixed cost per request",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=DEFAULT_KV_BYTES_PER_TOKEN,
        help="KV cache bytes per token (what a pull moves)",
    )
    parser.add_argument(
        "--kv-abort-timeout-s",
        type=float,
        default=DEFAULT_ABORT_TIMEOUT_S,
        help="prefill role: unread blocks are freed after this (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)",
    )
    parser.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default="null",
        help="SGLang's P/D role (bootstrap_host/port/room; the bootstrap port is --port)",
    )
    parser.add_argument("--fail-first", type=int, default=0, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    timing = TimingModel(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        max_batch=args.max_batch,
        time_scale=args.time_scale,
        cpu_hit_cost_frac=args.cpu_hit_cost_frac,
        **decode_from_args(args),
    )
    kv_events = KVEventsConfig()
    if args.kv_events_config:
        kv_events = parse_kv_events_config(args.kv_events_config)
    transfer_model: dict[str, Any] = {
        "side_channel_host": args.host,
        "side_channel_port": args.port,
        "pull_gb_per_s": args.kv_pull_gb_per_s,
        "pull_latency_ms": args.kv_pull_latency_ms,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "abort_timeout_s": args.kv_abort_timeout_s,
    }
    kv_transfer = None
    if args.kv_transfer_config and args.disaggregation_mode != "null":
        raise ValueError("--kv-transfer-config (vLLM) and --disaggregation-mode (SGLang) exclude")
    if args.kv_transfer_config:
        kv_transfer = parse_kv_transfer_config(args.kv_transfer_config, **transfer_model)
    elif args.disaggregation_mode != "null":
        role = PRODUCER if args.disaggregation_mode == "prefill" else CONSUMER
        kv_transfer = KVTransferConfig(kv_role=role, sglang=True, **transfer_model)
    return EngineConfig(
        model=args.model,
        capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        timing=timing,
        fail_first_bytes=args.fail_first,
        stream_interval=args.stream_interval,
        data_parallel_size=args.data_parallel_size,
        kv_events=kv_events,
        cpu_offload_blocks=args.cpu_offload_blocks,
        lora_modules=tuple(parse_lora_module(m)[0] for m in args.lora_modules),
        max_loras=args.max_loras,
        enable_lora=args.enable_lora,
        lora_load_s=args.lora_load_s,
        runtime_lora_updating=runtime_updating_from_env(),
        mm_tokens_per_image=args.mm_tokens_per_image,
        kv_transfer=kv_transfer,
    )


def serve_engine(args: argparse.Namespace) -> None:
    import uvicorn

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"kvgate engine: {exc}") from None
    app = create_engine_app(config)
    # the gateway's plain log format, so that a terminal running both reads as one log
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info(
        "kvgate engine: serving %s on http://%s:%d, %s",
        config.model,
        args.host,
        args.port,
        describe(config),
    )
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, log_config=None
    )


def describe(config: EngineConfig) -> str:
    """An engine's key settings, for its start-up line."""
    events = config.kv_events
    return (
        f"KV cache {config.capacity_blocks} blocks of {config.block_size} tokens, "
        f"max_model_len {config.max_model_len}, max batch {config.timing.max_batch}, "
        f"time scale {config.timing.time_scale:g}x, data parallel {config.data_parallel_size}, "
        f"KV events {events.endpoint if events.enable_kv_cache_events else 'off'}, "
        f"{describe_transfer(config.kv_transfer)}"
    )
