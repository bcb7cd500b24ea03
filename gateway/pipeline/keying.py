"""Keying: a request's directory keys, what each replica holds of them, and its size in the
router's units — in one of two modes.

    approximate (the default)   canonical rendering ──256-byte blocks──▶ salted chain
                                ──▶ the directory's prediction; tokens estimated from bytes
    precise (`tokenizer_dir`)   the model's chat template + tokenizer ──engine blocks──▶ salted
                                chain over token ids (`gateway.events.precise`) ──▶ the engines'
                                KV events for replicas whose events flow, the prediction (in
                                the same key space) for the others; tokens exact

In precise mode the placement is also entered as a short speculative entry (`speculate`), so
a back-to-back turn or a fan-out sibling sees it before the engine's event lands. With the
in-process directory, a request whose candidates' events all flow is routed on the events
without walking the prediction, and the prediction is not recorded for a replica whose events
flow (`Keyed.unpredicted`): a feed that has applied a batch counts as flowing for as long as
it lives, so that prediction would never be read. With the shared directory the prediction is
always looked up and recorded (it carries the other gateways' fan-out markers, and routes
every replica while the shared index is away).

A prefix-cache reset sent through the gateway (`reset_prefix_cache`, the admin port's
`POST /reset_prefix_cache`) closes the wipe window: from the moment it is sent until the
engine answers, the replica matches nothing; on the engine's 200 its prediction is forgotten
(an epoch bump) and its event-index domains are cleared, before any later routing decision,
without waiting for the engine's `AllBlocksCleared` (which may reach the gateway milliseconds
after the answer, or, from an idle engine, later still).
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from cachemap.affinity import ConversationAffinity, Home
from cachemap.chat_template import ChatTemplateError
from cachemap.events import DEFAULT_OFFLOAD_COST, domain_of, precise_root
from cachemap.keys import BlockHash, affinity_key, chain_hashes, root_hash, token_bytes
from gateway.directory.routing import Lookup, RoutingDirectory
from gateway.errors import InvalidRequest
from gateway.events.precise import EventsView, PreciseKeys, TokenizerCheck
from gateway.request.cache_control import strip_marks
from gateway.request.parsed import CHAT, ParsedRequest
from gateway.request.tenant import Tenant
from gateway.request.tokens import TokenEstimator
from gateway.request.trace import RequestTrace
from gateway.tasks import BackgroundTasks


@dataclass(frozen=True)
class RouteKeys:
    """How a request's rendering becomes the directory's keys and the router's units."""

    block_bytes: int
    consistent_hash_blocks: int
    decode_token_weight: float = 0.0
    """Prefill tokens of load per output token a replica still generates (router.types)."""
    offload_cost: float = DEFAULT_OFFLOAD_COST


@dataclass
class Keyed:
    """A request as the router needs it: keys, matches and its size in blocks and tokens."""

    hashes: list[BlockHash]
    lookup: Lookup
    num_prompt_tokens: float
    tokens_per_block: float
    affinity_key: bytes
    offloaded: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    unpredicted: frozenset[str] = frozenset()
    """Replicas routed on their KV events whose prediction is never read (`Routed`)."""
    home: Home | None = None
    """Where this request's conversation went last (`cachemap.affinity`; None: new, or off)."""
    committed: dict[str, int] = field(default_factory=dict)
    """Per replica, the blocks of the other live conversations homed there (the room scorer's)."""
    claimed: dict[str, int] = field(default_factory=dict)
    """Of the events' overlap, blocks only a speculative entry claims (`RouteRequest.claimed`)."""


def engine_body(parsed: ParsedRequest) -> dict[str, object]:
    """The body without the cache hints a front end kept in it: what the engine is sent."""
    if parsed.breakpoints or parsed.prewarm:
        return strip_marks(dict(parsed.body))
    return parsed.body


AFFINITY_TAIL_TOKENS = 64
"""A prompt's last tokens that its conversation's next prompt may not share (`homed_prefix`)."""


def homed_prefix(hashes: list[BlockHash], tokens_per_block: float) -> list[BlockHash]:
    """The blocks a conversation's home is recorded under: the prompt's chain less its last
    `AFFINITY_TAIL_TOKENS` (at least one block), when at least as many blocks are left.

    The next prompt extends this one's text, not always its last blocks: they hold the chat
    template's end of turn and generation prompt, which a conversation that grows its last
    message (an agent appending replies and tool results to one user message) does not keep,
    and a word cut at the prompt's end tokenizes otherwise once continued. In precise mode's
    16-token blocks the home recorded under the very last block matched 12 of 66 continuations
    of the bench's agent sessions (1-3 blocks were short), so most turns evicted everywhere found
    no home and went where the load sent them. A prompt too short to spare its tail keeps it:
    a key that near its start would be a prefix other conversations share (a system prompt)."""
    tail = max(math.ceil(AFFINITY_TAIL_TOKENS / tokens_per_block), 1) if tokens_per_block > 0 else 1
    if len(hashes) < 2 * tail:
        return hashes
    return hashes[:-tail]


@functools.lru_cache(maxsize=4096)
def _root_hash(salt: bytes, model: str) -> BlockHash:
    """`root_hash`, once per scope and model (a hash of the salt and the name per request
    otherwise; bounded: a `user` scope has a salt per end user)."""
    return root_hash(salt, model)


class Keying:
    def __init__(
        self,
        keys: RouteKeys,
        directory: RoutingDirectory,
        estimator: TokenEstimator,
        precise: PreciseKeys | None = None,
        check: TokenizerCheck | None = None,
        session: Callable[[], aiohttp.ClientSession | None] = lambda: None,
        affinity: ConversationAffinity | None = None,
        room: bool = False,
    ) -> None:
        self.keys = keys
        self.directory = directory
        self.estimator = estimator
        self.precise = precise
        self.check = check
        self._session = session
        self.affinity = affinity
        self.room = room
        """The room scorer weighs (`room_weight` > 0): each request walks the live homes for
        `Keyed.committed`, work the request path skips otherwise."""
        directory.lookup_homes = affinity is not None  # the home in the lookup's round trip
        self._tasks = BackgroundTasks("keying")
        self.last_lookup_s = 0.0
        self.last_on_events = False
        """The last lookup was the KV events' alone (`_events_only`): the histogram's source."""
        self.wiping: Counter[str] = Counter()
        """Replicas whose prefix-cache reset is in flight: they match nothing."""
        self.num_resets = 0

    async def key(
        self, parsed: ParsedRequest, tenant: Tenant, candidates: Sequence[str], trace: RequestTrace
    ) -> Keyed:
        if self.precise is None:
            keyed = await self._approximate(parsed, tenant, trace)
        else:
            keyed = await self._precise(self.precise, parsed, tenant, candidates, trace)
        if self.affinity is not None:
            keyed.home = await self._home(self.affinity, keyed.hashes, keyed.lookup)
            if self.room:
                keyed.committed = self.affinity.committed(keyed.home)
        return keyed

    async def _home(
        self, affinity: ConversationAffinity, hashes: list[BlockHash], lookup: Lookup
    ) -> Home | None:
        """The conversation's home: Redis's when it answers with one (every gateway's latest
        placement; read in the lookup's own round trip when that one answered), else this
        gateway's own table (Redis away, or it lost the entry)."""
        local = affinity.lookup(hashes)
        if lookup.home_answered:
            answered, shared = True, lookup.home
        else:
            answered, shared = await self.directory.home(hashes)
        return shared if answered and shared is not None else local

    async def _lookup(self, hashes: Sequence[BlockHash], trace: RequestTrace) -> Lookup:
        started_ns, started = time.time_ns(), time.perf_counter_ns()
        lookup = await self.directory.lookup(hashes)
        elapsed_ns = time.perf_counter_ns() - started
        trace.looked_up(
            started_ns,
            started_ns + elapsed_ns,
            len(hashes),
            "local" if lookup.degraded else "shared",
            max(lookup.overlap.values(), default=0),
        )
        self.last_lookup_s = elapsed_ns / 1e9  # read by the director's histogram, same task
        self.last_on_events = False
        if self.wiping:
            lookup = replace(
                lookup,
                overlap={r: d for r, d in lookup.overlap.items() if not self.wiping[r]},
                last_use={r: t for r, t in lookup.last_use.items() if not self.wiping[r]},
                held={r: h for r, h in lookup.held.items() if not self.wiping[r]},
            )
        return lookup

    async def _approximate(
        self, parsed: ParsedRequest, tenant: Tenant, trace: RequestTrace
    ) -> Keyed:
        block_bytes = self.keys.block_bytes
        root = _root_hash(tenant.salt, parsed.model)
        hashes = chain_hashes(parsed.rendered, root, block_bytes)
        lookup = await self._lookup(hashes, trace)
        bytes_per_token = self.estimator.bytes_per_token(parsed.model, tenant=tenant.name)
        return Keyed(
            hashes,
            lookup,
            len(parsed.rendered) / bytes_per_token,
            block_bytes / bytes_per_token,
            affinity_key(
                parsed.rendered, root, hashes, self.keys.consistent_hash_blocks, block_bytes
            ),
        )

    async def _precise(
        self,
        precise: PreciseKeys,
        parsed: ParsedRequest,
        tenant: Tenant,
        candidates: Sequence[str],
        trace: RequestTrace,
    ) -> Keyed:
        body, chat = engine_body(parsed), parsed.kind == CHAT
        lora = precise.lora_of(parsed.model)  # an adapter's blocks chain from its name
        try:
            ids, hashes = await precise.keys(body, chat, tenant.cache_salt, lora)
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc)) from None
        self._maybe_check(body, chat, ids, candidates)
        if self.directory.shared is None:
            # in process: the events first; the prediction only for replicas they do not cover
            started_ns, started = time.time_ns(), time.perf_counter_ns()
            view = self._events_view(precise, hashes, candidates)
            if view.live.issuperset(candidates):
                predicted = self._events_only(view, hashes, trace, started_ns, started)
            else:
                predicted = await self._lookup(hashes, trace)
        else:  # the shared lookup's wait lets events in: they are read after it
            predicted = await self._lookup(hashes, trace)
            view = self._events_view(precise, hashes, candidates)
        # replicas whose events flow: the events; the others: the prediction
        overlap = {r: d for r, d in predicted.overlap.items() if r not in view.live}
        overlap.update(view.overlap)
        last_use = {r: t for r, t in predicted.last_use.items() if r not in view.live}
        lookup = Lookup(
            overlap,
            predicted.degraded,
            last_use,
            predicted.hot_key,
            predicted.hot,
            predicted.writer_depth,
            predicted.writer,
            predicted.writer_from,
            predicted.home,
            predicted.home_answered,
            predicted.held,  # what Redis holds: every replica's prediction is recorded
        )
        block_bytes = 4 * precise.block_size
        head = self.keys.consistent_hash_blocks * precise.block_size  # all affinity_key reads
        affinity = affinity_key(
            token_bytes(ids[:head]),
            precise_root(tenant.cache_salt, lora),
            hashes,
            self.keys.consistent_hash_blocks,
            block_bytes,
        )
        return Keyed(
            hashes,
            lookup,
            float(len(ids)),
            float(precise.block_size),
            affinity,
            view.offloaded,
            view.ranks,
            # in process, a replica whose events flow is routed on them for as long as its
            # feed lives (it never goes back to not live): its prediction would never be read
            view.live if self.directory.shared is None else frozenset(),
            claimed=view.claimed,
        )

    def resize_after_wait(self, keyed: Keyed, parsed: ParsedRequest, tenant: Tenant) -> bool:
        """Approximate mode: the request's size in tokens at the estimator's current ratio of
        bytes per token, when that moved since it was keyed (True). A request keyed before its
        tenant's first answer was sized at the default ratio, and a wait of seconds in flow
        control's queue is when the first answers teach the real one: placed at the stale size,
        its lease would count a prefill of the wrong length (the room's progress estimate, the
        load the router sees). Precise mode counts the engine's own tokens: nothing to do."""
        if self.precise is not None or keyed.tokens_per_block <= 0:
            return False
        bytes_per_token = self.estimator.bytes_per_token(parsed.model, tenant=tenant.name)
        tokens_per_block = self.keys.block_bytes / bytes_per_token
        if abs(tokens_per_block - keyed.tokens_per_block) <= 1e-9 * tokens_per_block:
            return False
        keyed.num_prompt_tokens = len(parsed.rendered) / bytes_per_token
        keyed.tokens_per_block = tokens_per_block
        return True

    def after_wait(self, keyed: Keyed, candidates: Sequence[str]) -> bool:
        """A request that waited in flow control's queue: precise mode with the in-process
        index reads the events (and this gateway's homes) again, so it is placed on what the
        engines hold when it leaves the queue, not when it entered it. True when `keyed` was
        updated (its lookup's overlap, offloaded blocks, ranks and home).

        The wait is seconds to a minute at saturation, when the engines' caches turn over
        fastest: on the bench's agent sessions at 10% KV, 44% of precise mode's requests
        waited (18.7 s on average) and were placed on the events of their arrival, in which a
        session's previous turn, itself queued then, was nowhere. The prediction (approximate
        mode, the shared index) changes only with placements and is not read again."""
        precise = self.precise
        if precise is None or precise.intake is None or self.directory.shared is not None:
            return False
        view = self._events_view(precise, keyed.hashes, candidates)
        overlap = {r: d for r, d in keyed.lookup.overlap.items() if r not in view.live}
        overlap.update(view.overlap)
        keyed.lookup.overlap = overlap
        keyed.offloaded = view.offloaded
        keyed.ranks = view.ranks
        keyed.claimed = view.claimed
        if self.affinity is not None and not keyed.lookup.home_answered:
            keyed.home = self.affinity.lookup(keyed.hashes) or keyed.home
        return True

    def _events_view(
        self, precise: PreciseKeys, hashes: list[BlockHash], candidates: Sequence[str]
    ) -> EventsView:
        view = precise.view(hashes, candidates)
        if self.wiping:
            view = replace(
                view,
                overlap={r: d for r, d in view.overlap.items() if not self.wiping[r]},
                claimed={r: d for r, d in view.claimed.items() if not self.wiping[r]},
            )
        return view

    def _events_only(
        self,
        view: EventsView,
        hashes: list[BlockHash],
        trace: RequestTrace,
        started_ns: int,
        started: int,
    ) -> Lookup:
        """The lookup of a request whose candidates' events all flow: the prediction would be
        read for none of them, so it is not walked (~4% of a precise gateway's CPU on
        conversations, py-spy: a walk of every 16-token block). Its hot prefix is the deepest
        block the events hold (the prediction's is its deepest predicted block, in the same
        key space); it is timed and traced as the lookup, source "events"."""
        lookup = self.directory.rated(Lookup(dict(view.overlap), degraded=False), hashes)
        elapsed_ns = time.perf_counter_ns() - started
        trace.looked_up(
            started_ns,
            started_ns + elapsed_ns,
            len(hashes),
            "events",
            max(view.overlap.values(), default=0),
        )
        self.last_lookup_s = elapsed_ns / 1e9
        self.last_on_events = True
        return lookup

    def _maybe_check(
        self, body: dict[str, object], chat: bool, ids: Sequence[int], candidates: Sequence[str]
    ) -> None:
        """A sampled request's ids against the engine's /tokenize, off the request path."""
        session = self._session()
        if self.check is None or session is None or not candidates or not self.check.due():
            return
        self._tasks.spawn(
            self.check.check(session, candidates[0], dict(body), chat, ids), name="tokenizer check"
        )

    async def close(self) -> None:
        await self._tasks.close()

    async def reset_prefix_cache(self, session: aiohttp.ClientSession, replica: str) -> int:
        """Forward a prefix-cache reset to `replica` (module docstring); the engine's status,
        or 502 when it could not be asked."""
        self.wiping[replica] += 1
        try:
            try:
                async with session.post(
                    replica + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)
                ) as response:
                    status = response.status
            except (aiohttp.ClientError, TimeoutError):
                return 502
            if status == 200:
                self.num_resets += 1
                precise = self.precise
                if precise is not None:
                    for rank in range(precise.dp_size):
                        precise.index.clear(domain_of(replica, rank, precise.dp_size))
                await self.directory.forget(replica)
            return status
        finally:
            self.wiping[replica] -= 1
            if not self.wiping[replica]:
                del self.wiping[replica]

    def placed(self, keyed: Keyed, replica: str) -> None:
        """The request was placed on `replica`: its conversation's home (`homed`), and precise
        mode's speculative entry."""
        if self.affinity is not None:
            homed = homed_prefix(keyed.hashes, keyed.tokens_per_block)
            self.affinity.record(homed, replica, keyed.home)
            self.directory.record_home(homed, replica, keyed.home, self.affinity.ttl_s)
        if self.precise is not None:
            self.precise.speculate(replica, keyed.ranks.get(replica), keyed.hashes)
