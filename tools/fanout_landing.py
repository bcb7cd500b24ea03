"""Fan-out with billing on, precise mode: the siblings' time to first token when their leader
lands at its BlockStored (this tree) against its first token (another checkout), in one run.

    python -m tools.fanout_landing [--rounds R] [--siblings K] [--stream-interval S,S...] TREE ...

    python -m tools.fanout_landing --stream-interval 1,50 base=/tmp/base here

Each arm (a tree and a stream interval): 2 simulated engines publishing KV events over ZMQ
(6,500 prefill tokens/s; `--stream-interval S`: a completion's first chunk waits for S tokens,
as vLLM's flag of that name — 1 is vLLM's default), one redis-server (the directory and the
billing store), two gateways of the tree's code in precise mode with fan-out holds and billing
(anthropic, shared ledger). The gateways assume a quarter of the engines' prefill rate, so a
hold's bound (a multiple of the expected prefill) outlasts the leader's first chunk and both
landings are measured, not the timeout. Each round, R in all: a fresh ~2,000-token prompt
(with Anthropic's automatic breakpoint) to gateway A as the leader (streamed, 100 tokens); once
its flight marker is in Redis, K identical siblings to gateway B (streamed, 2 tokens), which
hold on the marker. Per arm: the siblings' TTFT (from their send) median / p90, the leader's
TTFT median, siblings billed a read of the whole prompt (`cache_read_input_tokens` = N) and
with an engine hit (`engine_cached_tokens` > 0), and the pod's fan-out counters (landings on
events, where the tree exports them; releases by landing and by timeout). Every loop is
bounded (R rounds; each request has a 30 s timeout; the marker wait 5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import redis
from prometheus_client.parser import text_string_to_metric_families

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness import processes
from loadgen.harness.redis_servers import redis_server
from loadgen.sim import percentile
from loadgen.text import words

HERE = str(Path(__file__).resolve().parent.parent)
KEY = "sk-bench-landing"
PREFILL_TOKENS_PER_S = 6_500.0


@dataclass
class Arm:
    name: str
    tree: str
    stream_interval: int
    sibling_ttfts: list[float] = field(default_factory=list)
    leader_ttfts: list[float] = field(default_factory=list)
    reads: int = 0
    engine_hits: int = 0
    siblings: int = 0
    errors: int = 0
    unmarked: int = 0
    """Rounds whose leader's marker was never seen (its siblings were sent after it)."""
    counters: dict[str, float] = field(default_factory=dict)


async def _ask(
    http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
) -> tuple[float, dict[str, object]]:
    """One streamed completion: its time to the first content chunk, and its usage."""
    body = {
        "model": DEFAULT_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_control": {"type": "ephemeral"},
    }
    started = time.monotonic()
    ttft = float("nan")
    usage: dict[str, object] = {}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("choices") and ttft != ttft:
                ttft = time.monotonic() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft, usage


async def _round(arm: Arm, a: str, b: str, markers: redis.Redis, i: int, k: int) -> None:
    prompt = "You are a subagent." + words(f"landing/{arm.name}/{i}", 2_000)
    async with httpx.AsyncClient(timeout=30) as http:
        leader = asyncio.ensure_future(_ask(http, a, prompt, 100))
        deadline = time.monotonic() + 5.0
        while not any(True for _ in markers.scan_iter(match="kvg:*:w")):
            if time.monotonic() > deadline or leader.done():
                arm.unmarked += 1
                break
            await asyncio.sleep(0.002)  # polling Redis for the marker: bounded by the deadline
        siblings = await asyncio.gather(
            *(_ask(http, b, prompt, 2) for _ in range(k)), return_exceptions=True
        )
        try:
            lead_ttft, lead_usage = await leader
            arm.leader_ttfts.append(lead_ttft)
        except Exception:
            arm.errors += 1
            lead_usage = {}
    n = lead_usage.get("prompt_tokens")
    for result in siblings:
        if isinstance(result, BaseException):
            arm.errors += 1
            continue
        ttft, usage = result
        arm.siblings += 1
        arm.sibling_ttfts.append(ttft)
        arm.reads += int(n is not None and usage.get("cache_read_input_tokens") == n)
        engine = usage.get("engine_cached_tokens")
        arm.engine_hits += int(isinstance(engine, int) and engine > 0)
    left = list(markers.scan_iter(match="kvg:*:w"))
    if left:  # the landed markers linger 2 s: the next round waits for a marker of its own
        markers.delete(*left)


def _counters(metrics_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url + "/metrics").text):
        if family.name.startswith("kvgate_fanout"):
            for s in family.samples:
                label = s.labels.get("reason", "")
                out[f"{s.name}{':' + label if label else ''}"] = s.value
    return out


def _joined(gateways: list[processes.Proc], engines: list[processes.Proc]) -> None:
    """PUB drops what it sends before a SUB joined: reset the engines until every gateway's
    feed of each has seen a wipe (bounded)."""
    for _ in range(400):
        for e in engines:
            httpx.post(e.url + "/reset_prefix_cache")
        seen = 0
        for g in gateways:
            text = httpx.get(str(g.metrics_url) + "/metrics").text
            for family in text_string_to_metric_families(text):
                if family.name == "kvgate_events":
                    seen += sum(
                        1 for s in family.samples if s.labels.get("kind") == "wipes" and s.value
                    )
        if seen >= len(gateways) * len(engines):
            return
        time.sleep(0.05)  # the engines' publishers and the SUBs connecting: bounded retries
    raise RuntimeError("the gateways' event feeds never joined")


def run_arm(arm: Arm, rounds: int, k: int) -> None:
    engine_args = ["--prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S), "--max-batch", "256"]
    engine_args += ["--stream-interval", str(arm.stream_interval)]
    with (
        processes.engines_with_events(2, engine_args) as (engines, events),
        redis_server(port=0) as store,
        tempfile.TemporaryDirectory() as wal,
    ):
        extra, env = processes.precise_gateway_args(events, str(MODEL_DIR))
        env.update(
            {
                "KVGATE_FANOUT_HOLD": "true",
                "KVGATE_OVERFLOW": "false",
                "KVGATE_ENGINE_PREFILL_TOKENS_PER_S": str(PREFILL_TOKENS_PER_S / 4),
                "KVGATE_SERVER_SECRET": "landing-fleet",
                "KVGATE_BILLING_PROFILE": "anthropic",
                "KVGATE_BILLING_MODEL_MAP": orjson.dumps({DEFAULT_MODEL: "sonnet-5"}).decode(),
                "KVGATE_BILLING_REDIS_URL": store.url,
                "KVGATE_BILLING_REDIS_ALLOW_UNSAFE_FSYNC": "true",  # a throwaway store
            }
        )
        args = [*extra, "--tenant", f"bench:{KEY}", "--log-level", "warning"]
        args += ["--redis-url", store.url]
        urls = [e.url for e in engines]
        gws = [
            processes.start_gateway(
                processes.free_port(),
                urls,
                args,
                {**env, "KVGATE_BILLING_WAL_DIR": f"{wal}/{side}"},
                cwd=arm.tree,
            )
            for side in ("a", "b")
        ]
        try:
            for g in gws:
                processes.wait_ready(g.url, "/readyz", g.popen, processes.STARTUP_TIMEOUT_S)
                metrics = str(g.metrics_url)
                processes.wait_ready(metrics, "/metrics", g.popen, processes.STARTUP_TIMEOUT_S)
            _joined(gws, engines)
            markers = redis.Redis.from_url(store.url)
            try:
                for i in range(rounds):
                    asyncio.run(_round(arm, gws[0].url, gws[1].url, markers, i, k))
            finally:
                markers.close()
            for g in gws:
                for name, value in _counters(str(g.metrics_url)).items():
                    arm.counters[name] = arm.counters.get(name, 0.0) + value
        finally:
            processes.stop(gws)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="NAME=DIR, or 'here' for this checkout")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--siblings", type=int, default=3)
    parser.add_argument(
        "--stream-interval",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[1, 50],
        help="the engines' stream intervals, one set of arms each (comma-separated)",
    )
    args = parser.parse_args(argv)
    trees = [("here", HERE) if t == "here" else tuple(t.split("=", 1)) for t in args.trees]
    arms = [Arm(name, tree, s) for s in args.stream_interval for name, tree in trees]
    print(
        "| tree | stream interval | siblings | sibling TTFT p50 / p90 ms | leader TTFT p50 ms "
        "| billed reads | engine hits | landed on events | released landed / timeout |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for arm in arms:
        run_arm(arm, args.rounds, args.siblings)
        c = arm.counters
        p50 = percentile(arm.sibling_ttfts, 0.5) * 1e3 if arm.sibling_ttfts else float("nan")
        p90 = percentile(arm.sibling_ttfts, 0.9) * 1e3 if arm.sibling_ttfts else float("nan")
        lead = percentile(arm.leader_ttfts, 0.5) * 1e3 if arm.leader_ttfts else float("nan")
        events = c.get("kvgate_fanout_landed_on_events_total")
        print(
            f"| {arm.name} | {arm.stream_interval} | {arm.siblings} (errors {arm.errors}, "
            f"rounds unmarked {arm.unmarked}) "
            f"| {p50:.0f} / {p90:.0f} | {lead:.0f} | {arm.reads} | {arm.engine_hits} "
            f"| {'—' if events is None else f'{events:.0f}'} "
            f"| {c.get('kvgate_fanout_releases_total:landed', 0):.0f} / "
            f"{c.get('kvgate_fanout_releases_total:timeout', 0):.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
