"""Precise keying's CPU against approximate keying's, in process (a benchmark, not a test).

`kvgate bench-keying` (which runs `python -m tools.keying_cost`: loadgen and the gateway meet
only over the wire, and this needs the gateway's own code in process) keys the same requests
both ways, one after the other with the order alternating, on this process's CPU clock
(`time.process_time`, the tokenizer's threads included; the gateway sets
TOKENIZERS_PARALLELISM=false, so does this):

- approximate: the chained hashes of the canonical rendering's bytes (`parse_chat` made it;
  the parse is the gateway's in both modes and is not counted);
- precise: `PreciseKeys.keys` (render what is new, tokenize through the salted caches, hash
  the token blocks) and `view` (the event index looked up; it is empty here).

Workloads, each on its own warm `PromptTokens` (the words and caches of earlier requests):

- chat: `--conversations` agent conversations (a ~2,000-word system prompt of its own, ~300-word
  user turns, ~100-word replies) of `--turns` turns, interleaved turn by turn; first turns (a
  new conversation, every word of a known vocabulary) and continuations apart;
- long: one message growing by ~300 words a request from ~11k words (a document or agent log
  resent as one message);
- mooncake: `--mooncake` requests of the Mooncake conversation slice from line 4,000 (bench
  point 2's prompts: one user message of ~12k tokens synthesized from the trace's hash ids);
- novel: first turns of text no request used before (random letter strings: every word a
  miss, the BPE's own cost), with the BPE of the same text alone beside it.

The machine's load average is printed before and after: CPU time still moves with the load
(shared caches and clocks), less than wall time does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import string
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from cachemap.events import EventIndex
from cachemap.keys import chain_hashes, root_hash
from cachemap.tokenizer import ModelTokenizer
from gateway.api.openai.parse import parse_chat
from gateway.events.precise import PreciseKeys
from gateway.events.prompts import TOKENIZER_THREADS, PromptTokens
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words
from loadgen.traces.readers import read_trace
from loadgen.traces.synthesis import PromptSynthesizer

TRACE = (
    Path(__file__).resolve().parents[1]
    / "loadgen"
    / "traces"
    / "mooncake"
    / "conversation_trace.jsonl"
)
MOONCAKE_START = 4_000
SALT = "bench-salt"


def add_bench_keying_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=8, help="chat conversations")
    parser.add_argument("--turns", type=int, default=20, help="turns per conversation")
    parser.add_argument("--long", type=int, default=30, help="long-message requests")
    parser.add_argument("--mooncake", type=int, default=300, help="Mooncake slice requests")
    parser.add_argument("--novel", type=int, default=10, help="first turns of novel text")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


class Arms:
    """One workload's paired measurements: approximate and precise CPU per request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), EventIndex(), None)
        self.approximate: list[float] = []
        self.precise: list[float] = []
        self.tokens: list[int] = []
        self._root = root_hash(SALT.encode(), "m")
        self._count = 0

    async def key(self, body: Mapping[str, Any]) -> None:
        raw = orjson.dumps(body)
        parsed = parse_chat(raw, 1 << 26)
        decoded = orjson.loads(raw)  # what the gateway's precise keying reads
        clock = time.process_time
        order = (self._approximate, self._precise)
        self._count += 1
        for step in order if self._count % 2 else order[::-1]:
            started = clock()
            await step(parsed.rendered, decoded)
            (self.approximate if step == self._approximate else self.precise).append(
                clock() - started
            )

    async def _approximate(self, rendered: bytes, body: Mapping[str, Any]) -> None:
        chain_hashes(rendered, self._root)

    async def _precise(self, rendered: bytes, body: Mapping[str, Any]) -> None:
        ids, keys = await self.keys.keys(body, True, SALT)
        self.keys.view(keys, ["r"])
        self.tokens.append(len(ids))

    def reset(self) -> None:
        """Forget what was measured (a warm-up's)."""
        self.approximate.clear()
        self.precise.clear()
        self.tokens.clear()

    def row(self, name: str, picked: list[int] | None = None) -> str:
        """A table row over the requests `picked` (all by default): medians, and precise's
        CPU over all their tokens."""
        picked = list(range(len(self.precise))) if picked is None else picked
        return _row(
            name,
            [self.approximate[i] for i in picked],
            [self.precise[i] for i in picked],
            [self.tokens[i] for i in picked],
        )


def _us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6 if seconds else 0.0


def _row(name: str, approximate: list[float], precise: list[float], tokens: list[int]) -> str:
    a, p = _us(approximate), _us(precise)
    per_token = sum(precise) / sum(tokens) * 1e6 if tokens else 0.0
    return (
        f"| {name} | {len(precise)} | {statistics.median(tokens) if tokens else 0:,.0f} | "
        f"{a:,.0f} | {p:,.0f} | {p - a:+,.0f} | {p / a if a else 0:.1f}x | {per_token:.3f} |"
    )


def _novel_words(rng: random.Random, n: int) -> str:
    letters = string.ascii_lowercase
    return "".join(" " + "".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(n))


def _conversations(conversations: int, turns: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(turn, body) of every conversation, turn by turn across them."""
    chats: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"You are agent {c}." + words(f"keying-sys{c}", 2_000)}]
        for c in range(conversations)
    ]
    for turn in range(turns):
        for c, messages in enumerate(chats):
            if turn:
                messages.append(
                    {"role": "assistant", "content": words(f"keying-reply{c}/{turn}", 100)}
                )
            messages.append({"role": "user", "content": words(f"keying-user{c}/{turn}", 300)})
            yield turn, {"model": "m", "messages": list(messages)}


async def bench(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Arms]:
    os.environ.setdefault(*TOKENIZER_THREADS)
    started = time.process_time()
    out(f"load average before: {_loadavg()}; CPU time per request, medians; precise - approximate")
    arms: dict[str, Arms] = {}

    chat = arms["chat"] = Arms("chat")
    for _ in range(2):  # warm: the tokenizer's probes, the template, code paths
        for _, body in _conversations(1, 3):
            await chat.key(body)
    chat.reset()
    turns: list[int] = []
    for turn, body in _conversations(args.conversations, args.turns):
        await chat.key(body)
        turns.append(turn)

    long = arms["long"] = Arms("long")
    text = "Log:" + words("keying-long", 11_000)
    for i in range(args.long + 1):
        text += words(f"keying-long{i}", 300)
        await long.key({"model": "m", "messages": [{"role": "user", "content": text}]})

    mooncake = arms["mooncake"] = Arms("mooncake")
    if args.mooncake > 0:
        trace = read_trace(TRACE, start=MOONCAKE_START, limit=args.mooncake)
        for body in PromptSynthesizer(trace.block_size).iter_bodies(trace.requests, "m"):
            await mooncake.key(body)

    novel = arms["novel"] = Arms("novel")
    rng = random.Random(41)
    bpe: list[float] = []
    await novel.key({"model": "m", "messages": [{"role": "user", "content": "warm up"}]})
    novel.reset()
    for _ in range(args.novel):
        content = _novel_words(rng, 2_000)
        await novel.key({"model": "m", "messages": [{"role": "user", "content": content}]})
        clock = time.process_time()
        novel.keys.tokens.tokenizer.encode(content)
        bpe.append(time.process_time() - clock)

    first = [i for i, t in enumerate(turns) if t == 0]
    later = [i for i, t in enumerate(turns) if t > 0]

    out("")
    out(
        "| workload | requests | tokens | approximate µs | precise µs | precise - approximate "
        "µs | ratio | precise µs/token |"
    )
    out("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    out(chat.row("chat: first turn (new conversation, known words)", first[1:]))
    out(chat.row("chat: continuation (~400 new tokens)", later))
    out(long.row("long message: continuation (+300 words)", list(range(1, args.long + 1))))
    if args.mooncake > 0:
        out(mooncake.row("Mooncake slice (bench point 2's prompts)"))
    out(novel.row("novel text: first turn (every word new)"))
    bpe_per_token = sum(bpe) / max(sum(novel.tokens), 1) * 1e6
    stats = mooncake.keys.tokens.stats
    out("")
    out(
        f"novel text: the BPE alone (one encode call) {bpe_per_token:.3f} µs/token. "
        f"Mooncake: {stats.text_prefix_tokens / max(stats.tokens, 1):.1%} of tokens from the "
        f"text-prefix cache, {stats.segment_hits / max(stats.segments, 1):.1%} of segments from "
        f"the segment cache, {stats.tokens_encoded / max(stats.tokens, 1):.2%} through the BPE"
    )
    out(
        f"CPU time of the run {time.process_time() - started:.1f} s; load average after: "
        f"{_loadavg()}"
    )
    return arms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.keying_cost", description=__doc__)
    add_bench_keying_arguments(parser)
    asyncio.run(bench(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
