"""Runs workloads (`loadgen.workloads`) through a target URL and summarises what it measured."""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadgen.client import Result, stream_chat
from loadgen.workloads import Phase, Session


@dataclass
class Summary:
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def summarise(results: list[Result], time_scale: float = 1.0) -> Summary:
    """Hit ratio = engine-reported cached tokens / prompt tokens; TTFT in trace seconds."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.engine_cached_tokens for r in ok)
    ttfts = [r.ttft_s * time_scale for r in ok]
    return Summary(
        requests=len(results),
        errors=len(results) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_ratio=cached / prompt if prompt else 0.0,
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
    )


async def run_phases(
    phases: list[Phase],
    base_url: str,
    api_key: str | None,
    model: str,
    max_tokens: int = 32,
    timeout_s: float = 600.0,
    time_scale: float = 1.0,
) -> list[Result]:
    """Run the phases in order, the sessions of a phase in parallel, each session's steps in
    order; every request carries the session's history including the replies it got. A step's
    `delay_s` is waited (divided by `time_scale`) before it is sent."""
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def run_session(http: aiohttp.ClientSession, session: Session) -> None:
        if session.fork_of is not None:
            history = list(histories[session.fork_of][session.fork_at])
            snapshots = histories.setdefault(session.name, [list(history)])
        elif session.name in histories:
            history = list(histories[session.name][-1]) + session.prefix
            snapshots = histories[session.name]
        else:
            history = list(session.prefix)
            snapshots = histories.setdefault(session.name, [list(history)])
        for step in session.steps:
            if step.delay_s > 0:
                await asyncio.sleep(step.delay_s / time_scale)
            history = history + step.messages
            body = {
                "model": model,
                "messages": history,
                "max_tokens": step.max_tokens or max_tokens,
                "tools": session.tools or None,
            }
            if not session.tools:
                body.pop("tools")
            key = session.key if session.key is not None and api_key is not None else api_key
            result = await stream_chat(http, base_url, key, body, step.label)
            results.append(result)
            if not result.ok:
                return
            history = [*history, {"role": "assistant", "content": result.text}]
            snapshots.append(list(history))

    async with aiohttp.ClientSession(timeout=timeout) as http:
        for phase in phases:
            await asyncio.gather(*(run_session(http, s) for s in phase.sessions))
    return results
