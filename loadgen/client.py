"""One request over the wire, measured: streaming, time to first token, usage.

TTFT is measured on the client with a monotonic clock from sending the request to the first SSE
data event (vLLM sends its first chunk with the first generated token). Works against kvgate,
another router, or an engine directly.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass
class Result:
    label: str
    ok: bool
    status: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine_cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str = ""
    start_s: float = 0.0
    replica: str = ""
    """The engine that answered, where the gateway says (`x-kvgate-replica`, debug headers)."""
    retry_after_s: float | None = None
    """A refusal's Retry-After, in seconds (None: it gave none)."""
    retries: int = 0
    """Answers of "retry later" (429, 503, 529) retried before this result (`overload_retries`)."""


async def stream_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    api_key: str | None,
    body: dict[str, Any],
    label: str = "",
    path: str = "/v1/chat/completions",
    overload_retries: int = 0,
) -> Result:
    """POST a streaming request (usage included) and measure it.

    A pooled connection that the server closed as it was reused (a server's keep-alive timeout
    racing the next request: the server disconnects before any response) is retried once on a
    new connection, as HTTP clients do for that race; the TTFT still counts from the first try.

    `overload_retries`: answers of "retry later" (429, 503, 529) are retried up to this many
    times, as the openai and anthropic SDKs do (2 by default there): after the answer's
    Retry-After when it gives one of at most `MAX_RETRY_AFTER_S`, else after 0.5 s doubling
    (at most 8 s; the SDKs take up to a quarter off at random, this client does not: runs
    repeat). A Retry-After longer than that is not retried. The TTFT counts from the first try.
    """
    start = time.monotonic()
    result = await _stream_once(session, base_url, api_key, body, label, path, start)
    if result.status == 0 and result.error.startswith(_RECONNECTABLE):
        result = await _stream_once(session, base_url, api_key, body, label, path, start)
    retries = 0
    while result.status in RETRY_LATER and retries < overload_retries:
        delay = _retry_delay_s(result.retry_after_s, retries)
        if delay is None:
            break
        await asyncio.sleep(delay)
        retries += 1
        result = await _stream_once(session, base_url, api_key, body, label, path, start)
    result.retries = retries
    return result


_RECONNECTABLE = ("ServerDisconnectedError", "ClientOSError")
RETRY_LATER = frozenset({429, 503, 529})
"""Statuses a client retries after a wait (the SDKs also retry 408, 409 and every 5xx)."""
MAX_RETRY_AFTER_S = 120.0
"""The longest Retry-After the openai SDK waits out (a longer one is not retried)."""


def _retry_delay_s(retry_after_s: float | None, retries: int) -> float | None:
    if retry_after_s is not None and retry_after_s > MAX_RETRY_AFTER_S:
        return None
    if retry_after_s is not None and retry_after_s > 0:
        return retry_after_s
    return min(0.5 * 2.0**retries, 8.0)


async def _stream_once(
    session: aiohttp.ClientSession,
    base_url: str,
    api_key: str | None,
    body: dict[str, Any],
    label: str,
    path: str,
    start: float,
) -> Result:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    result = Result(label, ok=False, start_s=start)
    pieces: list[str] = []
    try:
        async with session.post(
            base_url.rstrip("/") + path, data=orjson.dumps(payload), headers=headers
        ) as resp:
            result.status = resp.status
            result.replica = resp.headers.get("x-kvgate-replica", "")
            if resp.status != 200:
                result.retry_after_s = _seconds(resp.headers.get("retry-after"))
                result.error = (await resp.read())[:300].decode(errors="replace")
                result.latency_s = time.monotonic() - start
                return result
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if not result.ttft_s:
                    result.ttft_s = time.monotonic() - start
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    pieces.append(delta.get("content") or choice.get("text") or "")
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.completion_tokens = usage.get("completion_tokens", 0)
                    result.cached_tokens = details.get("cached_tokens") or 0
                    result.engine_cached_tokens = usage.get(
                        "engine_cached_tokens", result.cached_tokens
                    )
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.latency_s = time.monotonic() - start
        return result
    result.latency_s = time.monotonic() - start
    result.text = "".join(pieces)
    result.ok = True
    return result


def _seconds(header: str | None) -> float | None:
    """A Retry-After of delay seconds (its HTTP-date form is not parsed: None)."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None
