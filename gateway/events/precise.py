"""Precise keys: a request tokenized as the engine will tokenize it, and what events say each
replica holds of it.

    body ──PromptTokens (chat template, segments; gateway.events.prompts)──▶ ids
         ──precise_keys(ids, cache_salt, block_size)──▶ own keys ──EventIndex.lookup──▶ matches

`PromptTokens` renders and tokenizes only what a conversation adds (a prefix cache and a
segment cache, both under the request's cache salt).

Shared (`kv_events_shared`): the events' matches come from the event index in Redis
(`EventReader`), looked up once the keys are known (`keys` returns them as a `LookedUp` list
carrying the matches), merged per domain with this gateway's own speculative entries, which
stay in process; a lookup that fails or misses its deadline leaves every replica to the
prediction, as an engine without events is.

The gateway's ids are checked against an engine's `/tokenize` (`TokenizerCheck`): a tokenizer
that differs from the engine's matches no event, which would be a silent zero hit rate, so a
mismatch is counted and logged loudly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import mmh3

from cachemap.events import (
    EventIndex,
    Match,
    domain_of,
    precise_keys,
    precise_root,
    rank_of,
    replica_of,
)
from cachemap.keys import BlockHash, chain_hashes, token_bytes
from cachemap.layouts import EngineLayouts
from cachemap.multimodal import DEFAULT_TOKENS_PER_IMAGE, identify
from cachemap.redis.events import EventReader
from gateway.deadline import LookupDeadline
from gateway.events.claims import PlacedChains
from gateway.events.intake import EventIntake
from gateway.events.prompts import PromptTokens
from gateway.settings import DEFAULT_CHECK_EVERY, DEFAULT_REDIS_DEADLINE_CAP_S

__all__ = [
    "Chain",
    "ChainCache",
    "EventsView",
    "ImageIds",
    "PreciseKeys",
    "PromptTokens",
    "TokenizerCheck",
]

log = logging.getLogger(__name__)

DEFAULT_CHAIN_CACHE_BYTES = 64 << 20
"""Token bytes of recent prompts kept with their keys (64 MB: ~16M tokens), so a continuation
hashes only the blocks after what its previous turn already hashed."""


DEFAULT_IMAGE_IDS = 65_536
"""Image identifiers kept (`ImageIds`): ~8 MB of keys and identifiers, every image of thousands
of live conversations."""


class ImageIds:
    """Image identifiers by the request's salt and a 128-bit hash of the part's URL, LRU: a
    conversation carries its images in every later turn, and decoding and SHA-256-ing one of
    100 KB is ~0.6 ms against ~0.05 ms to hash its URL (`tools.precise_cost images`).

    Salted like the tokenization caches, so a tenant neither reads nor times another's
    entries. The URL hash is not collision-resistant: a tenant crafting two URLs with one hash
    misroutes only its own requests (the engine computes the identity from the bytes)."""

    def __init__(self, max_entries: int = DEFAULT_IMAGE_IDS) -> None:
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._ids: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    def identifier(self, salt: str, part: Mapping[str, Any], where: str) -> str:
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else None
        if not isinstance(url, str):
            return identify(part, where)  # its 400
        slot = (salt, mmh3.mmh3_x64_128_digest(url.encode()))
        known = self._ids.get(slot)
        if known is not None:
            self._ids.move_to_end(slot)
            self.hits += 1
            return known
        self.misses += 1
        self._ids[slot] = found = identify(part, where)
        if len(self._ids) > self.max_entries:
            self._ids.popitem(last=False)
        return found


class ChainCache:
    """The keys of recent prompts, found by their first block (salt included): a continuation
    reuses the keys of the blocks it shares with the last prompt that began like it.

    LRU, bounded by the token bytes kept (`DEFAULT_CHAIN_CACHE_BYTES`)."""

    def __init__(self, block_size: int, max_bytes: int = DEFAULT_CHAIN_CACHE_BYTES) -> None:
        self.width = 4 * block_size
        self.max_bytes = max_bytes
        self.reused_blocks = 0
        self.hashed_blocks = 0
        self._entries: OrderedDict[tuple[str, str | None, bytes], tuple[bytes, list[BlockHash]]] = (
            OrderedDict()
        )
        self._bytes = 0

    def keys(
        self, token_ids: Sequence[int], cache_salt: str, lora_name: str | None = None
    ) -> list[BlockHash]:
        """The prompt's keys, as a `Chain` carrying its token bytes (for the index to take
        the keys of the blocks its engine then stores, `EventIndex.speculate`)."""
        data = token_bytes(token_ids)
        width = self.width
        if len(data) < width:
            return []
        slot = (cache_salt, lora_name, data[:width])
        known = self._entries.pop(slot, None)
        shared = 0
        if known is not None:
            self._bytes -= len(known[0])
            shared = _shared_blocks(known[0], data, width, len(known[1]))
        keys = Chain()
        keys.data = data
        if shared:
            assert known is not None
            keys += known[1][:shared]
            keys += chain_hashes(data[shared * width :], keys[-1], width, parent=keys[-1])
        else:
            keys += chain_hashes(data, precise_root(cache_salt, lora_name), width)
        self.reused_blocks += shared
        self.hashed_blocks += len(keys) - shared
        self._entries[slot] = (data, keys)
        self._bytes += len(data)
        while self._bytes > self.max_bytes and self._entries:
            _, (dropped, _) = self._entries.popitem(last=False)
            self._bytes -= len(dropped)
        return keys


def _shared_blocks(old: bytes, new: bytes, width: int, num_keys: int) -> int:
    """Leading full blocks `old` and `new` have in common: all of `old`'s when `new` extends
    it (a continuation: one memcmp), else a binary search of compares. `startswith` of a
    memoryview slice copies nothing (slicing the bytes copied: 0.2 ms per 170 kB compare)."""
    high = min(num_keys, len(old) // width, len(new) // width)
    view = memoryview(old)
    if new.startswith(view[: high * width]):
        return high
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if new.startswith(view[: mid * width]):
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
    claimed: dict[str, int] = field(default_factory=dict)
    """Of `overlap`, blocks only a speculative entry claims (`RouteRequest.claimed`)."""


@dataclass
class PreciseStats:
    lookups: int = 0
    speculated: int = 0
    mismatches: int = 0
    checks: int = 0
    shared_lookups: int = 0
    shared_failures: int = 0
    """Shared lookups that failed or missed the deadline (those requests used the prediction)."""
    image_requests: int = 0
    """Requests keyed with images (their blocks' keys carry the images' identities)."""


class Chain(list[BlockHash]):
    """A request's keys with the token bytes they chain (`data`; None: keys that hash more
    than the tokens, a prompt with images): placed, the pair goes to the index, which takes
    the keys of the blocks the engine then stores from it instead of hashing their tokens
    again (`EventIndex.speculate`)."""

    data: bytes | None = None


class LookedUp(Chain):
    """A request's keys with what the shared event index matched of them (None: the lookup
    failed), looked up as soon as the keys were known."""

    matches: dict[str, Match] | None = None


def merged(shared: Match | None, local: Match | None) -> Match | None:
    """A domain's match from the shared index and from this gateway's speculative entries:
    the deeper one (a speculative entry covers its placement's chain from block 0)."""
    if local is None or (shared is not None and shared.depth >= local.depth):
        return shared
    if shared is None:
        return local
    return Match(local.depth, shared.offloaded, local.depth - shared.depth)


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
    images: ImageIds = field(default_factory=ImageIds)
    shared: EventReader | None = None
    """The event index in Redis (set when the gateway starts with `kv_events_shared`)."""
    shared_deadline: LookupDeadline = field(
        default_factory=lambda: LookupDeadline(0.005, 0.0, DEFAULT_REDIS_DEADLINE_CAP_S)
    )
    """A shared lookup's deadline (`gateway.deadline`, as the directory's): its base
    raised to twice the event lane's recent p99 round trip, within its cap, plus an allowance
    per key of the chain (the script walks it). A fixed base failed a quarter to nearly all of
    the lookups that queued behind the owners' event writes (`WRITE_CHUNK` calls of a few ms
    each) at 2-4 gateways (issue 39). Fed by the lane's round trips once `share` wires it."""
    adapters: Mapping[str, str] = field(default_factory=dict)
    """LoRA adapter -> base model (`lora_adapters`): a request for one is keyed under it."""
    mm_tokens_per_image: int = DEFAULT_TOKENS_PER_IMAGE
    """Placeholder tokens per image, as the engines expand them (`mm_tokens_per_image`)."""
    placed: PlacedChains = field(default_factory=PlacedChains)
    """What this gateway placed on each domain: the measure of its events' claims (`view`)."""

    def __post_init__(self) -> None:
        self.chains = ChainCache(self.index.block_size)

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def lora_of(self, model: str | None) -> str | None:
        """The adapter a request for `model` runs with (None: a base model)."""
        return model if model is not None and model in self.adapters else None

    async def keys(
        self, body: Mapping[str, Any], chat: bool, cache_salt: str, lora_name: str | None = None
    ) -> tuple[Sequence[int], list[BlockHash]]:
        started = time.perf_counter()
        ids = await self.tokens.ids_off_loop(body, chat, cache_salt)
        ids, images = self.tokens.tokenizer.with_images(
            ids, body, chat, self.mm_tokens_per_image, partial(self.images.identifier, cache_salt)
        )
        if images:  # the chain cache knows token ids only: an image's blocks are hashed here
            keys = precise_keys(ids, cache_salt, self.block_size, lora_name, images)
            self.stats.image_requests += 1
        else:
            keys = self.chains.keys(ids, cache_salt, lora_name)
        self.tokens.stats.requests += 1
        self.tokens.stats.seconds += time.perf_counter() - started
        if self.shared is not None:
            return ids, await self._shared_lookup(self.shared, keys)
        return ids, keys

    def share(self, reader: EventReader) -> None:
        """Read the event index in Redis through `reader`: its lane's round trips (Redis's
        time, written to parsed) teach the shared lookups' deadline."""
        self.shared = reader
        reader.lane.on_round_trip = self.shared_deadline.observe

    async def _shared_lookup(self, shared: EventReader, keys: list[BlockHash]) -> LookedUp:
        out = LookedUp(keys)
        out.data = keys.data if isinstance(keys, Chain) else None
        self.stats.shared_lookups += 1
        try:
            deadline = self.shared_deadline.seconds(len(keys))
            out.matches = await shared.lookup(keys, deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis away or slow: the prediction routes this one
            self.stats.shared_failures += 1
            log.debug("shared event lookup failed: %r", exc)
        return out

    def view(self, keys: list[BlockHash], replicas: Iterable[str]) -> EventsView:
        """Each live replica's match: its best rank's (ranks are separate caches)."""
        self.stats.lookups += 1
        replicas = list(replicas)
        if self.shared is not None:
            shared = self.shared
            found = keys.matches if isinstance(keys, LookedUp) else None
            if found is None:  # the shared lookup failed: the prediction alone
                return EventsView({}, {}, {}, frozenset())
            local = self.index.lookup(keys, self.clock())  # this gateway's speculative entries
            domains = {d for r in replicas for d in self._domains(r) if shared.live(d)}
            matches = {d: m for d in domains if (m := merged(found.get(d), local.get(d)))}
            live = {r for r in replicas if domains & set(self._domains(r))}
            return self._view(matches, live - self._doubted(keys, matches))
        if self.intake is None:  # no events: the prediction alone
            return EventsView({}, {}, {}, frozenset())
        intake = self.intake
        intake.drain()  # what already reached the sockets (a wipe) comes first
        local = self.index.lookup(keys, self.clock())
        live = intake.live_among(replicas)
        doubted = self._doubted(keys, local)
        return self._view(local, live - doubted if doubted else live)

    def _doubted(self, keys: list[BlockHash], matches: dict[str, Match]) -> set[str]:
        """The replicas with a domain claiming more of the chain than this gateway placed
        there, when it placed the chain on another domain that matched
        (`gateway.events.claims`): routed on the prediction for this request. With no claim
        confirmed anywhere (a chain another gateway or a direct client placed) the events
        stand, as before."""
        if len(matches) < 2:
            return set()
        placed = self.placed
        confirmed = {d: placed.confirmed(d, keys, m.depth) for d, m in matches.items()}
        if not any(confirmed.values()):
            return set()
        doubted: set[str] = set()
        for domain, match in matches.items():
            if confirmed[domain] < match.depth:
                placed.doubt(domain, match.depth, confirmed[domain])
                doubted.add(replica_of(domain))
        return doubted

    def _domains(self, replica: str) -> list[str]:
        return [domain_of(replica, rank, self.dp_size) for rank in range(self.dp_size)]

    def _view(self, matches: dict[str, Match], live: set[str]) -> EventsView:
        """Each live replica's best rank among the domains that matched (a few, whatever the
        fleet's size): the deepest match, then the most of it on the GPU, then the lowest
        rank."""
        best: dict[str, tuple[int | None, Match]] = {}
        for domain, match in matches.items():
            found = self._replica_rank(domain, live)
            if found is None:
                continue
            replica, rank = found
            held = best.get(replica)
            if held is None or (match.depth, match.depth - match.offloaded, -(rank or 0)) > (
                held[1].depth,
                held[1].depth - held[1].offloaded,
                -(held[0] or 0),
            ):
                best[replica] = (rank, match)
        overlap: dict[str, int] = {}
        offloaded: dict[str, int] = {}
        ranks: dict[str, int] = {}
        claimed: dict[str, int] = {}
        for replica in sorted(best):
            rank, match = best[replica]
            overlap[replica] = match.depth
            offloaded[replica] = match.offloaded
            if rank is not None:
                ranks[replica] = rank
            if match.speculative:
                claimed[replica] = match.speculative
        return EventsView(overlap, offloaded, ranks, frozenset(live), claimed)

    def _replica_rank(self, domain: str, live: set[str]) -> tuple[str, int | None] | None:
        """The live replica a domain is, and its rank (None: the replica has no DP ranks);
        None for another replica's domain, or one that is not of the replica's DP layout."""
        replica, rank = replica_of(domain), rank_of(domain)
        if replica not in live:
            return None
        dp_size = self.layouts.dp_size(replica, self.dp_size)
        if rank is None:
            return (replica, None) if dp_size <= 1 else None
        return (
            (replica, rank)
            if rank < dp_size and domain == domain_of(replica, rank, dp_size)
            else None
        )

    def speculate(self, replica: str, rank: int | None, keys: list[BlockHash]) -> None:
        """The request was placed: its blocks count as held there until the event or expiry.
        Without events the index is never read (`view`), so nothing is entered: that was ~13%
        of an events-off gateway's CPU (py-spy)."""
        if self.intake is None:
            return
        domain = domain_of(replica, rank or 0, self.layouts.dp_size(replica, self.dp_size))
        self.placed.place(domain, keys)
        data = keys.data if isinstance(keys, Chain) else None
        self.stats.speculated += self.index.speculate(domain, keys, self.clock(), data)
        found = keys.matches if isinstance(keys, LookedUp) else None
        if self.shared is not None and found is not None:  # for the other gateways' lookups
            held = found.get(domain)
            self.shared.speculate(
                domain, keys[held.depth if held else 0 :], self.index.speculative_ttl_s
            )


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
