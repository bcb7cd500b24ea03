"""A stand-in engine that answers at once: what `kvgate bench`'s max-rate steps put behind every
router, so the router, not the engines, is what saturates.

One process serves every port (`python -m loadgen.bench.fast_engine --port P ...`), each port
one replica that looks like vLLM to a router: `/health`, `/v1/models`, the info and load
endpoints sglang-router and vllm-router ask for, a vLLM-shaped `/metrics` (`loadgen.bench.idle`'s
page, honouring `name[]`), `/tokenize` and the `/render` endpoints (vllm-router's cache_aware
asks for token ids), and `/v1/chat/completions` / `/v1/completions`.

A generation costs no simulated time: the answer is `max_tokens` one-token SSE events (one
write each, as vLLM streams per engine step, so a router relays a stream, not one blob), a
usage event when `stream_options.include_usage` asks, then `[DONE]`. No tokenizer: the prompt
token count is the body's length / `BYTES_PER_TOKEN`, and the token ids the render endpoints
return are bytes of the prompt text (cheap, and a continuation's ids extend its prefix's, as
real ones do). Each replica keeps a prefix cache without eviction (`PrefixCache`) and reports
the prompt's cached part in `prompt_tokens_details.cached_tokens`, as vLLM does: a gateway that
checks its predictions against the engines' usage (kvgate's reconciler) reads an answer it
predicted a cached prefix for as an engine that remembers, not as one that restarted. Unknown
paths are 404 and counted (`GET /stand-in/unknown`), so a peer asking for something new is
visible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from loadgen.bench.idle import metrics_page
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes

BYTES_PER_TOKEN = 4
"""English text and JSON average ~4 bytes per BPE token: only the usage figures depend on it."""
MAX_MODEL_LEN = 131072
TOKEN_TEXT = " tok"
VERSION = "0.0.0-stand-in"
_PAGE = metrics_page()
CACHE_CHUNK_BYTES = 256
"""The stand-ins' cache block: the prompt text in whole chunks of this many bytes (kvgate's
directory blocks are 256 bytes of its rendering: a shared prefix reads within a chunk of the
gateway's prediction, inside its reconciler's slack)."""
CACHE_MAX_ENTRIES = 1 << 20
"""Chunks a replica's cache holds before it starts again (~100 MB over four replicas)."""


class PrefixCache:
    """Each replica's prompt prefixes, as chained hashes of whole `chunk_bytes` chunks of the
    prompt text; `cached_bytes` answers how much of a prompt was there and adds it. No
    eviction but a clear past `max_entries` (the stand-ins are an ideal engine)."""

    def __init__(
        self, chunk_bytes: int = CACHE_CHUNK_BYTES, max_entries: int = CACHE_MAX_ENTRIES
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.max_entries = max_entries
        self._seen: dict[str, set[int]] = {}

    def cached_bytes(self, replica: str, data: bytes) -> int:
        seen = self._seen.setdefault(replica, set())
        n = self.chunk_bytes
        chained, cached, hit = 0, 0, True
        for start in range(0, len(data) - n + 1, n):
            chained = hash((chained, data[start : start + n]))
            if hit and chained in seen:
                cached = start + n
                continue
            hit = False
            if len(seen) >= self.max_entries:
                seen.clear()
            seen.add(chained)
        return cached


def _prompt_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else str(prompt or "")


def _token_ids(body: dict[str, Any]) -> list[int]:
    return list(_prompt_text(body).encode()[::BYTES_PER_TOKEN])


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _json(payload: Any) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.Response:
    names = request.query.getall("name[]", [])
    return web.Response(body=metrics_page(names) if names else _PAGE, content_type="text/plain")


async def _tokenize(request: web.Request) -> web.Response:
    ids = _token_ids(orjson.loads(await request.read()))
    return _json({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids})


async def _render(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    generate = {
        "request_id": body.get("request_id") or uuid.uuid4().hex,
        "token_ids": _token_ids(body),
        "features": None,
        "sampling_params": {"max_tokens": body.get("max_tokens"), "n": 1},
        "model": body.get("model") or DEFAULT_MODEL,
        "stream": body.get("stream") is True,
        "stream_options": body.get("stream_options"),
        "cache_salt": body.get("cache_salt"),
        "priority": 0,
        "kv_transfer_params": None,
    }
    return _json(generate if request.path.startswith("/v1/chat") else [generate])


async def _generate(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = orjson.loads(raw)
    chat = request.path.startswith("/v1/chat")
    num_tokens = max(int(body.get("max_tokens") or body.get("max_completion_tokens") or 1), 1)
    prompt_tokens = len(raw) // BYTES_PER_TOKEN
    prompt = _prompt_text(body).encode()
    cached = request.app[CACHE_KEY].cached_bytes(request.host, prompt)
    cached = cached * prompt_tokens // max(len(prompt), 1)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": num_tokens,
        "total_tokens": prompt_tokens + num_tokens,
        "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)},
    }
    head: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": DEFAULT_MODEL,
    }
    if body.get("stream") is not True:
        text = TOKEN_TEXT * num_tokens
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        kind = "chat.completion" if chat else "text_completion"
        return _json({**head, "object": kind, "choices": [choice], "usage": usage})
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i in range(num_tokens):
        part: dict[str, Any] = {
            "index": 0,
            "finish_reason": "length" if i == num_tokens - 1 else None,
        }
        if chat:
            part["delta"] = {"content": TOKEN_TEXT} | ({"role": "assistant"} if i == 0 else {})
        else:
            part["text"] = TOKEN_TEXT
        await response.write(_event({**head, "choices": [part]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(_event({**head, "choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


CACHE_KEY = web.AppKey("prefix_cache", PrefixCache)


def fast_engine_app(unknown: Counter[str]) -> web.Application:
    """Every replica's routes; `unknown` counts the requests for paths it does not serve."""
    card = {
        "id": DEFAULT_MODEL,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": DEFAULT_MODEL,
        "parent": None,
        "max_model_len": MAX_MODEL_LEN,
    }
    info = {
        "model_path": DEFAULT_MODEL,
        "tokenizer_path": DEFAULT_MODEL,
        "served_model_name": DEFAULT_MODEL,
        "is_generation": True,
        "max_model_len": MAX_MODEL_LEN,
        "version": VERSION,
    }

    async def counted(request: web.Request) -> web.Response:
        unknown[f"{request.method} {request.path}"] += 1
        return web.Response(status=404)

    async def unknown_paths(_: web.Request) -> web.Response:
        return _json(dict(unknown))

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CACHE_KEY] = PrefixCache()
    for path in ("/health", "/ping"):
        app.router.add_get(path, _ok)
    app.router.add_get("/v1/models", _fixed({"object": "list", "data": [card]}))
    app.router.add_get("/version", _fixed({"version": VERSION}))
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, _fixed(info))
    for path in ("/load", "/get_load"):
        app.router.add_get(path, _fixed({"load": 0, "server_load": 0}))
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/v1/chat/completions/render", _render)
    app.router.add_post("/v1/completions/render", _render)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_post("/v1/completions", _generate)
    app.router.add_get("/stand-in/unknown", unknown_paths)
    app.router.add_route("*", "/{path:.*}", counted)
    return app


def _fixed(payload: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A GET handler answering `payload` as JSON, serialised once."""
    body = orjson.dumps(payload)

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return handler


@dataclass
class FastEngines:
    urls: list[str]
    pid: int


@contextlib.contextmanager
def fast_engines(num: int) -> Iterator[FastEngines]:
    """`num` stand-in replicas on free loopback ports, one subprocess serving them all."""
    ports = [processes.free_port() for _ in range(num)]
    command = [sys.executable, "-m", "loadgen.bench.fast_engine"]
    popen = subprocess.Popen([*command, *(a for p in ports for a in ("--port", str(p)))])
    procs = [processes.Proc(f"fast-engine:{p}", f"http://127.0.0.1:{p}", popen) for p in ports]
    try:
        for proc in procs:
            processes.wait_ready(proc.url, "/health", popen, processes.STARTUP_TIMEOUT_S)
        yield FastEngines([p.url for p in procs], popen.pid)
    finally:
        processes.stop(procs[:1])


async def serve(ports: list[int]) -> None:
    # vllm-router opens each worker with an HTTP/2 preface first (is it gRPC?) and falls back to
    # HTTP/1.1; aiohttp logs every such 400 with its traceback
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    runner = web.AppRunner(fast_engine_app(Counter()), access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()  # until terminated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, action="append", required=True, help="one per replica")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.port))
    except ImportError:  # pragma: no cover - uvloop is installed with the gateway
        asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
