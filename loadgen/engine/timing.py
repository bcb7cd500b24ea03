"""The simulated engine's timing model and scheduler, in any clock: real (the engine server) or
virtual (the discrete-event simulator). One module, so both measure the same engine.

The model (defaults in `TimingModel`; every duration is divided by `time_scale`):
- Prefill runs one request at a time, first come first served (vLLM's scheduler fills its token
  budget FCFS): a request's prefill takes uncached_tokens / prefill_tokens_per_s.
- The cache lookup happens when a request's prefill STARTS, and its blocks enter the cache when
  the prefill ENDS (the first token): a sibling that starts before then misses, as on vLLM.
- A request holds one of `max_batch` batch slots from prefill start to its last token; when all
  slots are taken, the head of the queue waits (and everything behind it).
- Decoding costs decode_s_per_token per output token for each member of the batch, independent
  of batch size (decode is memory-bound): the batch shares the engine's step, not its time.
  The first token comes with the end of prefill; the last one (n-1) steps later.
- The KV cache (`PrefixCache`) is paged and LRU at a fixed capacity in blocks. When a request
  finishes, the full blocks of prompt + output enter it too (`Job.final_hashes`), as vLLM keeps
  generated tokens' KV: a client that sends the reply back in its next turn hits on it.

Invariants: for every job, cached + uncached = prompt tokens; start <= first_token <= finish;
at most `max_batch` jobs hold slots; events come out in time order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_PREFILL_TOKENS_PER_S = 13_000.0
"""An H100 prefilling an 8B model, roughly (the figure the issue's independent replay used)."""
DEFAULT_DECODE_S_PER_TOKEN = 0.020
"""20 ms per output token: a loaded batch on the same GPU."""
DEFAULT_MAX_BATCH = 64
DEFAULT_CAPACITY_BLOCKS = 8_192
"""8,192 blocks of 16 tokens = 131k tokens of KV: ~10 twelve-thousand-token conversations."""
DEFAULT_BLOCK_SIZE = 16
"""vLLM's default block size, in tokens."""


@dataclass(frozen=True)
class TimingModel:
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_s_per_token: float = DEFAULT_DECODE_S_PER_TOKEN
    max_batch: int = DEFAULT_MAX_BATCH
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if self.decode_s_per_token < 0:
            raise ValueError("decode_s_per_token must be non-negative")
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")

    def prefill_s(self, uncached_tokens: float) -> float:
        return uncached_tokens / self.prefill_tokens_per_s / self.time_scale

    def decode_s(self, output_tokens: int) -> float:
        return max(output_tokens, 0) * self.decode_s_per_token / self.time_scale


class PrefixCache:
    """A paged prefix cache: block hash -> present, LRU at the front.

    A chain is touched tail first, so on ties the longer chain's tail is evicted first and a
    prefix never outlives nothing but its own descendants (vLLM's free-block queue order).
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks present; touches them (they are about to be used)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        for h in reversed(hashes[:n]):
            self._lru.move_to_end(h)
        return n

    def insert(self, hashes: Sequence[bytes]) -> None:
        lru = self._lru
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
            self.num_evictions += 1

    def clear(self) -> None:
        self._lru.clear()


@dataclass
class Job:
    """One request inside the engine. Times are in the core's clock."""

    id: str
    block_hashes: Sequence[bytes]
    num_prompt_tokens: int
    num_output_tokens: int
    block_size: int
    max_cached_tokens: int
    final_hashes: Sequence[bytes] = ()
    arrival_s: float = 0.0
    cached_tokens: int = 0
    start_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    aborted: bool = False

    @property
    def uncached_tokens(self) -> int:
        return self.num_prompt_tokens - self.cached_tokens


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    busy_prefill_s: float = 0.0
    busy_decode_s: float = 0.0


FIRST_TOKEN = "first_token"
FINISHED = "finished"


@dataclass
class EngineCore:
    """The scheduler: jobs in, (time, kind, job) events out, driven by any clock.

    Call `submit(now, job)`, then `advance(t)` at or after `next_event_time()`; `advance`
    returns the events up to t in order.
    """

    model: TimingModel
    cache: PrefixCache
    counters: EngineCounters = field(default_factory=EngineCounters)

    def __post_init__(self) -> None:
        self._waiting: deque[Job] = deque()
        self._prefilling: Job | None = None
        self._slots_used = 0
        self._events: list[tuple[float, int, str, Job]] = []
        self._seq = 0

    @property
    def num_running(self) -> int:
        return self._slots_used

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, now: float, job: Job) -> None:
        job.arrival_s = now
        self._waiting.append(job)
        self._maybe_start(now)

    def abort(self, now: float, job: Job) -> None:
        """The client went away: a queued job leaves; a running one frees its slot early."""
        if job.aborted or (job.finish_s is not None and job.finish_s <= now):
            return
        job.aborted = True
        self.counters.requests_aborted += 1
        if job.start_s is None:
            self._waiting.remove(job)
        elif job is not self._prefilling:
            self._slots_used -= 1
            self._maybe_start(now)
        # a job in prefill finishes its prefill (the KV is still written), then frees its slot

    def next_event_time(self) -> float | None:
        return self._events[0][0] if self._events else None

    def advance(self, now: float) -> list[tuple[float, str, Job]]:
        out: list[tuple[float, str, Job]] = []
        while self._events and self._events[0][0] <= now:
            t, _, kind, job = heapq.heappop(self._events)
            if kind == FIRST_TOKEN:
                self._prefilling = None
                self.cache.insert(job.block_hashes)
                if job.aborted:
                    self._slots_used -= 1
                else:
                    self._push(job.finish_s or t, FINISHED, job)
                    out.append((t, FIRST_TOKEN, job))
            elif not job.aborted:
                if job.final_hashes:
                    self.cache.insert(job.final_hashes)
                self._slots_used -= 1
                self.counters.requests_finished += 1
                self.counters.generation_tokens += job.num_output_tokens
                out.append((t, FINISHED, job))
            self._maybe_start(t)
        return out

    def _push(self, t: float, kind: str, job: Job) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, job))

    def _maybe_start(self, now: float) -> None:
        if self._prefilling is not None or not self._waiting:
            return
        if self._slots_used >= self.model.max_batch:
            return
        job = self._waiting.popleft()
        matched = self.cache.match(job.block_hashes)
        job.cached_tokens = min(matched * job.block_size, job.max_cached_tokens)
        job.start_s = now
        prefill = self.model.prefill_s(job.uncached_tokens)
        decode = self.model.decode_s(job.num_output_tokens - 1)
        job.first_token_s = now + prefill
        job.finish_s = job.first_token_s + decode
        self._prefilling = job
        self._slots_used += 1
        c = self.counters
        c.prompt_tokens += job.num_prompt_tokens
        c.cached_tokens += job.cached_tokens
        c.busy_prefill_s += prefill
        c.busy_decode_s += decode
        self._push(job.first_token_s, FIRST_TOKEN, job)
