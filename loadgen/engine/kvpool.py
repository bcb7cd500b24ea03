"""The simulated engine's KV cache: a GPU block pool shared by running requests and the prefix
cache, an optional CPU tier behind it, and the cache events both emit.

`BlockPool` keeps vLLM's accounting (`vllm/v1/core/block_pool.py`):

    capacity = held + private + free         free = empty + cached
    held     blocks with a hash that running requests reference (ref count > 0)
    private  blocks running requests own without a (new) hash: being computed, a duplicate of a
             block already cached, or reserved for tokens not yet generated
    cached   blocks nobody references that keep their hash: a later request may hit them; they
             are evicted (LRU at the front; a chain's tail first) only when a block is allocated

So `usage` = (held + private) / capacity, what `vllm:kv_cache_usage_perc` reports: cached
blocks count as free. A request's blocks are allocated when its prefill starts, hashed ("stored")
when the tokens they hold exist, and released when it ends; released blocks stay cached.

`CpuTier` is write-through offloading, as vLLM's OffloadingConnector and SGLang's HiCache are:
every block stored on the GPU is stored on the CPU too (unless already there); a block evicted
from the GPU stays on the CPU until the CPU tier's own LRU evicts it.

Invariants (asserted): held + private + cached <= capacity; a hash is held or cached, never
both; every event describes a change that happened, in order: a block is announced stored once
per medium while it stays there, removed when it leaves, and reused blocks are not announced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cachemap.multimodal import MMKey

GPU = "GPU"
CPU = "CPU"
"""Medium names as vLLM spells them (an encoder may rename them, e.g. SGLang's CPU_PINNED)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks that now hold KV on `medium`: a chain continuing `parent` (None at block 0)."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    cache_salt: str | None = None
    """The request's salt when `hashes[0]` is block 0 of its chain (vLLM puts it in that block's
    `extra_keys`), else None."""
    lora_name: str | None = None
    """The LoRA adapter the blocks were computed with (vLLM's `lora_name`, also in every block's
    `extra_keys`), None for the base model."""
    mm_keys: tuple[tuple[MMKey, ...], ...] = ()
    """Per block, the images whose placeholders it holds, (identifier, offset): vLLM's
    multimodal extra keys (empty: no block has one)."""


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[bytes, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block of every medium is gone (`/reset_prefix_cache`)."""


CacheEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a Stored event says about one block: its place in the chain and its tokens."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora_name: str | None = None
    mm_keys: tuple[MMKey, ...] = ()


def _mm_keys(info: Sequence[BlockInfo]) -> tuple[tuple[MMKey, ...], ...]:
    keys = tuple(i.mm_keys for i in info)
    return keys if any(keys) else ()


@dataclass
class EventLog:
    """Events waiting for the publisher; `take()` hands them over (once per engine step)."""

    events: list[CacheEvent] = field(default_factory=list)

    def take(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out


class CpuTier:
    """The CPU offload tier: an LRU of block hashes at a fixed capacity."""

    def __init__(self, capacity_blocks: int, log: EventLog | None) -> None:
        if capacity_blocks < 1:
            raise ValueError("cpu offload capacity must be at least 1 block")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._log = log
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` present; touches them (they are about to be loaded)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        for h in reversed(hashes[:n]):
            self._lru.move_to_end(h)
        return n

    def store(self, hashes: Sequence[bytes], info: Sequence[BlockInfo], block_size: int) -> None:
        """Write-through: the blocks not on the CPU yet are copied there, one event per run."""
        new = [i for i, h in enumerate(hashes) if h not in self._lru]
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        if self._log is not None:
            for run in _runs(new):
                first, last = run[0], run[-1] + 1
                self._log.events.append(
                    Stored(
                        tuple(hashes[first:last]),
                        info[first].parent,
                        tuple(t for i in info[first:last] for t in i.token_ids),
                        block_size,
                        CPU,
                        info[first].cache_salt,
                        info[first].lora_name,
                        _mm_keys(info[first:last]),
                    )
                )
        evicted: list[bytes] = []
        while len(self._lru) > self.capacity_blocks:
            evicted.append(self._lru.popitem(last=False)[0])
        self.num_evictions += len(evicted)
        if evicted and self._log is not None:
            self._log.events.append(Removed(tuple(evicted), CPU))

    def clear(self) -> None:
        self._lru.clear()


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indices: [0, 1, 3] -> [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class BlockPool:
    """GPU KV blocks; see the module docstring for the accounting and its invariants."""

    def __init__(
        self, capacity_blocks: int, cpu_blocks: int = 0, *, record_events: bool = False
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self.capacity_blocks = capacity_blocks
        self.log = EventLog() if record_events else None
        self.cpu = CpuTier(cpu_blocks, self.log) if cpu_blocks > 0 else None
        self._held: dict[bytes, int] = {}
        self._cached: OrderedDict[bytes, None] = OrderedDict()
        self.num_private = 0
        self.num_evictions = 0
        self.version = 0
        """Bumped by every change of what is held, cached or free: a scheduler that found the
        pool too full for a request need not look again until it moves."""

    # -- what is there ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Blocks holding a hash, held or cached: what a later request could hit."""
        return len(self._held) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._held) + self.num_private

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: the empty ones and the cached (evictable) ones."""
        return self.capacity_blocks - self.num_used

    @property
    def num_empty(self) -> int:
        """Free blocks holding no hash: what an allocation takes before it evicts anything."""
        return self.capacity_blocks - self.num_used - len(self._cached)

    def eviction_order(self) -> Iterator[bytes]:
        """The cached (evictable) hashes, next evicted first: the engine's eviction frontier."""
        return iter(self._cached)

    @property
    def usage(self) -> float:
        """vLLM's `get_usage()`: the share of blocks running requests use (cached ones are free)."""
        return self.num_used / self.capacity_blocks

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held or block_hash in self._cached

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` on the GPU (held by someone or cached); no side effect."""
        n = 0
        for h in hashes:
            if h not in self._held and h not in self._cached:
                break
            n += 1
        return n

    def num_cached_among(self, hashes: Sequence[bytes]) -> int:
        """How many of these (present) blocks are cached, not held: acquiring them uses free
        blocks."""
        return sum(1 for h in hashes if h in self._cached)

    # -- a request's life -------------------------------------------------------------------
    def acquire(self, hashes: Sequence[bytes]) -> None:
        """A request starts using these cached blocks (a hit): they are no longer evictable."""
        self.version += 1
        for h in hashes:
            refs = self._held.get(h)
            if refs is None:
                del self._cached[h]
                self._held[h] = 1
            else:
                self._held[h] = refs + 1

    def allocate(self, num_blocks: int) -> None:
        """Take `num_blocks` private blocks: empty ones first, then cached ones, LRU first
        (each eviction announced). The caller checked `num_free`."""
        assert num_blocks <= self.num_free, "allocate beyond the free blocks"
        self.version += 1
        empty = self.num_empty
        evicted: list[bytes] = []
        for _ in range(max(num_blocks - empty, 0)):
            evicted.append(self._cached.popitem(last=False)[0])
        self.num_evictions += len(evicted)
        if evicted and self.log is not None:
            self.log.events.append(Removed(tuple(evicted), GPU))
        self.num_private += num_blocks

    def commit(
        self, hashes: Sequence[bytes], info: Sequence[BlockInfo], block_size: int
    ) -> list[bytes]:
        """Private blocks of one request now hold these blocks' KV: each gets its hash and is
        announced, unless the hash is already on the GPU (a sibling computed it meanwhile: the
        copy stays private, as vLLM keeps duplicates, and nothing is announced). Returns the
        hashes the request now holds."""
        self.version += 1
        taken: list[int] = []
        for i, h in enumerate(hashes):
            if h in self._held or h in self._cached:
                continue
            self._held[h] = 1
            taken.append(i)
        self.num_private -= len(taken)
        assert self.num_private >= 0
        if taken and self.log is not None:
            for run in _runs(taken):
                first, last = run[0], run[-1] + 1
                self.log.events.append(
                    Stored(
                        tuple(hashes[first:last]),
                        info[first].parent,
                        tuple(t for i in info[first:last] for t in i.token_ids),
                        block_size,
                        GPU,
                        info[first].cache_salt,
                        info[first].lora_name,
                        _mm_keys(info[first:last]),
                    )
                )
        if self.cpu is not None and hashes:
            self.cpu.store(hashes, info, block_size)
        return [hashes[i] for i in taken]

    def release(self, held: Sequence[bytes], num_private: int) -> None:
        """A request ended: its referenced blocks lose a reference (cached once nobody holds
        them, the chain's tail nearest eviction) and its private blocks become empty."""
        self.version += 1
        for h in reversed(held):
            refs = self._held[h] - 1
            if refs:
                self._held[h] = refs
            else:
                del self._held[h]
                self._cached[h] = None
        self.num_private -= num_private
        assert self.num_private >= 0

    def reset(self) -> bool:
        """Drop every hash, GPU and CPU (vLLM's `reset_prefix_cache`), announced as one
        AllBlocksCleared. Like vLLM it refuses (returns False, changes nothing) while running
        requests use blocks: their hashes could not be forgotten without lying about them."""
        if self.num_used:
            return False
        self.version += 1
        self._cached.clear()
        if self.cpu is not None:
            self.cpu.clear()
        if self.log is not None:
            self.log.events.append(Cleared())
        return True
