"""The simulated engine replica: looks like vLLM to any router, runs `timing.EngineCore`.

Endpoints (vLLM's, plus the SGLang probes that sglang-router uses):
  GET  /health /ping /v1/models /version /server_info /get_server_info /model_info
       /get_model_info /metrics /get_load /load
  POST /tokenize /detokenize /v1/completions/render /v1/chat/completions/render
       /v1/completions /v1/chat/completions   (SSE when "stream": true)

Generation is deterministic: exactly `max_tokens` tokens (as with vLLM's `ignore_eos`) of words
seeded by the prompt, `finish_reason: "length"`. `usage.prompt_tokens_details.cached_tokens`
is always present. `cache_salt` is mixed into block 0 of the prefix cache, as in vLLM.
While streaming, tokens that fall due within one `STREAM_INTERVAL_S` go out as one SSE event.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import os
import re
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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

from cachemap.rendering import render_chat
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
from loadgen.engine.tokenizer import block_hashes, output_tokens, token_ids, tokenize

DEFAULT_MODEL = "kvgate-sim-8b"
DEFAULT_MAX_MODEL_LEN = 131_072
DEFAULT_CHAT_MAX_TOKENS = 64
DEFAULT_COMPLETION_MAX_TOKENS = 16
STREAM_INTERVAL_S = 0.005
VLLM_VERSION = "0.11.0"

_TOKENIZER_STAND_IN: dict[str, Any] = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"},
}


def tokenizer_dir(model: str) -> str:
    """A local directory with a `tokenizer.json` stand-in, reported as the engine's
    `model_path` / `tokenizer_path`.

    sglang-router loads a tokenizer for every worker's model when it registers it, from the
    worker's `model_path`; a model name that is not a local directory makes it try the Hugging
    Face hub. Routing over HTTP never uses that tokenizer, so a minimal valid one (a WordLevel
    model in the `tokenizers` JSON format, NOT the engine's tokenizer) keeps it local.
    """
    path = Path(tempfile.gettempdir()) / ("kvgate-sim-tokenizer-" + re.sub(r"\W", "_", model))
    target = path / "tokenizer.json"
    if not target.exists():
        path.mkdir(parents=True, exist_ok=True)
        scratch = path / f"tokenizer.{os.getpid()}.tmp"
        scratch.write_bytes(orjson.dumps(_TOKENIZER_STAND_IN))
        os.replace(scratch, target)
    return str(path)


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
    hang_first_bytes: int = 0
    """Test hook: this many generation requests are accepted and never answered — not a header,
    not a byte — until the client leaves (a hung engine)."""
    stall_after_tokens: int | None = None
    """Test hook: every streamed answer stops sending after this many tokens, its connection
    open, until the client leaves (an engine stalled mid-stream)."""


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class Engine:
    """One simulated replica: the scheduler, its asyncio driver, and counters for /metrics."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config.timing, PrefixCache(config.capacity_blocks))
        self.start_time = time.time()
        self.num_failures_left = config.fail_first_bytes
        self.num_hangs_left = config.hang_first_bytes
        self.stall_after_tokens = config.stall_after_tokens
        self.num_stalled = 0
        """Streams stalled right now (`stall_after_tokens`) whose client has not left."""
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
_TOKENIZED_PROMPTS = 256
"""Prompts whose tokens are kept: a router that renders a request on every worker (vllm-router's
cache_aware) makes the same text arrive N + 1 times; the simulator's own tokenizer cost (~10 ms
for 15k tokens in Python) must not be what a benchmark measures. Kept per `cache_salt`: a prompt
tokenized for one tenant must not come back faster for another (the timing audit finds that)."""


@functools.lru_cache(maxsize=_TOKENIZED_PROMPTS)
def _tokenize_cached(text: str, salt: str | None = None) -> tuple[str, ...]:
    return tuple(tokenize(text))


@functools.lru_cache(maxsize=_TOKENIZED_PROMPTS)
def _ids_cached(text: str) -> tuple[int, ...]:
    return tuple(token_ids(_tokenize_cached(text)))


def _prompt_text(body: dict[str, Any], chat: bool) -> str | list[int]:
    """The text the engine tokenizes (chat: the canonical rendering), or a token-id prompt."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each message must be an object")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("'tools' must be a list")
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        try:
            return render_chat(messages, tools, add_generation_prompt)
        except (AttributeError, TypeError) as exc:
            raise BadRequest(f"malformed messages: {exc}") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    raise BadRequest("'prompt' must be a string or a list of token ids")


def _prompt_tokens(body: dict[str, Any], chat: bool) -> Sequence[str] | Sequence[int]:
    """The prompt's tokens (token ids for a token-id prompt); never mutate the result."""
    text = _prompt_text(body, chat)
    salt = body.get("cache_salt")
    if isinstance(text, str):
        return _tokenize_cached(text, salt if isinstance(salt, str) else None)
    return text


def _prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
    text = _prompt_text(body, chat)
    return list(_ids_cached(text)) if isinstance(text, str) else text


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

    local_tokenizer = tokenizer_dir(config.model)

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
            ids = _prompt_ids(body, chat="messages" in body)
        except BadRequest as exc:
            return _error(str(exc), exc.status)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def detokenize(request: Request) -> Response:
        return JSONResponse({"prompt": ""})

    def render(chat: bool) -> Any:
        async def handler(request: Request) -> Response:
            try:
                body = await _json_body(request)
                ids = _prompt_ids(body, chat=chat)
            except BadRequest as exc:
                return _error(str(exc), exc.status)
            return JSONResponse({"token_ids": ids, "model": body.get("model", config.model)})

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
    tokens = _prompt_tokens(body, chat)
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
    if engine.num_hangs_left > 0:  # hung: nothing is sent until the client gives up
        engine.num_hangs_left -= 1
        while (await request.receive())["type"] != "http.disconnect":
            pass
        return Response(status_code=499)

    hashes = block_hashes(tokens, config.block_size, salt)
    max_cached = (len(tokens) - 1) // config.block_size * config.block_size
    seed = mmh3.hash(hashes[-1] if hashes else repr(list(tokens[-8:])).encode(), signed=False)
    pieces = output_tokens(seed, max_tokens)
    final: list[bytes] = []
    if tokens and isinstance(tokens[0], str):
        final = block_hashes([*tokens, *pieces], config.block_size, salt, resume=hashes)
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
            stall_at = engine.stall_after_tokens
            while sent < max_tokens:
                if stall_at is not None and sent >= stall_at:
                    engine.num_stalled += 1
                    try:
                        await asyncio.Event().wait()  # stalled: until the client leaves
                    finally:
                        engine.num_stalled -= 1
                due = job.first_token_s + sent * step
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(max(wait, STREAM_INTERVAL_S))
                now = loop.time()
                upto = max_tokens if step == 0 else int((now - job.first_token_s) / step) + 1
                upto = min(max(upto, sent + 1), max_tokens)
                if stall_at is not None and sent < stall_at:
                    upto = min(upto, stall_at)
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
