"""The simulated engine replica: looks like vLLM to any router, runs `timing.EngineCore`.

Endpoints (vLLM's, plus the SGLang probes that sglang-router uses):
  GET  /health /ping /v1/models /version /server_info /get_server_info /model_info
       /get_model_info /metrics /get_load /load
  POST /tokenize /detokenize /v1/completions/render /v1/chat/completions/render
       /v1/completions /v1/chat/completions   (SSE when "stream": true)

Prompts are rendered with the model's chat template and tokenized with its BPE
(`loadgen.engine.prompts`, `loadgen.engine.tokenizer`); the prefix cache hashes those token ids.
Generation is deterministic: exactly `max_tokens` tokens (as with vLLM's `ignore_eos`) of the
vocabulary's single-token words, seeded by the prompt, `finish_reason: "length"`.
`usage.prompt_tokens_details.cached_tokens` is always present. `cache_salt` is mixed into block
0 of the prefix cache, as in vLLM.
While streaming, tokens that fall due within one `STREAM_INTERVAL_S` go out as one SSE event.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import mmh3
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

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
    DEFAULT_DECODE_S_PER_TOKEN,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_TOKENS_PER_S,
    FIRST_TOKEN,
    EngineCore,
    Job,
    PrefixCache,
    TimingModel,
)
from loadgen.engine.tokenizer import MODEL_DIR, block_hashes, default_tokenizer

DEFAULT_MODEL = "kvgate-sim-8b"
DEFAULT_MAX_MODEL_LEN = 131_072
DEFAULT_CHAT_MAX_TOKENS = 64
DEFAULT_COMPLETION_MAX_TOKENS = 16
STREAM_INTERVAL_S = 0.005
VLLM_VERSION = "0.11.0"


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


def _error(message: str, status: int) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class Engine:
    """One simulated replica: the scheduler, its asyncio driver, and counters for /metrics."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config.timing, PrefixCache(config.capacity_blocks))
        self.prompts = RenderedPrompts()
        self.start_time = time.time()
        self.num_failures_left = config.fail_first_bytes
        self._waiters: dict[str, tuple[asyncio.Future[None], asyncio.Future[None]]] = {}
        self._wakeup: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.last_traceparent: str | None = None
        """The W3C `traceparent` of the last generation request (vLLM continues it when it
        traces): lets a test see what a router passed on."""

    # -- driver ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._driver = asyncio.create_task(self._drive())

    async def stop(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
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
                first, done = self._waiters.get(job.id, (None, None))
                target = first if kind == FIRST_TOKEN else done
                if target is not None and not target.done():
                    target.set_result(None)
                if kind != FIRST_TOKEN:
                    self._waiters.pop(job.id, None)

    def submit(self, job: Job) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        futures = (loop.create_future(), loop.create_future())
        self._waiters[job.id] = futures
        self.core.submit(loop.time(), job)
        assert self._wakeup is not None
        self._wakeup.set()
        return futures

    def abort(self, job: Job) -> None:
        self.core.abort(asyncio.get_running_loop().time(), job)
        self._waiters.pop(job.id, None)
        assert self._wakeup is not None
        self._wakeup.set()

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
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Any]:
        e, core = self.engine, self.engine.core
        labels = ["model_name", "engine"]
        values = [e.config.model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        usage = len(core.cache) / core.cache.capacity_blocks
        yield gauge("vllm:num_requests_running", "Requests in the batch.", core.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests queued.", core.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV cache usage (deprecated name).", usage)
        c = core.counters
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up.", c.prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found cached.", c.cached_tokens)
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", c.generation_tokens)
        yield counter("vllm:request_success", "Requests finished.", c.requests_finished)
        yield counter("vllm:num_preemptions", "Preemptions (never, here).", 0)
        yield gauge("process_start_time_seconds", "Start time (Unix s).", e.start_time)


# -- the app ------------------------------------------------------------------------------
def create_engine_app(config: EngineConfig | None = None) -> Starlette:
    config = config or EngineConfig()
    engine = Engine(config)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))

    def model_card() -> dict[str, Any]:
        return {
            "id": config.model,
            "object": "model",
            "created": int(engine.start_time),
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
        }

    local_tokenizer = str(MODEL_DIR)  # a Hugging Face tokenizer directory: routers load it

    def server_info() -> dict[str, Any]:
        t = config.timing
        return {
            "model_path": local_tokenizer,
            "tokenizer_path": local_tokenizer,
            "served_model_name": config.model,
            "version": VLLM_VERSION,
            "start_time": engine.start_time,
            "max_model_len": config.max_model_len,
            "block_size": config.block_size,
            "num_gpu_blocks": config.capacity_blocks,
            "max_num_seqs": t.max_batch,
            "max_running_requests": t.max_batch,
            "prefill_tokens_per_s": t.prefill_tokens_per_s,
            "decode_s_per_token": t.decode_s_per_token,
            "time_scale": t.time_scale,
        }

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def info(request: Request) -> Response:
        return JSONResponse(server_info())

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": local_tokenizer,
                "tokenizer_path": local_tokenizer,
                "served_model_name": config.model,
                "is_generation": True,
            }
        )

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def get_load(request: Request) -> Response:
        return JSONResponse({"load": engine.core.num_running + engine.core.num_waiting})

    async def load(request: Request) -> Response:
        return JSONResponse({"server_load": engine.core.num_running + engine.core.num_waiting})

    async def tokenize_endpoint(request: Request) -> Response:
        try:
            body = await _json_body(request)
            return JSONResponse(tokenize_response(body, config.max_model_len, engine.prompts))
        except BadRequest as exc:
            return _error(str(exc), exc.status)

    async def detokenize(request: Request) -> Response:
        try:
            return JSONResponse(detokenize_response(await _json_body(request)))
        except BadRequest as exc:
            return _error(str(exc), exc.status)

    def render(chat: bool) -> Any:
        async def handler(request: Request) -> Response:
            try:
                body = await _json_body(request)
                return JSONResponse(render_response(body, chat, config.model, engine.prompts))
            except BadRequest as exc:
                return _error(str(exc), exc.status)

        return handler

    def generate(chat: bool) -> Any:
        async def handler(request: Request) -> Response:
            try:
                body = await _json_body(request)
                return await _generate(engine, body, chat, request)
            except BadRequest as exc:
                return _error(str(exc), exc.status)

        return handler

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    routes = [
        Route("/health", health),
        Route("/ping", health),
        Route("/v1/models", models),
        Route("/version", version),
        Route("/server_info", info),
        Route("/get_server_info", info),
        Route("/model_info", model_info),
        Route("/get_model_info", model_info),
        Route("/metrics", metrics),
        Route("/get_load", get_load),
        Route("/load", load),
        Route("/tokenize", tokenize_endpoint, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions/render", render(chat=False), methods=["POST"]),
        Route("/v1/chat/completions/render", render(chat=True), methods=["POST"]),
        Route("/v1/completions", generate(chat=False), methods=["POST"]),
        Route("/v1/chat/completions", generate(chat=True), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    return app


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _generate(engine: Engine, body: dict[str, Any], chat: bool, request: Request) -> Response:
    config = engine.config
    engine.last_traceparent = request.headers.get("traceparent")
    model = body.get("model")
    if model is not None and model != config.model:
        raise BadRequest(f"The model `{model}` does not exist.", status=404)
    tokens = engine.prompts.ids(body, chat)
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _int_field(body, "max_completion_tokens", 0, 1) if chat else 0
    max_tokens = max_tokens or _int_field(body, "max_tokens", default_max, 1)
    if _int_field(body, "n", 1, 1) != 1:
        raise BadRequest("only n=1 is supported")
    if len(tokens) + max_tokens > config.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the messages, "
            f"{max_tokens} in the completion)."
        )
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    failing = engine.num_failures_left > 0
    if failing:
        engine.num_failures_left -= 1

    hashes = block_hashes(tokens, config.block_size, salt)
    max_cached = (len(tokens) - 1) // config.block_size * config.block_size
    seed = mmh3.hash(hashes[-1] if hashes else repr(list(tokens[-8:])).encode(), signed=False)
    output = default_tokenizer().output_ids(seed, max_tokens)
    pieces = default_tokenizer().pieces(output)
    final = block_hashes([*tokens, *output], config.block_size, salt, resume=hashes)
    job = Job(
        id=engine.next_id("chatcmpl" if chat else "cmpl"),
        block_hashes=hashes,
        num_prompt_tokens=len(tokens),
        num_output_tokens=max_tokens,
        block_size=config.block_size,
        max_cached_tokens=max(max_cached, 0),
        final_hashes=final,
    )
    created = int(time.time())
    first, done = engine.submit(job)
    if failing:  # the engine dies during the prefill: nothing is cached, the client gets a 500
        job.block_hashes, job.final_hashes = (), ()
        await first
        engine.abort(job)
        return _error("simulated failure before the first byte", 500)

    def usage() -> dict[str, Any]:
        return {
            "prompt_tokens": job.num_prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": job.num_prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
        }

    def choice(text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if not chat:
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

    obj = "chat.completion" if chat else "text_completion"
    if not stream:
        try:
            await done
        except asyncio.CancelledError:
            engine.abort(job)
            raise
        return JSONResponse(
            {
                "id": job.id,
                "object": obj,
                "created": created,
                "model": config.model,
                "choices": [choice("".join(pieces), "length", delta=False)],
                "usage": usage(),
            }
        )

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    step = config.timing.decode_s_per_token / config.timing.time_scale

    async def events() -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        try:
            await first
            assert job.first_token_s is not None
            head = {"id": job.id, "object": chunk_obj, "created": created, "model": config.model}
            if chat:
                yield _sse({**head, "choices": [choice("", None, delta=True)]})
            sent = 0
            while sent < max_tokens:
                due = job.first_token_s + sent * step
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(max(wait, STREAM_INTERVAL_S))
                now = loop.time()
                upto = max_tokens if step == 0 else int((now - job.first_token_s) / step) + 1
                upto = min(max(upto, sent + 1), max_tokens)
                text = "".join(pieces[sent:upto])
                sent = upto
                yield _sse({**head, "choices": [choice(text, None, delta=True)]})
            yield _sse({**head, "choices": [choice("", "length", delta=True)]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage()})
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            engine.abort(job)
            raise
        finally:
            if job.finish_s is None or job.finish_s > loop.time():
                engine.abort(job)

    return StreamingResponse(events(), media_type="text/event-stream")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--capacity-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_PREFILL_TOKENS_PER_S)
    parser.add_argument(
        "--decode-ms-per-token", type=float, default=DEFAULT_DECODE_S_PER_TOKEN * 1e3
    )
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--fail-first", type=int, default=0, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    timing = TimingModel(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_s_per_token=args.decode_ms_per_token / 1e3,
        max_batch=args.max_batch,
        time_scale=args.time_scale,
    )
    return EngineConfig(
        model=args.model,
        capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        timing=timing,
        fail_first_bytes=args.fail_first,
    )


def serve_engine(args: argparse.Namespace) -> None:
    import uvicorn

    app = create_engine_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
