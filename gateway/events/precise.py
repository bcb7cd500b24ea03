"""Precise keys: a request tokenized as the engine will tokenize it, and what events say each
replica holds of it.

    body ──prompt_of (chat template)──▶ text ──segments──▶ ids (cached per segment)
         ──precise_keys(ids, cache_salt, block_size)──▶ own keys ──EventIndex.lookup──▶ matches

Segments: the text is cut right before every special (added) token. A Hugging Face tokenizer
splits its input at added tokens before anything else, so encoding the pieces one by one gives
exactly the ids of encoding the whole; in a chat every message starts with one
(`<|im_start|>`), so a continuation tokenizes only its new messages and finds the rest in a
bounded LRU (`DEFAULT_SEGMENT_CACHE_TOKENS`). The gateway's ids are checked against an
engine's `/tokenize` (`TokenizerCheck`): a tokenizer that differs from the engine's matches no
event, which would be a silent zero hit rate, so a mismatch is counted and logged loudly.
"""

from __future__ import annotations

import array
import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cachemap.events import EventIndex, domain_of, precise_root
from cachemap.keys import BlockHash, chain_hashes, token_bytes
from cachemap.layouts import EngineLayouts
from cachemap.tokenizer import ModelTokenizer
from gateway.events.intake import EventIntake
from gateway.settings import DEFAULT_CHECK_EVERY

log = logging.getLogger(__name__)

OFF_LOOP_CHARS = 16_384
"""Text to encode above which it is encoded in a thread (~4k tokens, ~5 ms of the loop); below
it the thread hop (~0.1 ms) costs more than it saves."""
DEFAULT_SEGMENT_CACHE_TOKENS = 4_000_000
"""Token ids kept of tokenized segments (4 bytes each: 16 MB): the system prompts, tools and
turns of ~40 live 100k-token conversations, or thousands of ordinary chats."""


@dataclass
class TokenizeStats:
    requests: int = 0
    segments: int = 0
    segment_hits: int = 0
    tokens: int = 0
    tokens_encoded: int = 0
    """Tokens of segments that missed the cache (what was really encoded)."""
    seconds: float = 0.0
    """Time spent rendering, tokenizing and hashing (the precise mode's CPU per request)."""


class PromptTokens:
    """Render and tokenize requests, with a bounded LRU of tokenized segments."""

    def __init__(
        self, tokenizer: ModelTokenizer, max_cached_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS
    ) -> None:
        self.tokenizer = tokenizer
        self.max_cached_tokens = max_cached_tokens
        self.stats = TokenizeStats()
        self._specials = tuple(t for t in tokenizer.added_tokens() if t)
        self._cache: OrderedDict[str, array.array[int]] = OrderedDict()
        self._cached_tokens = 0

    async def ids_off_loop(self, body: Mapping[str, Any], chat: bool) -> Sequence[int]:
        """`ids`, with the segments the cache lacks encoded in a worker thread when they are
        over `OFF_LOOP_CHARS` (the tokenizer releases the GIL): a burst of long first turns
        must not hold the event loop (it did: connections to the engines timed out behind
        it)."""
        prompt = self.tokenizer.prompt_of(body, chat)
        if isinstance(prompt, list):
            return prompt
        missing = [p for p in dict.fromkeys(self.segments(prompt)) if p not in self._cache]
        if sum(len(p) for p in missing) > OFF_LOOP_CHARS:
            encoded = await asyncio.to_thread(self.tokenizer.encode_many, missing)
            for piece, ids in zip(missing, encoded, strict=True):
                self.stats.tokens_encoded += len(ids)
                self._keep(piece, array.array("I", ids))
        return self.encode(prompt)

    def ids(self, body: Mapping[str, Any], chat: bool) -> Sequence[int]:
        """The prompt's token ids (`ChatTemplateError` for a malformed request): an
        `array("I")` built from the cached segments' arrays without boxing an int per token."""
        prompt = self.tokenizer.prompt_of(body, chat)
        return prompt if isinstance(prompt, list) else self.encode(prompt)

    def encode(self, text: str) -> array.array[int]:
        pieces = self.segments(text)
        out: array.array[int] = array.array("I")
        stats = self.stats
        for piece in pieces:
            if not piece:
                continue
            stats.segments += 1
            cached = self._cache.get(piece)
            if cached is not None:
                self._cache.move_to_end(piece)
                stats.segment_hits += 1
                out.extend(cached)
                continue
            ids = array.array("I", self.tokenizer.encode(piece))
            stats.tokens_encoded += len(ids)
            out.extend(ids)
            self._keep(piece, ids)
        stats.tokens += len(out)
        return out

    def segments(self, text: str) -> list[str]:
        """`text` cut right before every added token (str.find per token: a regex lookahead at
        every position was 1 ms per 80 kB)."""
        starts = {0}
        for token in self._specials:
            i = text.find(token)
            while i >= 0:
                starts.add(i)
                i = text.find(token, i + len(token))
        cuts = sorted(starts)
        return [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]

    def _keep(self, piece: str, ids: array.array[int]) -> None:
        if len(ids) > self.max_cached_tokens:
            return
        self._cache[piece] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > self.max_cached_tokens:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= len(dropped)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens


DEFAULT_CHAIN_CACHE_BYTES = 64 << 20
"""Token bytes of recent prompts kept with their keys (64 MB: ~16M tokens), so a continuation
hashes only the blocks after what its previous turn already hashed."""


class ChainCache:
    """The keys of recent prompts, found by their first block (salt included): a continuation
    reuses the keys of the blocks it shares with the last prompt that began like it.

    LRU, bounded by the token bytes kept (`DEFAULT_CHAIN_CACHE_BYTES`)."""

    def __init__(self, block_size: int, max_bytes: int = DEFAULT_CHAIN_CACHE_BYTES) -> None:
        self.width = 4 * block_size
        self.max_bytes = max_bytes
        self.reused_blocks = 0
        self.hashed_blocks = 0
        self._entries: OrderedDict[tuple[str, bytes], tuple[bytes, list[BlockHash]]] = OrderedDict()
        self._bytes = 0

    def keys(self, token_ids: Sequence[int], cache_salt: str) -> list[BlockHash]:
        data = token_bytes(token_ids)
        width = self.width
        if len(data) < width:
            return []
        slot = (cache_salt, data[:width])
        known = self._entries.pop(slot, None)
        shared = 0
        if known is not None:
            self._bytes -= len(known[0])
            shared = _shared_blocks(known[0], data, width, len(known[1]))
        if shared:
            assert known is not None
            keys = known[1][:shared]
            keys += chain_hashes(data[shared * width :], keys[-1], width, parent=keys[-1])
        else:
            keys = chain_hashes(data, precise_root(cache_salt), width)
        self.reused_blocks += shared
        self.hashed_blocks += len(keys) - shared
        self._entries[slot] = (data, keys)
        self._bytes += len(data)
        while self._bytes > self.max_bytes and self._entries:
            _, (dropped, _) = self._entries.popitem(last=False)
            self._bytes -= len(dropped)
        return keys


def _shared_blocks(old: bytes, new: bytes, width: int, num_keys: int) -> int:
    """Leading full blocks `old` and `new` have in common (a binary search of slice compares:
    each a memcmp, so ~log2(blocks) of them)."""
    low, high = 0, min(num_keys, len(old) // width, len(new) // width)
    while low < high:
        mid = (low + high + 1) // 2
        if old[: mid * width] == new[: mid * width]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class EventsView:
    """What the events say about one request, per replica whose events flow (`live`)."""

    overlap: dict[str, int]
    offloaded: dict[str, int]
    """Of `overlap`, blocks held on no GPU."""
    ranks: dict[str, int]
    """replica -> the DP rank holding the longest match (replicas with ranks only)."""
    live: frozenset[str]


@dataclass
class PreciseStats:
    lookups: int = 0
    speculated: int = 0
    mismatches: int = 0
    checks: int = 0


@dataclass
class PreciseKeys:
    """Precise mode's keys and event lookups (see the module docstring)."""

    tokens: PromptTokens
    index: EventIndex
    intake: EventIntake | None
    dp_size: int = 1
    layouts: EngineLayouts = field(default_factory=EngineLayouts)
    """Per-replica DP sizes from pod annotations (discovery); `dp_size` for the rest."""
    clock: Callable[[], float] = time.time
    stats: PreciseStats = field(default_factory=PreciseStats)
    chains: ChainCache = field(init=False)

    def __post_init__(self) -> None:
        self.chains = ChainCache(self.index.block_size)

    @property
    def block_size(self) -> int:
        return self.index.block_size

    async def keys(
        self, body: Mapping[str, Any], chat: bool, cache_salt: str
    ) -> tuple[Sequence[int], list[BlockHash]]:
        started = time.perf_counter()
        ids = await self.tokens.ids_off_loop(body, chat)
        keys = self.chains.keys(ids, cache_salt)
        self.tokens.stats.requests += 1
        self.tokens.stats.seconds += time.perf_counter() - started
        return ids, keys

    def view(self, keys: list[BlockHash], replicas: Iterable[str]) -> EventsView:
        """Each live replica's match: its best rank's (ranks are separate caches)."""
        self.stats.lookups += 1
        if self.intake is None:  # no events: the prediction alone
            return EventsView({}, {}, {}, frozenset())
        matches = self.index.lookup(keys, self.clock())
        overlap: dict[str, int] = {}
        offloaded: dict[str, int] = {}
        ranks: dict[str, int] = {}
        live = set()
        for replica in replicas:
            if not self.intake.live(replica):
                continue
            live.add(replica)
            best = None
            dp_size = self.layouts.dp_size(replica, self.dp_size)
            for rank in range(dp_size):
                match = matches.get(domain_of(replica, rank, dp_size))
                if match is None:
                    continue
                gpu = match.depth - match.offloaded
                if best is None or (match.depth, gpu) > (
                    best[1].depth,
                    best[1].depth - best[1].offloaded,
                ):
                    best = (rank, match)
            if best is not None:
                overlap[replica] = best[1].depth
                offloaded[replica] = best[1].offloaded
                if dp_size > 1:
                    ranks[replica] = best[0]
        return EventsView(overlap, offloaded, ranks, frozenset(live))

    def speculate(self, replica: str, rank: int | None, keys: list[BlockHash]) -> None:
        """The request was placed: its blocks count as held there until the event or expiry."""
        domain = domain_of(replica, rank or 0, self.layouts.dp_size(replica, self.dp_size))
        self.stats.speculated += self.index.speculate(domain, keys, self.clock())


class TokenizerCheck:
    """Compare the gateway's ids with an engine's `/tokenize` for a sample of requests."""

    def __init__(self, every: int = DEFAULT_CHECK_EVERY) -> None:
        self.every = every
        self.stats = PreciseStats()
        self._count = 0

    def due(self) -> bool:
        self._count += 1
        return self._count == 1 or (self.every > 0 and self._count % self.every == 0)

    async def check(
        self,
        session: aiohttp.ClientSession,
        replica_url: str,
        body: Mapping[str, Any],
        chat: bool,
        ids: Sequence[int],
    ) -> bool | None:
        """True when the engine tokenizes as the gateway did; None when it could not be asked."""
        ask: dict[str, Any] = {"model": body.get("model")}
        if chat:
            for name in ("messages", "tools", "add_generation_prompt", "continue_final_message"):
                if body.get(name) is not None:
                    ask[name] = body[name]
        else:
            ask["prompt"] = body.get("prompt")
        try:
            async with session.post(replica_url + "/tokenize", json=ask) as response:
                if response.status != 200:
                    return None
                answer = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            return None
        self.stats.checks += 1
        if tokens == list(ids):
            return True
        self.stats.mismatches += 1
        log.warning(
            "precise mode: the gateway's tokenizer disagrees with %s's (%d ids here, %d there): "
            "events will match no request; load the engine's tokenizer files (--tokenizer-dir)",
            replica_url,
            len(ids),
            len(tokens),
        )
        return False
