"""The event index: what each engine's KV events say it holds, under kvgate's own keys.

Precise mode's directory (issue 16). Engines announce blocks as they store and evict them
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, the shapes of vLLM's and SGLang's events,
decoded by `gateway.events.decode`). The index keeps the *dual keys* of llm-d's design:

    own key     = chain_hashes(token ids of the event, precise_root(cache_salt), 4 × block_size,
                               parent = own key of parent_block_hash)        (cachemap.keys)
    engine hash → own key       kept per domain, only to apply BlockRemoved and to resolve a
                                continuation's parent_block_hash

so the gateway's keys for a request (the same chain over the ids it tokenized itself) match
the engine's blocks with no coupling to the engine's hash function or its seed.

A *domain* is one cache: an engine, or one data-parallel rank of it (`domain_of`). Each block
a domain holds carries a tier mask (GPU, CPU, STORAGE: vLLM's `medium`, SGLang's names) and
leaves the index when its last tier is removed.

Invariants:
- A domain holds `key` (a non-zero tier mask in its `DomainMaps`) iff some engine hash of the
  domain maps to `key` there; `num_blocks(domain, tier)` counts those masks' bits.
- `clear(domain)` (a wipe, or a restart seen as seq 0) removes every block of the domain
  before it returns: a lookup after it sees none of them.
- A speculative entry (`speculate`) matches like a GPU block until it expires
  (`speculative_ttl_s`) or an event stores its key (confirmed); at most
  `MAX_SPECULATIVE_PER_DOMAIN` are kept per domain, the oldest dropped first. Entries are kept
  for the last block of each window of `SPECULATIVE_STRIDE` blocks and for a placement's last
  block: a chain key names its whole prefix, so an entry claims every block of its window (a
  request that shares a speculated prompt's prefix and ends or parts inside a window matches
  that window only up to a kept key: at most `SPECULATIVE_STRIDE - 1` blocks fewer).
- With `track_recency`, each domain's GPU blocks are also kept in eviction order with their
  last use (`cachemap.recency`): a BlockStored's blocks and a placement's `touch` become the
  newest, a GPU removal or a wipe takes them out, so `eviction_runs` is the engine's frontier
  as far as this gateway can know it. Off (the default), nothing of it is kept or paid for.
- A placement with its chain's token bytes (`speculate`'s `data`) expects its domain to store
  the blocks it lacks: the store that starts after the same key with the same tokens takes
  their keys from the chain (`_expected_keys`), which are the keys hashing would give (a key
  names its whole prefix); any other store is hashed. At most `MAX_EXPECTED_PER_DOMAIN` kept.
- Only full-attention groups are indexed: a store of a sliding-window group is ignored, and so
  are removals of groups a store said were sliding-window.
- Held chains are prefix-closed but where a key is *broken*: a domain's block is only stored
  when its parent is held there (else the parent cannot be resolved), so along any chain the
  blocks a domain holds are a leading run, unless an ancestor left while a descendant stayed
  (an engine evicting out of order, a lost event, a tier move's removal before its store).
  Each domain counts its held children per key (`DomainMaps.children`, with the `parent` of
  every key it holds); a key that leaves while it has held children is broken until
  it is held again or its last held child leaves. A lookup of a chain with no broken key on a
  domain without offloaded tiers finds the domain's run by bisection (~log2(n) probes, not n:
  a continuation's ~700-block chain was ~0.3 ms of a precise gateway's CPU per request); any
  other reads the chain key by key, as before.

Every map is per domain (`DomainMaps`: held masks, parents, children, engine hashes): a block
stored or removed is a probe or two of its domain's tables (compiled:
`cachemap._native.DomainTable`, one record a key and one slot an engine hash), in one loop over
the event's blocks, and a wipe drops the domain's maps whole. A
thrashing engine stores and removes ~730 blocks a request at bench point 2, where a dict of
holders per key, made and freed per block, and a Python step per block were ~17% of a precise
gateway's CPU (py-spy).
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import and_, gt, not_, sub

from cachemap.keys import BlockHash, chain_hashes, root_hash, token_bytes
from cachemap.multimodal import MMKey, Placeholder, extras_of, mm_key_bytes
from cachemap.native import NATIVE
from cachemap.recency import DomainRecency

EngineHash = int | bytes
"""A block hash as the engine sends it: a 64-bit int (vLLM unsigned, SGLang signed) or bytes."""

GPU, CPU, STORAGE = 1, 2, 4
TIERS = {"gpu": GPU, "cpu": CPU, "storage": STORAGE}
"""Tier masks by their metric label."""

DEFAULT_BLOCK_SIZE = 16
"""vLLM's and SGLang's default KV block size in tokens; set it to the engines' `--block-size`."""

DEFAULT_SPECULATIVE_TTL_S = 30.0
"""How long a placement may count as held before its event: an engine announces a prompt's
blocks at its first token, so this bounds the prefill queue a claim covers. Whether a claim
counts on a conversation's home is not its age but the router's queue rule (`router.claims`:
while the home's queue is at most half the request's re-prefill elsewhere), so the ttl only has
to outlast a queued prefill: a conversation's next turn arriving while its previous one still
waits at home (~40 s of queue and re-prefill on the issue-shaped trace at 10% KV) finds its
context claimed there rather than nowhere (docs/precise.md, "The queued turn"). `kvgate sim`
with the rule (then on every claim, at a share of 1): 20 / 30 / 60 s gave 97.3 / 97.5 / 97.5%
of the shared LRU for precise `cache_pressure` at 10% KV (30 and 60 alike). The cost: an
unconfirmed entry (a failed request's) lives this long, and in the shared index a confirmed
entry's field stays in Redis until it."""

DEFAULT_OFFLOAD_COST = 0.07
"""A CPU-tier hit costs this share of prefilling its tokens (128 KiB per token over PCIe at
~25 GB/s against ~77 µs of prefill per token on an H100: vLLM's OffloadingConnector, SGLang's
HiCache). So a CPU hit ranks below a GPU hit and far above a miss."""

MAX_SPECULATIVE_PER_DOMAIN = 65_536
"""Speculative entries kept per domain: ~4M tokens of 16-token blocks in flight (one entry a
window of `SPECULATIVE_STRIDE` blocks)."""

SPECULATIVE_STRIDE = 4
"""Blocks per speculative entry (a window's last block; module docstring): 64 tokens, the
approximate mode's 256-byte block. An entry per block was ~18% of a precise gateway's CPU at
bench point 2 (mostly new ~730-block prompts; py-spy), a quarter of it now; the price is a
match up to 3 blocks (48 tokens) short for a request ending or parting inside a window."""


MAX_EXPECTED_PER_DOMAIN = 64
"""Placed chains kept per domain for the stores their engine will announce (`speculate`'s
`data`), the oldest dropped first: a domain's prefills in flight, a few times over. Each holds
its prompt's token bytes (4 a token) until its store comes or it is dropped."""


def _first(values: Sequence[int], value: int, start: int, stop: int) -> int:
    """The first index in [start, stop) of `value` in `values` (`list.index`), else `stop`."""
    try:
        return values.index(value, start, stop)
    except ValueError:
        return stop


def hold_new(
    held: dict[BlockHash, int],
    parent_of: dict[BlockHash, BlockHash],
    children: dict[BlockHash, int],
    engine: dict[EngineHash, BlockHash],
    engine_hashes: Sequence[EngineHash],
    keys: list[BlockHash],
    tier: int,
    parent: BlockHash | None,
) -> None:
    """A domain's maps (`_Domain`) take a chain of keys new to it on `tier`: each key's mask,
    its parent (the first key's is `parent`), a held child more for each key's parent, and
    engine hash i -> key i (`engine_hashes` at least as long as `keys`). The definition of
    `cachemap._native.hold_new` (one C loop over the chain, every map written in it)."""
    held.update(zip(keys, repeat(tier)))
    if parent is None:
        parent_of.update(zip(keys[1:], keys, strict=False))
    else:
        parent_of.update(zip(keys, [parent, *keys], strict=False))
        children[parent] = children.get(parent, 0) + 1
    children.update(zip(keys[:-1], repeat(1)))
    engine.update(zip(engine_hashes, keys, strict=False))


def remove_held(
    engine: dict[EngineHash, BlockHash],
    held: dict[BlockHash, int],
    parent_of: dict[BlockHash, BlockHash],
    children: dict[BlockHash, int],
    broken: set[BlockHash],
    engine_hashes: Sequence[EngineHash],
) -> tuple[list[BlockHash], int]:
    """A domain's maps (`_Domain`) let go of every block of `engine_hashes` whatever its
    tiers (a GPU removal where nothing is offloaded): (the keys that left, in order; how
    many hashes were unknown or repeats). Each parent has as many held children fewer as it
    lost (none left: not broken); a key that left with held children is broken. The
    definition of `cachemap._native.remove_held` (one C loop over the batch)."""
    keys = list(map(engine.pop, engine_hashes, repeat(None)))  # unknown, or a repeat: None
    masks = list(map(held.pop, keys, repeat(0)))  # type: ignore[arg-type]
    gone: list[BlockHash] = list(compress(keys, masks))  # type: ignore[arg-type]
    lost = Counter(filter(None, map(parent_of.pop, gone, repeat(None))))
    if lost:
        left = list(map(sub, map(children.get, lost, repeat(0)), lost.values()))
        some = list(map(gt, left, repeat(0)))
        if any(some):  # a parent with children left (a branch point: a shared prefix)
            children.update(compress(zip(lost, left, strict=True), some))
            none = list(compress(lost, map(not_, some)))
        else:
            none = list(lost)
        deque(map(children.pop, none, repeat(None)), maxlen=0)
        if broken:
            broken.difference_update(none)
    broken.update(filter(children.__contains__, gone))  # left with held children: broken
    return gone, len(keys) - len(gone)


class DomainMaps:
    """A domain's blocks (`_Domain.maps`): the tier mask of every key it holds (`held`), the
    parent's own key of every held key but a chain's first (`parent`), per key (held or
    broken) how many of its children it holds (`children`), the keys it does not hold but
    holds a child of (`broken`, module docstring), and engine hash -> own key (`engine`).

    The definition of `cachemap._native.DomainTable`, which keeps the first four in one record
    a key of one C table (broken: a record with held children and no tier) and the engine
    hashes in a second (an int hash's 64 bits beside its key's bytes; bytes hashes in a dict):
    a dict operation a map a block on ~16k-entry maps was the index's store and removal at
    bench point 2, memory-bound (docs/design/compiled.md)."""

    __slots__ = ("broken", "children", "engine", "held", "parent")

    def __init__(self) -> None:
        self.held: dict[BlockHash, int] = {}
        self.parent: dict[BlockHash, BlockHash] = {}
        self.children: dict[BlockHash, int] = {}
        self.broken: set[BlockHash] = set()
        self.engine: dict[EngineHash, BlockHash] = {}

    def __len__(self) -> int:
        """How many keys the domain holds."""
        return len(self.held)

    def mask_of(self, key: BlockHash) -> int:
        """The key's tier mask on the domain (0: not held)."""
        return self.held.get(key, 0)

    def masks(self, keys: Sequence[BlockHash]) -> list[int]:
        """Per key, its tier mask (0: not held), in C loops."""
        return list(map(self.held.get, keys, repeat(0)))

    def holds(self, key: BlockHash) -> bool:
        return key in self.held

    def holds_any(self, keys: Sequence[BlockHash]) -> bool:
        return not self.held.keys().isdisjoint(keys)

    def held_run(self, keys: Sequence[BlockHash]) -> int | None:
        """The leading run of `keys` held, by bisection (~log2(n) probes), when no key of
        `keys` is broken (the held ones along the chain are then a leading run); else None."""
        if self.broken and not self.broken.isdisjoint(keys):
            return None
        held = self.held
        low, high = 0, len(keys)  # keys[:low] held, keys[high:] not
        while low < high:
            mid = (low + high) // 2
            if keys[mid] in held:
                low = mid + 1
            else:
                high = mid
        return low

    def own_key(self, engine_hash: EngineHash) -> BlockHash | None:
        return self.engine.get(engine_hash)

    def hold(
        self,
        engine_hashes: Sequence[EngineHash],
        keys: list[BlockHash],
        tier: int,
        parent: BlockHash | None,
    ) -> int:
        """Hold each (engine hash, own key) pair on `tier` (`keys` no longer than
        `engine_hashes`, its keys distinct: a chain's); a key newly held counts as a held child
        of its parent (the first key's is `parent`). Returns how many keys are new on `tier`.

        When every key is new to the domain (the usual store) and none has held children
        there, a C loop a map (`hold_new`); otherwise one Python loop."""
        n = len(keys)
        if (
            n > 1
            and self.held.keys().isdisjoint(keys)
            and (not self.broken or self.broken.isdisjoint(keys))
        ):
            hold_new(
                self.held,
                self.parent,
                self.children,
                self.engine,
                engine_hashes,
                keys,
                tier,
                parent,
            )
            return n
        held = self.held  # key by key
        engine = self.engine
        parent_of = self.parent
        children = self.children
        broken = self.broken
        new = 0
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            mask = held.get(key, 0)
            if not mask & tier:
                new += 1
            held[key] = mask | tier
            if not mask:  # newly held by the domain
                if parent is not None:
                    parent_of[key] = parent
                    children[parent] = children.get(parent, 0) + 1
                if broken:
                    broken.discard(key)
            parent = key
            engine[engine_hash] = key
        return new

    def remove_whole(self, engine_hashes: Sequence[EngineHash]) -> tuple[list[BlockHash], int]:
        """Every block of `engine_hashes` leaves whatever its tiers (a GPU removal where
        nothing is offloaded): (the keys that left, in order; how many hashes were unknown or
        repeats). `remove_held`."""
        return remove_held(
            self.engine, self.held, self.parent, self.children, self.broken, engine_hashes
        )

    def remove_tier(
        self, engine_hashes: Sequence[EngineHash], tier: int
    ) -> tuple[list[BlockHash], int]:
        """Each block of `engine_hashes` held on `tier` leaves it, and the domain when that
        was its last tier: (the keys that left `tier`, in order; how many hashes were unknown
        there)."""
        engine = self.engine
        held = self.held
        parent_of = self.parent
        children = self.children
        broken = self.broken
        removed: list[BlockHash] = []
        unknown = 0
        for engine_hash in engine_hashes:
            key = engine.get(engine_hash)
            mask = held.get(key, 0) if key is not None else 0
            if not mask & tier:
                unknown += 1
                continue
            assert key is not None
            removed.append(key)
            mask &= ~tier
            if mask:
                held[key] = mask
                continue
            # the domain no longer holds the key: its parent has a held child fewer (and is
            # no longer broken at none); the key is broken while it has held children
            del held[key]
            parent = parent_of.pop(key, None)
            if parent is not None:
                count = children.get(parent, 0) - 1
                if count > 0:
                    children[parent] = count
                else:
                    children.pop(parent, None)
                    broken.discard(parent)
            if key in children:
                broken.add(key)
            del engine[engine_hash]
        return removed, unknown

    def maps(
        self,
    ) -> tuple[
        dict[BlockHash, int],
        dict[BlockHash, BlockHash],
        dict[BlockHash, int],
        dict[EngineHash, BlockHash],
        set[BlockHash],
    ]:
        """(held masks, parents, held-children counts, engine hashes, broken keys), copied:
        what the invariants' tests read, whichever form holds them."""
        return (
            dict(self.held),
            dict(self.parent),
            dict(self.children),
            dict(self.engine),
            set(self.broken),
        )


_MAPS: Callable[[], DomainMaps] = NATIVE.DomainTable if NATIVE is not None else DomainMaps
"""A domain's maps, the compiled table where built: bench point 2's captured stream replayed
(`tools.events_replay replay`, decode aside) applied in 0.44-0.47 against 0.82-1.11 ms a request
on the four dicts (docs/design/compiled.md)."""


@dataclass(slots=True)
class BlockStored:
    """An engine's BlockStored, decoded. Read-only by convention, not frozen: a frozen
    dataclass is built through `object.__setattr__` per field (3.4 against 0.7 us for this
    one), and a live feed builds one per event (`gateway.events.decode`)."""

    block_hashes: Sequence[EngineHash]
    parent: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    tier: int = GPU
    cache_salt: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    full_attention: bool = True
    mm_keys: Sequence[Sequence[MMKey]] | None = None
    """Per block, the images it holds placeholders of, (identifier, offset): vLLM's multimodal
    extra keys, hashed into the block's own key as the gateway hashes a request's."""


@dataclass(slots=True)
class BlockRemoved:
    """An engine's BlockRemoved, decoded (read-only by convention, as `BlockStored`)."""

    block_hashes: Sequence[EngineHash]
    tier: int = GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@functools.lru_cache(maxsize=4096)
def precise_root(cache_salt: str | None, lora_name: str | None = None) -> BlockHash:
    """The parent of block 0 in precise mode: the engine's isolation scope (the `cache_salt`
    the gateway sent, so tenants share nothing) and the LoRA adapter. The model is not in it:
    a domain is one engine serving one model, and a lookup only asks the model's replicas.
    Kept for the last 4,096 scopes, as the approximate root is (`gateway.pipeline.keying`):
    every request hashed it for its affinity key, ~0.8 us (py-spy: 2.4% of the keying)."""
    return root_hash(b"precise\x00" + (cache_salt or "").encode(), lora_name or "")


def precise_keys(
    token_ids: Sequence[int],
    cache_salt: str | None,
    block_size: int,
    lora_name: str | None = None,
    images: Sequence[Placeholder] = (),
) -> list[BlockHash]:
    """The own keys of a prompt's full blocks: what the gateway looks up for a request (its
    images' identities in the blocks their placeholders fill, as `stored_keys` has them)."""
    extras = extras_of(images, len(token_ids) // block_size, block_size) if images else None
    return chain_hashes(
        token_bytes(token_ids), precise_root(cache_salt, lora_name), 4 * block_size, extras=extras
    )


_NO_ROOT = BlockHash(b"")
"""The root passed with a parent: `chain_hashes` does not read it then."""


def stored_keys(
    event: BlockStored, parent_key: BlockHash | None, block_size: int
) -> list[BlockHash]:
    """The own keys of a BlockStored's blocks: its token ids (and images) chained from its
    parent's own key (or from the root of its salt and LoRA when it has no parent)."""
    extras = None
    if event.mm_keys:
        extras = {i: mm_key_bytes(k) for i, k in enumerate(event.mm_keys) if k}
    # a continuation chains from its parent: the root is not hashed (~0.7 us of the ~7 us a
    # decode step's one-block event costs to index)
    root = precise_root(event.cache_salt, event.lora_name) if parent_key is None else _NO_ROOT
    return chain_hashes(
        token_bytes(event.token_ids), root, 4 * block_size, parent=parent_key, extras=extras
    )


def domain_of(replica: str, rank: int, dp_size: int) -> str:
    """A cache domain's name: the replica itself, or `replica#rank` when it has DP ranks."""
    return replica if dp_size <= 1 else f"{replica}#{rank}"


def replica_of(domain: str) -> str:
    """The replica a domain belongs to (`domain_of`'s inverse)."""
    replica, mark, _ = domain.rpartition("#")
    return replica if mark else domain


def rank_of(domain: str) -> int | None:
    """A domain's DP rank (`domain_of`'s inverse); None for a replica without ranks."""
    _, mark, rank = domain.rpartition("#")
    return int(rank) if mark and rank.isdigit() else None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank r's event endpoint, as vLLM and SGLang offset it: tcp port + r, or an
    inproc name with `_dp{r}`."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} by rank {rank}: use tcp:// or inproc://")


@dataclass(frozen=True, slots=True)
class Match:
    depth: int
    """Leading blocks of the request held on any tier (speculative entries count as GPU)."""
    offloaded: int
    """Of those, blocks held on no GPU (a CPU or storage hit: cheaper than a miss, dearer than a
    GPU hit)."""
    speculative: int = 0
    """Of those, blocks only a speculative entry claims."""


@dataclass
class IndexStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    unknown_removals: int = 0
    """BlockRemoved of a hash the index never stored (missed events, or already cleared)."""
    unresolved_parents: int = 0
    """BlockStored whose parent the index does not know: its blocks cannot be keyed."""
    wrong_block_size: int = 0
    skipped_groups: int = 0
    """Events of sliding-window groups, not indexed."""
    clears: int = 0
    speculative_confirmed: int = 0
    speculative_expired: int = 0
    expected_blocks: int = 0
    """Stored blocks whose own keys came from the chain of a placement (`speculate`'s `data`),
    not hashed from their tokens again."""


@dataclass
class _Domain:
    maps: DomainMaps = field(default_factory=lambda: _MAPS())
    """Held masks, parents, held children, broken keys and engine hashes (`DomainMaps`)."""
    tier_counts: dict[int, int] = field(
        default_factory=lambda: dict.fromkeys((GPU, CPU, STORAGE), 0)
    )
    sliding_groups: set[int] = field(default_factory=set)
    speculative: deque[tuple[float, BlockHash]] = field(default_factory=deque)
    """The domain's speculative entries in the order they expire (confirmed and renewed ones
    stay until their turn: `claims` says which are current)."""
    claims: dict[BlockHash, float] = field(default_factory=dict)
    """key -> when the domain's current speculative entry of it expires (`speculate`): a
    float a key in one dict a domain, made and confirmed in C loops, where a dict of domains a
    key (`{domain: expires}`) was made, emptied and freed an entry (~183 a new ~730-block
    prompt at bench point 2)."""
    odd_ends: dict[BlockHash, int] = field(default_factory=dict)
    """The keys of `claims` not at a window's end (a placement's last block, its chain not a
    whole number of windows) -> their index in the chain (their block's in the prompt: keys
    chain from the root): all a store whose place in its chain is known must look up besides
    the windows' ends (`_entry_keys`)."""
    recency: DomainRecency | None = None
    expected: dict[bytes, tuple[bytes, Sequence[BlockHash], int]] = field(default_factory=dict)
    """The key before a placed chain's first block the domain lacked, and that block's token
    bytes (or, for a chain the domain lacked from block 0, that block's key alone: 16 bytes,
    never the length of the others) -> (the chain's token bytes, its keys, that block's
    index): where the engine's store of it will start (`speculate`, `_expected_keys`). The
    block's bytes keep apart the chains of requests in flight that part right after a prefix
    the domain holds (one system prompt ahead of many conversations)."""


class EventIndex:
    """Blocks per domain and tier, from events (see the module docstring for the invariants).

    Pure and synchronous, like `MemoryIndex`: the gateway applies events to it on its event
    loop, so a wipe is applied between two routing decisions, never during one."""

    def __init__(
        self,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        track_recency: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.speculative_ttl_s = speculative_ttl_s
        self.track_recency = track_recency
        self.clock = clock
        """When a store is applied (`track_recency`): the time its blocks were last used."""
        self.stats = IndexStats()
        self._domains: dict[str, _Domain] = {}
        self.on_stored: Callable[[str, list[BlockHash]], None] | None = None
        """Told (domain, own keys) of every applied BlockStored (fan-out holds release on it)."""

    # -- events ----------------------------------------------------------------------------
    def apply(self, domain: str, event: CacheEvent) -> None:
        if isinstance(event, BlockStored):
            keys = self.store(domain, event)
            if keys and self.on_stored is not None:
                self.on_stored(domain, keys)
        elif isinstance(event, BlockRemoved):
            self.remove(domain, event)
        else:
            self.clear(domain)

    def store(self, domain: str, event: BlockStored) -> list[BlockHash]:
        """Index a BlockStored; returns the own keys of its blocks (empty when skipped)."""
        state = self._domain(domain)
        if not event.full_attention:
            if event.group_idx is not None:
                state.sliding_groups.add(event.group_idx)
            self.stats.skipped_groups += 1
            return []
        if event.block_size != self.block_size:
            self.stats.wrong_block_size += 1
            return []
        parent_key: BlockHash | None = None
        if event.parent is not None:
            parent_key = state.maps.own_key(event.parent)
            if parent_key is None:
                self.stats.unresolved_parents += 1
                return []
        expected = self._expected_keys(state, event, parent_key)
        if expected is None:
            keys, first = stored_keys(event, parent_key, self.block_size), None
        else:
            keys, first = expected
        self._hold_all(domain, state, event.block_hashes, keys, event.tier, parent_key, first)
        if self.track_recency and event.tier == GPU:
            self._recency(state).use(keys[: len(event.block_hashes)], self.clock())
        self.stats.stored_blocks += len(keys)
        return keys

    def _expected_keys(
        self, state: _Domain, event: BlockStored, parent_key: BlockHash | None
    ) -> tuple[list[BlockHash], int] | None:
        """The own keys of a store the domain expected (`speculate`'s `data`): the placed
        chain's keys from where the store starts, when its tokens are the chain's there (one
        compare), and the index in the chain of the first; else None, and the caller hashes
        them. A store that ends before the chain
        does leaves the rest expected (a prefill announced in chunks).

        A key names its whole prefix, so the keys of the same tokens after the same key are
        the same: what `stored_keys` would hash again (a ~730-block prompt's 730 hashes at
        bench point 2, ~2% of a precise gateway's py-spy samples)."""
        table = state.expected
        if not table or event.mm_keys:
            return None
        data = token_bytes(event.token_ids)
        width = 4 * self.block_size
        count = len(data) // width
        if count == 0:
            return None
        if parent_key is not None:
            found = table.pop(parent_key + data[:width], None)
        else:
            root = precise_root(event.cache_salt, event.lora_name)
            found = table.pop(chain_hashes(data[:width], root, width)[0], None)
        if found is None:
            return None
        known, chain, start = found
        if start + count > len(chain) or not known.startswith(data, start * width):
            return None
        if start + count < len(chain):
            self._expect(state, known, chain, start + count, width)
        self.stats.expected_blocks += count
        return list(chain[start : start + count]), start

    @staticmethod
    def _expect(
        state: _Domain, data: bytes, keys: Sequence[BlockHash], start: int, width: int
    ) -> None:
        """Expect the domain's engine to store `keys[start:]` (tokens `data`, `width` bytes a
        block) next."""
        table = state.expected
        key = keys[start - 1] + data[start * width : (start + 1) * width] if start else keys[0]
        table.pop(key, None)  # the newest last: the oldest go first
        table[key] = (data, keys, start)
        if len(table) > MAX_EXPECTED_PER_DOMAIN:
            del table[next(iter(table))]

    def remove(self, domain: str, event: BlockRemoved) -> None:
        state = self._domains.get(domain)
        if state is None:
            self.stats.unknown_removals += len(event.block_hashes)
            return
        if event.group_idx is not None and event.group_idx in state.sliding_groups:
            self.stats.skipped_groups += 1
            return
        if event.tier == GPU and not (state.tier_counts[CPU] or state.tier_counts[STORAGE]):
            self._remove_whole(state, event.block_hashes)
            return
        removed, unknown = state.maps.remove_tier(event.block_hashes, event.tier)
        if event.tier == GPU and state.recency is not None:
            deque(map(state.recency.remove, removed), maxlen=0)
        state.tier_counts[event.tier] -= len(removed)
        self.stats.removed_blocks += len(removed)
        self.stats.unknown_removals += unknown

    def _remove_whole(self, state: _Domain, engine_hashes: Sequence[EngineHash]) -> None:
        """`remove` of GPU blocks from a domain holding nothing offloaded, so each block it
        holds leaves it (`DomainMaps.remove_whole`: one loop over the batch, compiled where
        built)."""
        gone, unknown = state.maps.remove_whole(engine_hashes)
        if state.recency is not None:
            deque(map(state.recency.remove, gone), maxlen=0)
        state.tier_counts[GPU] -= len(gone)
        self.stats.removed_blocks += len(gone)
        self.stats.unknown_removals += unknown

    def clear(self, domain: str) -> None:
        """The domain's engine was wiped or restarted: every block of it goes, now."""
        self._domains.pop(domain, None)  # its speculative entries with it
        self.stats.clears += 1

    @staticmethod
    def _recency(state: _Domain) -> DomainRecency:
        if state.recency is None:
            state.recency = DomainRecency()
        return state.recency

    def touch(self, domain: str, keys: Sequence[BlockHash], now_s: float) -> int:
        """A placement on `domain` uses its leading blocks there (`track_recency`): they become
        the newest in its eviction order. Returns how many it held (0 when not tracking)."""
        state = self._domains.get(domain)
        if not self.track_recency or state is None:
            return 0
        return self._recency(state).touch(keys, now_s)

    def eviction_runs(
        self, domain: str, depth: int, now_s: float, exclude: Sequence[BlockHash] = ()
    ) -> tuple[tuple[int, float], ...]:
        """The domain's `depth` next evicted GPU blocks as (num_blocks, idle_s) runs, oldest
        first, but for `exclude` (`DomainRecency.runs`); () when not tracking or unknown."""
        state = self._domains.get(domain)
        if state is None or state.recency is None:
            return ()
        return state.recency.runs(depth, now_s, exclude)

    def _domain(self, domain: str) -> _Domain:
        state = self._domains.get(domain)
        if state is None:
            state = self._domains[domain] = _Domain()
        return state

    def _hold_all(
        self,
        domain: str,
        state: _Domain,
        engine_hashes: Sequence[EngineHash],
        keys: list[BlockHash],
        tier: int,
        parent: BlockHash | None,
        first: int | None = None,
    ) -> None:
        """Hold each (engine hash, own key) pair on `tier`, confirming speculative entries;
        a key newly held counts as a held child of its parent (the first key's is `parent`).
        `first`: the index of `keys[0]` in its chain, when known (an expected store).

        The domain's maps take the chain in one call (`DomainMaps.hold`: one C loop over it
        where the table is built)."""
        n = min(len(engine_hashes), len(keys))
        if n < len(keys):
            keys = keys[:n]
        new = state.maps.hold(engine_hashes, keys, tier, parent)
        state.tier_counts[tier] += new
        claims = state.claims
        if claims:  # the domain's entries of these keys are confirmed
            before = len(claims)
            found = self._entry_keys(state, keys, first)
            deque(map(claims.pop, found, repeat(None)), maxlen=0)
            if state.odd_ends:
                deque(map(state.odd_ends.pop, found, repeat(None)), maxlen=0)
            self.stats.speculative_confirmed += before - len(claims)

    @staticmethod
    def _entry_keys(state: _Domain, keys: list[BlockHash], first: int | None) -> list[BlockHash]:
        """The keys of a store that may have speculative entries: every one when its place in
        the chain is unknown (`first` None); else the windows' ends among them and the odd
        ends (`_Domain.odd_ends`) they hold. An entry is only ever made for those, so the
        others' lookups (~3 in 4 keys, each a cold `bytes` hashed and probed: ~0.3 us a key
        live, ~0.2 ms a request at bench point 2) find nothing."""
        odd = state.odd_ends
        if first is None or len(odd) > len(keys):
            return keys
        stride = SPECULATIVE_STRIDE
        out = keys[(stride - 1 - first) % stride :: stride]
        stop = first + len(keys)
        for key, i in odd.items():
            if first <= i < stop and keys[i - first] == key:
                out.append(key)
        return out

    @staticmethod
    def _drop_entry(state: _Domain, key: BlockHash) -> None:
        """The domain's speculative entry of `key` goes (expired)."""
        del state.claims[key]
        if state.odd_ends:
            state.odd_ends.pop(key, None)

    # -- speculation -----------------------------------------------------------------------
    def speculate(
        self, domain: str, keys: Sequence[BlockHash], now_s: float, data: bytes | None = None
    ) -> int:
        """Count the chain `keys` as held by `domain` until the event comes or
        `speculative_ttl_s` passes: an entry for the last key of each window of
        `SPECULATIVE_STRIDE` (and the last key) where the domain's GPU lacks any block of the
        window; returns how many entries were added. `data`: the token bytes `keys` chain
        (`token_bytes`, no images): the store of the blocks the domain lacks takes its keys
        from them (`_expected_keys`).

        The leading run the domain holds on its GPU is found without a Python step per key
        (`_gpu_masks`): a continuation's blocks are all held but its last turn's, and stepping
        through them was ~6% of a precise gateway's CPU on conversations (py-spy). A run
        found (no key of the chain broken, no tier offloaded) is all the domain holds of the
        chain (held chains are prefix-closed but where a key is broken: the module docstring;
        the bisection relies on it too), so every window from the run's on lacks a block, and
        the entries are made in C loops (`_speculate_past`): a Python step a window of a new
        ~730-block prompt was ~3% of a precise gateway's samples at bench point 2 (py-spy),
        and checking that no key past the run is held a table probe a key (~0.15 ms a new
        prompt with the table's records out of the caches, as live between batches)."""
        state = self._domain(domain)
        self.sweep(domain, now_s)
        expires = now_s + self.speculative_ttl_s
        n = len(keys)
        run = self._held_run(domain, state, keys)  # without offloaded tiers: the GPU's run
        if run is not None and run < n:  # none held past the run (a run: no key broken)
            added = self._speculate_past(state, keys, run, expires)
        else:
            added = self._speculate_each(state, keys, run, expires)
        if data is not None and run is not None and run < n:
            self._expect(state, data, keys, run, 4 * self.block_size)
        while len(state.speculative) > MAX_SPECULATIVE_PER_DOMAIN:
            self._expire_one(state, float("inf"))
        return added

    @staticmethod
    def _speculate_past(state: _Domain, keys: Sequence[BlockHash], run: int, expires: float) -> int:
        """`speculate` where the domain holds `keys[:run]` and none after: an entry for the
        last key of every window from `run`'s, each window's in C loops."""
        n = len(keys)
        stride = SPECULATIVE_STRIDE
        base = run - run % stride
        ends = list(keys[base + stride - 1 : n : stride])
        if (n - base) % stride:  # the last window is partial: its last key
            ends.append(keys[n - 1])
            state.odd_ends[keys[n - 1]] = n - 1
        state.claims.update(zip(ends, repeat(expires)))  # new or renewed alike
        state.speculative.extend(zip(repeat(expires), ends))
        return len(ends)

    def _speculate_each(
        self,
        state: _Domain,
        keys: Sequence[BlockHash],
        run: int | None,
        expires: float,
    ) -> int:
        """`speculate` window by window: held keys past the run, or offloaded tiers (`run`
        None)."""
        n = len(keys)
        stride = SPECULATIVE_STRIDE
        if run is None:
            gpu = self._gpu_masks(state, keys)
            start = _first(gpu, 0, 0, n)
            base = start - start % stride
            gpu = gpu[base:]
        else:
            base = run - run % stride
            gpu = self._gpu_masks(state, keys[base:])
        claims = state.claims
        append = state.speculative.append
        added = 0
        for low in range(base, n, stride):
            end = min(low + stride, n)
            if 0 not in gpu[low - base : end - base]:
                continue
            key = keys[end - 1]
            claims[key] = expires
            if end % stride:  # the chain's last key, not a window's end
                state.odd_ends[key] = end - 1
            append((expires, key))
            added += 1
        return added

    @staticmethod
    def _gpu_masks(state: _Domain, keys: Sequence[BlockHash]) -> list[int]:
        """Per key, its GPU bit on the domain (0 when not held there on a GPU), in C loops."""
        return list(map(and_, state.maps.masks(keys), repeat(GPU)))

    def sweep(self, domain: str, now_s: float) -> None:
        """Expire the domain's speculative entries whose time has passed (counted)."""
        state = self._domains.get(domain)
        while state is not None and state.speculative and state.speculative[0][0] <= now_s:
            self._expire_one(state, now_s)

    def _expire_one(self, state: _Domain, now_s: float) -> None:
        expires, key = state.speculative.popleft()
        if state.claims.get(key) == expires:  # not confirmed nor renewed
            self._drop_entry(state, key)
            if expires <= now_s:
                self.stats.speculative_expired += 1

    # -- reading ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockHash], now_s: float) -> dict[str, Match]:
        """domain -> its match of the chain `keys` (domains matching nothing are absent).

        A domain's depth is its leading run of keys it holds (any tier) or claims (`_claim`:
        an unexpired speculative entry of the key or of a later key of its window). Runs of
        held keys are found by `list.index` over a membership list built by `map` (C loops);
        only claimed stretches and domains with offloaded tiers step in Python. Stepping every
        key in Python was ~12% of a precise gateway's CPU on conversations (py-spy: ~1.7 µs
        per 16-token block)."""
        if not keys:
            return {}
        first = keys[0]
        domains = [d for d, state in self._domains.items() if state.maps.holds(first)]
        head = keys[:SPECULATIVE_STRIDE]
        for d, claiming in self._domains.items():
            claims = claiming.claims
            if claims and d not in domains and any(claims.get(k, 0.0) > now_s for k in head):
                domains.append(d)
        if not domains:
            return {}
        matches = {}
        for d in domains:
            state = self._domains.get(d)
            run = self._held_run(d, state, keys)
            if run is None:  # key by key (offloaded tiers, or a broken key in the chain)
                assert state is not None
                match = self._match(d, state, keys, now_s)
            else:
                match = self._match_from(d, state, keys, run, now_s)
            if match.depth:
                matches[d] = match
        return matches

    def _held_run(
        self, domain: str, state: _Domain | None, keys: Sequence[BlockHash]
    ) -> int | None:
        """The leading run of `keys` the domain holds, by bisection, when its held keys along
        the chain are a leading run (no broken key in it) and none is offloaded; else None."""
        if state is None:
            return 0
        if state.tier_counts[CPU] or state.tier_counts[STORAGE]:
            return None
        return state.maps.held_run(keys)

    def _match_from(
        self, domain: str, state: _Domain | None, keys: Sequence[BlockHash], run: int, now_s: float
    ) -> Match:
        """One domain's match (`lookup`) given the leading run it holds, no tier offloaded:
        past the run only a speculative claim can go on, and only then is the rest read."""
        n = len(keys)
        if run == n or self._claim(domain, keys, run, now_s) < 0:
            return Match(run, 0, 0)
        masks = state.maps.masks(keys[run:]) if state is not None else [0] * (n - run)
        member = [True] * run + list(map(bool, masks))
        return self._walk(domain, keys, member, None, run, now_s)

    def _claim(self, domain: str, keys: Sequence[BlockHash], i: int, now_s: float) -> int:
        """The last position of `i`'s window claimed with `i` by an unexpired speculative
        entry of `domain` (the deepest such key from `i` to the window's end), or -1."""
        state = self._domains.get(domain)
        if state is None or not state.claims:
            return -1
        claims = state.claims
        for p in range(
            min(i - i % SPECULATIVE_STRIDE + SPECULATIVE_STRIDE, len(keys)) - 1, i - 1, -1
        ):
            if claims.get(keys[p], 0.0) > now_s:
                return p
        return -1

    def _match(self, domain: str, state: _Domain, keys: Sequence[BlockHash], now_s: float) -> Match:
        """One domain's match (`lookup`): held runs by C loops, claimed windows stepped."""
        masks = state.maps.masks(keys)
        member = list(map(bool, masks))
        off_tiers = bool(state.tier_counts[CPU] or state.tier_counts[STORAGE])
        return self._walk(domain, keys, member, masks if off_tiers else None, 0, now_s)

    def _walk(
        self,
        domain: str,
        keys: Sequence[BlockHash],
        member: list[bool],
        masks: list[int] | None,
        i: int,
        now_s: float,
    ) -> Match:
        """Runs of held keys (`member`) and claimed windows from key `i`; `masks`: every key's
        tier mask on the domain when it has offloaded tiers to count (else None)."""
        n = len(keys)
        offloaded = speculative = 0
        while i < n:
            j = _first(member, False, i, n)
            if masks is not None:
                offloaded += self._offloaded(domain, keys, masks, i, j, now_s)
            i = j
            if i == n:
                break
            claimed = self._claim(domain, keys, i, now_s)
            if claimed < 0:
                return Match(i, offloaded, speculative)
            speculative += member[i : claimed + 1].count(False)
            i = claimed + 1
        return Match(n, offloaded, speculative)

    def _offloaded(
        self,
        domain: str,
        keys: Sequence[BlockHash],
        masks: list[int],
        start: int,
        stop: int,
        now_s: float,
    ) -> int:
        """Held keys in [start, stop) on no GPU of `domain` and not claimed speculatively."""
        count = 0
        for i in range(start, stop):
            if not masks[i] & GPU and self._claim(domain, keys, i, now_s) < 0:
                count += 1
        return count

    def own_key(self, domain: str, engine_hash: EngineHash) -> BlockHash | None:
        """The own key the domain's block `engine_hash` was indexed under (None: unknown)."""
        state = self._domains.get(domain)
        return state.maps.own_key(engine_hash) if state is not None else None

    def num_blocks(self, domain: str, tier: int = GPU) -> int:
        state = self._domains.get(domain)
        return state.tier_counts[tier] if state is not None else 0

    def num_speculative(self, domain: str) -> int:
        state = self._domains.get(domain)
        return len(state.speculative) if state is not None else 0

    def domains(self) -> list[str]:
        return sorted(self._domains)
