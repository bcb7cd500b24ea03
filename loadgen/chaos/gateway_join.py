"""Gateways joining and leaving a shared-directory fleet under load (issue 39 item 4).

Two gateways on one Redis serve conversations, every turn through another gateway than the
last (a Service's spreading at its worst for a gateway's own memory). Then a third gateway
starts (a rolling update, an autoscaler) and takes its share of the next round at once; then
one of the first two is SIGKILLed and the rounds go on over the survivors. Counted from
outside, from the engines' own `cached_tokens`:

- the joiner routes as well as the others from its first request: its turns' hit ratio in its
  first round against the other gateways' in the same round (`JOIN_TOLERANCE`);
- the dead gateway loses nothing the others need: the turns after the kill (the conversations
  whose last turn went through it among them) hit as the rounds before did
  (`KILL_TOLERANCE`), and no conversation changes replica at any point;
- no request fails (the client talks only to live gateways, as a Service's endpoints do once
  the pod is gone).
"""

from __future__ import annotations

import asyncio

import httpx

from loadgen.bench.redis_reset import KEY, Conversation, Turn, _turn, hit_ratio, open_conversations
from loadgen.chaos.outcome import Outcome, Size, ratio
from loadgen.harness import processes
from loadgen.harness.processes import Proc
from loadgen.harness.redis_servers import redis_server

JOIN_TOLERANCE = 0.05
"""Hit-ratio points the joiner's first round may sit below the others' in the same round (a
round's turns differ by a few tokens of their own suffixes)."""
KILL_TOLERANCE = 0.05
"""Hit-ratio points the rounds after the kill may sit below the rounds before it."""


async def _round(
    urls: list[str], conversations: list[Conversation], phase: str, n: int, concurrency: int
) -> list[tuple[str, Turn]]:
    """One turn of every conversation, conversation c through gateway (c + n) mod len(urls):
    each conversation's turn goes through another gateway than its last whenever there are
    two or more."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(c: Conversation) -> tuple[str, Turn]:
            url = urls[(c.index + n) % len(urls)]
            async with limit:
                return url, await _turn(http, url, c, phase, n)

        return list(await asyncio.gather(*(one(c) for c in conversations)))


def _moved(turns: list[Turn]) -> int:
    """Conversations whose turns (after the first) did not all go to one replica."""
    replicas: dict[int, set[str]] = {}
    for t in turns:
        if t.ok:
            replicas.setdefault(t.conversation, set()).add(t.replica)
    return sum(1 for r in replicas.values() if len(r) > 1)


def run(size: Size) -> Outcome:
    num_engines = size.pick(2, 4)
    conversations = open_conversations(size.pick(6, 24), size.pick(300, 600), tag="join")
    rounds_before, rounds_after = size.pick(1, 3), size.pick(1, 4)
    concurrency = size.pick(3, 6)
    engine_args = ["--time-scale", "10", "--max-batch", "256"]
    env = {
        "KVGATE_REDIS_DEADLINE_S": "0.05",
        "KVGATE_DEBUG_HEADERS": "true",
        "KVGATE_SERVER_SECRET": "chaos-fleet-secret",  # one salt for the fleet
    }
    serve = ["--tenant", f"bench:{KEY}", "--log-level", "warning"]
    placed: list[tuple[str, Turn]] = []
    cold: list[Turn] = []
    first_after: list[Turn] = []
    gateways: list[Proc] = []
    with (
        redis_server(port=0) as redis,
        processes.engines(num_engines, engine_args) as engines,
    ):
        urls = [e.url for e in engines]

        def launch() -> Proc:
            proc = processes.start_gateway(
                processes.free_port(), urls, [*serve, "--redis-url", redis.url], env=env
            )
            gateways.append(proc)
            return proc

        def ready(proc: Proc) -> Proc:
            processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
            return proc

        def start() -> Proc:
            return ready(launch())

        try:
            a, b = launch(), launch()  # the first two start side by side
            for proc in (a, b):
                ready(proc)
            n = 0
            cold = [
                t
                for _, t in asyncio.run(
                    _round([a.url, b.url], conversations, "cold", n, concurrency)
                )
            ]
            for _ in range(rounds_before):
                n += 1
                placed += asyncio.run(
                    _round([a.url, b.url], conversations, "before", n, concurrency)
                )
            c = start()  # the joiner: its first request is in the next round
            n += 1
            placed += asyncio.run(
                _round([a.url, b.url, c.url], conversations, "joined", n, concurrency)
            )
            a.popen.kill()  # SIGKILL: no drain, no flush
            a.popen.wait(timeout=10)
            for i in range(rounds_after):
                n += 1
                round_ = asyncio.run(_round([b.url, c.url], conversations, "after", n, concurrency))
                placed += round_
                if i == 0:
                    first_after = [t for _, t in round_]
        finally:
            processes.stop(gateways)
    turns = [t for _, t in placed]
    out = Outcome("gateway-joined-and-killed")
    failed = sum(1 for t in [*cold, *turns] if not t.ok)
    out.goal("failed requests", failed == 0, f"{failed} of {len(cold) + len(turns)}")
    joined = [(u, t) for u, t in placed if t.phase == "joined"]
    joiner = hit_ratio([t for u, t in joined if u == c.url])
    others = hit_ratio([t for u, t in joined if u != c.url])
    out.goal(
        "the joiner's first round vs the others'",
        joiner is not None and others is not None and joiner >= others - JOIN_TOLERANCE,
        f"{ratio(joiner)} vs {ratio(others)}",
    )
    before = hit_ratio([t for t in turns if t.phase == "before"])
    after = hit_ratio([t for t in turns if t.phase == "after"])
    last_on_dead = {t.conversation for u, t in joined if u == a.url}
    orphans = hit_ratio([t for t in first_after if t.conversation in last_on_dead])
    out.goal(
        "after the kill vs before",
        before is not None and after is not None and after >= before - KILL_TOLERANCE,
        f"{ratio(after)} vs {ratio(before)}",
    )
    moved = _moved([*cold, *turns])
    out.goal("conversations moved", moved == 0, f"{moved} of {len(conversations)}")
    out.figures["the dead gateway's conversations, first turn after"] = ratio(orphans)
    return out
