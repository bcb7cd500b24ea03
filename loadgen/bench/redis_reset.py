"""Redis killed and back empty under conversations: the dip in hit ratio, measured live
(`kvgate bench-redis-reset`; issue 14, item 21).

Simulated engines and one gateway with a shared directory (all subprocesses on loopback), a
private redis-server on a free port. `--conversations` conversations take turns round by round
(`--concurrency` at a time); after `--rounds-before` rounds Redis is killed (SIGKILL), one round
runs while it is away, then it is restarted empty and `--rounds-after` rounds follow at once.
Printed: failures; the hit ratio (the engines' cached / prompt tokens) of the warm rounds before
(the first round, all misses, is left out), during the outage, in the first `--window-s` after
the restart and later; and how many conversations changed replica on their first turn after
it. `--gateway-tree DIR` (repeatable) runs another
checkout's gateway the same way, in the same run, to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.harness.redis_servers import redis_server
from loadgen.text import words

KEY = "sk-bench"
MAX_ROUNDS = 50
"""A bound on the loop, whatever the arguments."""


def add_bench_redis_reset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=4, help="simulated engine replicas")
    parser.add_argument("--conversations", type=int, default=20, help="conversations replayed")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--rounds-before", type=int, default=3, help="rounds before Redis is reset")
    parser.add_argument("--rounds-after", type=int, default=8, help="rounds after it is back empty")
    parser.add_argument("--window-s", type=float, default=2.0, help="the dip's window")
    parser.add_argument(
        "--system-words", type=int, default=600, help="words of each conversation's system prompt"
    )
    parser.add_argument("--time-scale", type=float, default=10.0, help="engines' speed-up")
    parser.add_argument(
        "--wait-back",
        action="store_true",
        help="after the restart, wait until the gateway routes on Redis again (its /metrics "
        "kvgate_directory_degraded 0) before the rounds after: the empty Redis alone",
    )
    parser.add_argument(
        "--gateway-tree",
        action="append",
        type=Path,
        default=[],
        help="also run the gateway of another checkout (a directory of the repository)",
    )


@dataclass
class Turn:
    conversation: int
    phase: str
    finished_s: float
    ok: bool
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Conversation:
    index: int
    messages: list[dict[str, Any]] = field(default_factory=list)


def open_conversations(n: int, system_words: int, tag: str = "reset") -> list[Conversation]:
    """`n` conversations, each a system prompt of its own and a first task."""
    return [
        Conversation(
            i,
            [
                {"role": "system", "content": words(f"{tag}/c{i}/sys", system_words)},
                {"role": "user", "content": words(f"{tag}/c{i}/task", 100)},
            ],
        )
        for i in range(n)
    ]


async def _turn(
    http: httpx.AsyncClient, url: str, conversation: Conversation, phase: str, n: int
) -> Turn:
    body = {"model": DEFAULT_MODEL, "messages": conversation.messages, "max_tokens": 4}
    try:
        response = await http.post(
            url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEY}"},
        )
    except httpx.HTTPError:
        return Turn(conversation.index, phase, time.monotonic(), False)
    if response.status_code != 200:
        return Turn(conversation.index, phase, time.monotonic(), False)
    reply = response.json()
    usage = reply.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    conversation.messages += [
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
        {"role": "user", "content": words(f"c{conversation.index}/turn{n}", 80)},
    ]
    return Turn(
        conversation.index,
        phase,
        time.monotonic(),
        True,
        response.headers.get("x-kvgate-replica", ""),
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0),
    )


async def play_round(
    url: str, conversations: list[Conversation], phase: str, n: int, concurrency: int
) -> list[Turn]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(c: Conversation) -> Turn:
            async with limit:
                return await _turn(http, url, c, phase, n)

        return list(await asyncio.gather(*(one(c) for c in conversations)))


def run_arm(args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    """One gateway build through the whole scenario; its figures."""
    engine_args = ["--time-scale", str(args.time_scale), "--max-batch", "256"]
    env = {"KVGATE_REDIS_DEADLINE_S": "0.05", "KVGATE_DEBUG_HEADERS": "true"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    serve = ["--tenant", f"bench:{KEY}", "--log-level", "warning"]
    conversations = open_conversations(args.conversations, args.system_words)
    turns: list[Turn] = []
    with (
        redis_server(port=0) as redis,
        processes.engines(args.engines, engine_args) as engines,
    ):
        proc = processes.start_gateway(
            processes.free_port(),
            [e.url for e in engines],
            [*serve, "--redis-url", redis.url],
            env=env,
            cwd=str(tree) if tree is not None else None,
        )
        try:
            processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
            turns += asyncio.run(play_round(proc.url, conversations, "cold", 0, args.concurrency))
            n = 1
            for _ in range(min(args.rounds_before, MAX_ROUNDS)):
                turns += asyncio.run(
                    play_round(proc.url, conversations, "before", n, args.concurrency)
                )
                n += 1
            redis.stop()  # SIGKILL
            turns += asyncio.run(play_round(proc.url, conversations, "outage", n, args.concurrency))
            n += 1
            redis.start()  # empty: no persistence
            if args.wait_back:
                wait_back(proc.metrics_url or proc.url)
            restarted = time.monotonic()
            for _ in range(min(args.rounds_after, MAX_ROUNDS)):
                turns += asyncio.run(
                    play_round(proc.url, conversations, "after", n, args.concurrency)
                )
                n += 1
        finally:
            processes.stop([proc])
    return _figures(turns, restarted, args.window_s)


BACK_TIMEOUT_S = 20.0


def wait_back(url: str) -> None:
    """Until the gateway's directory is no longer degraded (bounded)."""
    deadline = time.monotonic() + BACK_TIMEOUT_S
    with httpx.Client() as http:  # one TLS context a wait, not a poll (~27 ms of CPU)
        while time.monotonic() < deadline:
            text = http.get(url + "/metrics", timeout=5).text
            if any(line.strip() == "kvgate_directory_degraded 0.0" for line in text.splitlines()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the gateway at {url} did not come back to Redis in {BACK_TIMEOUT_S} s")


def hit_ratio(turns: list[Turn]) -> float | None:
    prompt = sum(t.prompt_tokens for t in turns if t.ok)
    return sum(t.cached_tokens for t in turns if t.ok) / prompt if prompt else None


def _figures(turns: list[Turn], restarted: float, window_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("cold", "before", "outage", "after"):
        group = [t for t in turns if t.phase == phase]
        out[phase] = {
            "requests": len(group),
            "failed": sum(1 for t in group if not t.ok),
            "hit_ratio": hit_ratio(group),
        }
    after = [t for t in turns if t.phase == "after"]
    window = [t for t in after if t.finished_s - restarted < window_s]
    later = [t for t in after if t.finished_s - restarted >= window_s]
    out["window"] = {"requests": len(window), "hit_ratio": hit_ratio(window)}
    out["later"] = {"requests": len(later), "hit_ratio": hit_ratio(later)}
    last: dict[int, str] = {}
    for t in turns:
        if t.phase != "after" and t.ok:
            last[t.conversation] = t.replica
    first_after: dict[int, str] = {}
    for t in turns:
        if t.phase == "after" and t.ok and t.conversation not in first_after:
            first_after[t.conversation] = t.replica
    out["moved"] = sum(1 for c, r in first_after.items() if last.get(c) not in (None, r))
    out["conversations"] = len(first_after)
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run_bench_redis_reset(args: argparse.Namespace) -> int:
    arms: list[tuple[str, Path | None]] = [("this checkout", None)]
    arms += [(str(tree), tree) for tree in args.gateway_tree]
    print(
        f"kvgate bench-redis-reset: {args.engines} engines (time scale {args.time_scale:g}), "
        f"{args.conversations} conversations at concurrency {args.concurrency}; Redis killed "
        f"after 1 + {args.rounds_before} rounds, one round away, back empty, "
        f"{args.rounds_after} rounds after"
    )
    header = (
        f"{'gateway':<40} {'failed':>6} {'hit before':>10} {'outage':>8} "
        f"{f'first {args.window_s:g} s':>10} {'later':>8} {'moved':>8}"
    )
    print(header)
    for name, tree in arms:
        f = run_arm(args, tree)
        failed = sum(f[p]["failed"] for p in ("cold", "before", "outage", "after"))
        print(
            f"{name[-40:]:<40} {failed:>6} {_fmt(f['before']['hit_ratio']):>10} "
            f"{_fmt(f['outage']['hit_ratio']):>8} {_fmt(f['window']['hit_ratio']):>10} "
            f"{_fmt(f['later']['hit_ratio']):>8} {f['moved']:>3} of {f['conversations']:<3}"
        )
    return 0
