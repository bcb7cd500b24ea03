"""An engine SIGKILLed while streams run on it, then restarted on its port (empty cache).

Conversations are placed first (one turn each); the engine holding most of them is the victim.
Half of them then stream their next turn; once a stream on the victim has had tokens the
victim is SIGKILLed, and each of that half sends one more turn at once (they find the victim's
entries, its port refusing). Goals, from the client's side: no request failed (those that had
not started streaming are retried elsewhere), every stream cut mid-body ends with the clean
`upstream_stream_broken` error event and `[DONE]`. Then the victim restarts, and the quiet
half (whose prefixes only the victim's past life held) repeat their first turn as soon as the
gateway counts it healthy: none may be routed by entries of that past life (sent to the victim
with matched blocks > 0 while the engine itself reports no cached tokens).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from loadgen.chaos.billed import KEY
from loadgen.chaos.outcome import Outcome, Size, wait_for
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.text import words

SLOW = ["--decode-ms-per-token", "20"]
"""100 tokens take 2 s: streams are still running when the engine dies."""
HEADERS = {"authorization": f"Bearer {KEY}"}


@dataclass
class Streamed:
    outcome: str
    """ok, clean (a mid-stream cut with the clean error), failed."""
    replica: str = ""
    matched: int = 0
    cached: int = 0


def _messages(c: int, turn: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": words(f"engine-kill/c{c}/sys", 400)},
        {"role": "user", "content": words(f"engine-kill/c{c}/turn{turn}", 40)},
    ]


async def _stream(
    http: httpx.AsyncClient,
    url: str,
    c: int,
    turn: int,
    max_tokens: int,
    started: asyncio.Event,
    watched: str = "",
) -> Streamed:
    """One streamed turn; `started` is set once a stream served by `watched` has had tokens."""
    body = {"model": DEFAULT_MODEL, "messages": _messages(c, turn), "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events: list[bytes] = []
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            replica = r.headers.get("x-kvgate-replica", "")
            matched = int(r.headers.get("x-kvgate-matched-blocks", 0))
            if r.status_code != 200:
                return Streamed("failed", replica)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:].encode())
                    if len(events) == 2 and replica == watched:
                        started.set()  # tokens are flowing on the victim
    except httpx.HTTPError:
        return Streamed("failed")
    return _judge(events, replica, matched)


def _judge(events: list[bytes], replica: str, matched: int) -> Streamed:
    if not events or events[-1] != b"[DONE]":
        return Streamed("failed", replica, matched)
    chunks = [orjson.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        clean = len(errors) == 1 and errors[0].get("code") == "upstream_stream_broken"
        return Streamed("clean" if clean and len(chunks) > 1 else "failed", replica, matched)
    usage: dict[str, Any] = next((c["usage"] for c in chunks if c.get("usage")), {})
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Streamed("ok", replica, matched, cached)


async def _turns(url: str, convs: range, turn: int, max_tokens: int) -> list[Streamed]:
    async with httpx.AsyncClient(headers=HEADERS, timeout=60) as http:
        never = asyncio.Event()
        return list(await asyncio.gather(*(_stream(http, url, c, turn, max_tokens, never)
                                           for c in convs)))  # fmt: skip


async def _under_kill(url: str, convs: range, victim: processes.Proc) -> list[Streamed]:
    """Every conversation's turn 1 streaming; the victim killed once one of its streams has
    had tokens; every conversation's turn 2 sent right after the kill."""
    async with httpx.AsyncClient(headers=HEADERS, timeout=60) as http:
        flowing = asyncio.Event()
        running = [
            asyncio.create_task(_stream(http, url, c, 1, 100, flowing, victim.url)) for c in convs
        ]
        await asyncio.wait_for(flowing.wait(), 60)
        victim.popen.kill()  # SIGKILL, by pid
        victim.popen.wait(timeout=10)
        never = asyncio.Event()
        late = [asyncio.create_task(_stream(http, url, c, 2, 8, never)) for c in convs]
        return list(await asyncio.gather(*running, *late))


def run(size: Size) -> Outcome:
    n = size.pick(6, 24)
    convs, quiet = range(n), range(n, 2 * n)
    env = {"KVGATE_DEBUG_HEADERS": "true"}
    with processes.engines(3, SLOW) as engines:
        gateway = processes.start_gateway(
            processes.free_port(), [e.url for e in engines],
            ["--tenant", f"acme:{KEY}", "--log-level", "error"], env=env,
        )  # fmt: skip
        try:
            processes.wait_ready(gateway.url, "/readyz", gateway.popen, processes.STARTUP_TIMEOUT_S)
            placed = asyncio.run(_turns(gateway.url, range(2 * n), 0, 2))
            # the victim: the home of most conversations that stream under the kill
            homes = Counter(s.replica for s in placed[:n] if s.outcome == "ok")
            victim = next(e for e in engines if e.url == homes.most_common(1)[0][0])
            killed = asyncio.run(_under_kill(gateway.url, convs, victim))
            port = int(victim.url.rsplit(":", 1)[1])
            reborn = processes.start_engine(port, SLOW)
            engines.append(reborn)  # stopped with the others
            processes.wait_ready(reborn.url, "/health", reborn.popen, processes.STARTUP_TIMEOUT_S)
            wait_for(lambda: _healthy(gateway, victim.url), 30, "the restarted engine healthy")
            after = asyncio.run(_turns(gateway.url, quiet, 0, 2))
        finally:
            processes.stop([gateway])
    return _outcome(placed, killed, after, victim.url)


def _healthy(gateway: processes.Proc, replica: str) -> bool:
    """The gateway routes to `replica` again (its /metrics say so)."""
    text = httpx.get(f"{gateway.metrics_url}/metrics", timeout=5).text
    return f'kvgate_replica_healthy{{replica="{replica}"}} 1.0' in text


def _outcome(
    placed: list[Streamed], killed: list[Streamed], after: list[Streamed], victim: str
) -> Outcome:
    out = Outcome("engine-killed")
    n = len(killed)
    failed = sum(1 for s in [*placed, *killed, *after] if s.outcome == "failed")
    out.goal("failed requests", failed == 0, f"{failed} of {len(placed) + n + len(after)}")
    cut = sum(1 for s in killed if s.outcome == "clean")
    out.goal("streams cut mid-body with the clean error", cut > 0, f"{cut} of {n} under the kill")
    homes = {i: s.replica for i, s in enumerate(placed[len(placed) - len(after) :])}
    stale = sum(1 for s in after if s.replica == victim and s.matched > 0 and s.cached == 0)
    on_victim = sum(1 for i, s in enumerate(after) if homes.get(i) == victim)
    figure = f"{stale} ({on_victim} of {len(after)} quiet conversations were the victim's)"
    out.goal("routed by the dead engine's entries", stale == 0, figure)
    out.figures["quiet conversations sent to the restarted engine"] = sum(
        1 for s in after if s.replica == victim
    )
    out.figures["retried elsewhere (turn 2 sent after the kill)"] = sum(
        1 for s in killed[n // 2 :] if s.outcome == "ok" and s.replica != victim
    )
    return out
