"""The simulated engine's timing model and scheduler, in any clock: real (the engine server) or
virtual (the discrete-event simulator). One module, so both measure the same engine.

The model (defaults in `TimingModel`; every duration is divided by `time_scale`):
- Prefill runs one request at a time, first come first served (vLLM's scheduler fills its token
  budget FCFS): uncached_tokens / prefill_tokens_per_s, plus cpu_hit_cost_frac of that rate for
  each token loaded from the CPU tier. Prefill does not stall decode (vLLM's chunked prefill
  mixes the two in one step; here they are two servers).
- The cache lookup happens when a request's prefill STARTS, and its prompt blocks are stored
  when the prefill ENDS (the first token): a sibling that starts before then misses, as on vLLM.
- Decode runs in steps. Every request past its first token joins the next step; a step gives
  each member one token and lasts

      step_s = decode_s_per_token + decode_s_per_seq × batch
               + decode_s_per_context_token × Σ context

  (context = a member's prompt + tokens so far). Calibrated to Llama-3.1-8B on one H100 with
  vLLM: a median TPOT of 6.48 ms at concurrency 1, 6.59 ms at 4 and 10.94 ms at 16 on short
  prompts (InferenceBench's concurrency-sweep recipe, vLLM 0.21, H100-80GB HBM3): a fixed 5.8 ms
  (reading 16 GB of weights at ~3 TB/s) plus 0.3 ms per sequence gives 6.1 / 7.0 / 10.6 ms; the
  context term is the KV read, 128 KiB per token (32 layers × 8 KV heads × 128 dims × K and V ×
  2 bytes) at 3.35 TB/s ≈ 0.039 µs per token. The same shape holds on an A100 40GB: ~75 tokens/s
  at concurrency 1, nearly flat to 8, climbing after (a vLLM 0.23 sweep, 1024 in / 128 out).
- A request holds one of `max_batch` slots from prefill start to its last token, and KV blocks
  (`kvpool.BlockPool`) for its prompt and all of its `num_output_tokens` from prefill start to
  its last token: cache capacity is shared between what is cached and what is running. A queue
  head that cannot get its slot or its blocks waits, and everything behind it. Decision (vLLM
  allocates as a request grows and preempts the newest one when a step finds no free block;
  SGLang reserves an estimate of the new tokens): the whole request is reserved up front, so
  nothing is ever preempted (`vllm:num_preemptions` stays 0, truthfully), at the price of
  admitting a little less than vLLM would while outputs are still short. A request larger than
  the whole cache holds all of it and runs alone.
- Output blocks are stored as they fill (the step that generates a block's last token), so the
  reply's KV is cached when the client sends it back in its next turn.

Invariants: for every job, cached + uncached = prompt tokens; start <= first_token <= finish;
at most `max_batch` jobs hold slots; blocks used <= capacity; events come out in time order;
a step with more members, or more context, never takes less time.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cachemap.multimodal import Placeholder, blocks_mm_keys
from loadgen.engine.kvpool import BlockInfo, BlockPool

DEFAULT_PREFILL_TOKENS_PER_S = 13_000.0
"""An H100 prefilling an 8B model, roughly (the figure the issue's independent replay used)."""
DEFAULT_DECODE_S_PER_TOKEN = 0.0058
"""A decode step's fixed cost: the weights read once per step (see the module docstring)."""
DEFAULT_DECODE_S_PER_SEQ = 0.0003
"""What each sequence in the batch adds to a step (the H100 sweep: +4.5 ms from 1 to 16)."""
DEFAULT_DECODE_S_PER_CONTEXT_TOKEN = 3.9e-8
"""Reading one token's KV (128 KiB for an 8B Llama) at 3.35 TB/s."""
DEFAULT_CPU_HIT_COST_FRAC = 0.07
"""A block loaded from the CPU costs 7% of prefilling it: 128 KiB per token over PCIe at
~25 GB/s is 5.2 µs, against 77 µs per token of prefill at 13,000 tokens/s."""
DEFAULT_MAX_BATCH = 64
DEFAULT_CAPACITY_BLOCKS = 8_192
"""8,192 blocks of 16 tokens = 131k tokens of KV: ~10 twelve-thousand-token conversations."""
DEFAULT_BLOCK_SIZE = 16
"""vLLM's default block size, in tokens."""


@dataclass(frozen=True)
class TimingModel:
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_s_per_token: float = DEFAULT_DECODE_S_PER_TOKEN
    """A step's fixed cost: the time per output token of a batch of one with no context."""
    max_batch: int = DEFAULT_MAX_BATCH
    time_scale: float = 1.0
    decode_s_per_seq: float = DEFAULT_DECODE_S_PER_SEQ
    decode_s_per_context_token: float = DEFAULT_DECODE_S_PER_CONTEXT_TOKEN
    cpu_hit_cost_frac: float = DEFAULT_CPU_HIT_COST_FRAC

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        for name in ("decode_s_per_token", "decode_s_per_seq", "decode_s_per_context_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative")
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if not 0 <= self.cpu_hit_cost_frac <= 1:
            raise ValueError("cpu_hit_cost_frac must be between 0 and 1")

    def prefill_s(self, uncached_tokens: float, cpu_tokens: float = 0.0) -> float:
        tokens = uncached_tokens + cpu_tokens * self.cpu_hit_cost_frac
        return tokens / self.prefill_tokens_per_s / self.time_scale

    def step_s(self, num_seqs: int, context_tokens: int) -> float:
        """One decode step of `num_seqs` sequences holding `context_tokens` tokens of KV."""
        cost = (
            self.decode_s_per_token
            + self.decode_s_per_seq * num_seqs
            + self.decode_s_per_context_token * context_tokens
        )
        return cost / self.time_scale


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode step model's flags (`loadgen.engine.timing`), shared with `kvgate engine`."""
    parser.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=DEFAULT_DECODE_S_PER_TOKEN * 1e3,
        help="a decode step's fixed cost (ms): the time per token of a batch of one",
    )
    parser.add_argument(
        "--decode-ms-per-seq",
        type=float,
        default=DEFAULT_DECODE_S_PER_SEQ * 1e3,
        help="what each sequence in the batch adds to a step (ms)",
    )
    parser.add_argument(
        "--decode-us-per-context-token",
        type=float,
        default=DEFAULT_DECODE_S_PER_CONTEXT_TOKEN * 1e6,
        help="what each token of the batch's context adds to a step (µs)",
    )


def decode_from_args(args: argparse.Namespace) -> dict[str, float]:
    """TimingModel keyword arguments from `add_decode_arguments`' flags."""
    return {
        "decode_s_per_token": args.decode_ms_per_token / 1e3,
        "decode_s_per_seq": args.decode_ms_per_seq / 1e3,
        "decode_s_per_context_token": args.decode_us_per_context_token / 1e6,
    }


def describe_decode(t: TimingModel) -> str:
    """The step model in one line, for a command's header."""
    return (
        f"decode step {t.decode_s_per_token * 1e3:g} ms + {t.decode_s_per_seq * 1e3:g} ms per "
        f"sequence + {t.decode_s_per_context_token * 1e6:g} µs per context token"
    )


class PrefixCache:
    """A plain LRU of block hashes (the simulator's references: one cache seeing everything).

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


@dataclass(eq=False)
class Job:
    """One request inside the engine. Times are in the core's clock."""

    id: str
    block_hashes: Sequence[bytes]
    """The prompt's full blocks."""
    num_prompt_tokens: int
    num_output_tokens: int
    block_size: int
    max_cached_tokens: int
    final_hashes: Sequence[bytes] = ()
    """Full blocks of prompt + output (empty: only the prompt's are stored)."""
    token_ids: Sequence[int] = ()
    """Prompt + output token ids, for the events' `token_ids` (empty: the events carry none)."""
    cache_salt: str | None = None
    lora_name: str | None = None
    """The LoRA adapter the request names as its model (None: the base model)."""
    images: tuple[Placeholder, ...] = ()
    """Each image's placeholder span in `token_ids`: the events' multimodal extra keys."""
    arrival_s: float = 0.0
    cached_tokens: int = 0
    cpu_cached_tokens: int = 0
    """The part of `cached_tokens` loaded from the CPU tier."""
    num_external_blocks: int = 0
    """Leading prompt blocks a KV connector pulled from a remote prefill instance before the
    job was submitted (`loadgen.engine.disagg`): they cost no prefill, as local hits do."""
    external_tokens: int = 0
    """The part of `cached_tokens` the connector supplied (not the engine's own prefix cache)."""
    start_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    num_generated: int = 0
    aborted: bool = False
    held: list[bytes] = field(default_factory=list, repr=False)
    """Hashed blocks this job references (a cache hit or blocks it stored)."""
    num_private: int = 0
    num_matched: int = 0
    """Prompt blocks found on the GPU at prefill start."""
    next_block: int = 0
    """Index in `final_hashes` of the next block to store."""

    @property
    def uncached_tokens(self) -> int:
        return self.num_prompt_tokens - self.cached_tokens

    @property
    def context_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated

    @property
    def num_blocks(self) -> int:
        """Blocks the whole request needs: prompt and every output token."""
        return -(-(self.num_prompt_tokens + self.num_output_tokens) // self.block_size)


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cpu_cached_tokens: int = 0
    external_tokens: int = 0
    """Prompt tokens a KV connector pulled from a remote prefill instance."""
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    busy_prefill_s: float = 0.0
    busy_decode_s: float = 0.0
    """Seconds the decode server spent in steps (a step serves its whole batch at once)."""
    num_steps: int = 0


FIRST_TOKEN = "first_token"
TOKEN = "token"
FINISHED = "finished"


@dataclass
class EngineCore:
    """The scheduler: jobs in, (time, kind, job) events out, driven by any clock.

    Call `submit(now, job)`, then `advance(t)` at or after `next_event_time()`; `advance`
    returns the events up to t in order: FIRST_TOKEN, then (with `stream_tokens`) one TOKEN per
    decode step, and FINISHED with the last token.
    """

    model: TimingModel
    cache: BlockPool
    counters: EngineCounters = field(default_factory=EngineCounters)
    stream_tokens: bool = False

    def __post_init__(self) -> None:
        self._waiting: deque[Job] = deque()
        self._prefilling: Job | None = None
        self._batch: list[Job] = []
        self._joining: list[Job] = []
        self._step_start = 0.0
        self._step_end: float | None = None
        self._context = 0
        self._slots_used = 0
        self._blocked: tuple[Job, int] | None = None
        """The queue head that found too few free blocks, and the pool's version then."""

    @property
    def num_running(self) -> int:
        return self._slots_used

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        """Members of the decode step now running."""
        return len(self._batch)

    def submit(self, now: float, job: Job) -> None:
        job.arrival_s = now
        self._waiting.append(job)
        self._maybe_start(now)

    def abort(self, now: float, job: Job) -> None:
        """The client went away: a queued job leaves; a decoding one frees its slot and blocks
        now; a job in prefill finishes its prefill (the KV is still written), then frees them."""
        if job.aborted or job.finish_s is not None:
            return
        job.aborted = True
        self.counters.requests_aborted += 1
        if job.start_s is None:
            self._waiting.remove(job)
            return
        if job is self._prefilling:
            return
        if job in self._batch:
            self._batch.remove(job)
            self._context -= job.context_tokens
        else:
            self._joining.remove(job)
        self._free(job)
        if not self._batch and not self._joining:
            self._step_end = None
        self._maybe_start(now)

    def blocks_freed(self, now: float) -> None:
        """Blocks were freed outside any job's life (a KV connector's hold ended): the queue's
        head, which may have been waiting for them, looks again."""
        self._maybe_start(now)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset: refused while any request holds blocks."""
        return self.cache.reset()

    def next_event_time(self) -> float | None:
        prefill = self._prefilling.first_token_s if self._prefilling is not None else None
        if prefill is None:
            return self._step_end
        if self._step_end is None:
            return prefill
        return min(prefill, self._step_end)

    def advance(self, now: float) -> list[tuple[float, str, Job]]:
        out: list[tuple[float, str, Job]] = []
        while (t := self.next_event_time()) is not None and t <= now:
            job = self._prefilling
            if job is not None and job.first_token_s is not None and job.first_token_s <= t:
                self._end_prefill(t, job, out)
            else:
                self._end_step(t, out)
            self._maybe_start(t)
        return out

    # -- the pieces of a request's life ---------------------------------------------------
    def _maybe_start(self, now: float) -> None:
        if self._prefilling is not None or not self._waiting:
            return
        if self._slots_used >= self.model.max_batch:
            return
        job = self._waiting[0]
        cache = self.cache
        if self._blocked is not None and self._blocked == (job, cache.version):
            return  # nothing freed since this head last found the pool full
        gpu = cache.match(job.block_hashes)
        need = max(min(job.num_blocks, cache.capacity_blocks), gpu)
        if need - gpu + cache.num_cached_among(job.block_hashes[:gpu]) > cache.num_free:
            self._blocked = (job, cache.version)
            return  # the head waits for blocks (running requests will free theirs)
        self._blocked = None
        self._waiting.popleft()
        cache.acquire(job.block_hashes[:gpu])
        cpu = cache.cpu.match(job.block_hashes[gpu:]) if cache.cpu is not None else 0
        cache.allocate(need - gpu)
        job.held = list(job.block_hashes[:gpu])
        job.num_private = need - gpu
        job.num_matched = gpu
        job.next_block = len(job.block_hashes)
        gpu_tokens = min(gpu * job.block_size, job.max_cached_tokens)
        local_tokens = min((gpu + cpu) * job.block_size, job.max_cached_tokens)
        external = max(min(job.num_external_blocks, len(job.block_hashes)) - gpu - cpu, 0)
        job.cached_tokens = min((gpu + cpu + external) * job.block_size, job.max_cached_tokens)
        job.cpu_cached_tokens = local_tokens - gpu_tokens
        job.external_tokens = job.cached_tokens - local_tokens
        job.start_s = now
        prefill = self.model.prefill_s(job.uncached_tokens, job.cpu_cached_tokens)
        job.first_token_s = now + prefill
        self._prefilling = job
        self._slots_used += 1
        c = self.counters
        c.prompt_tokens += job.num_prompt_tokens
        c.cached_tokens += job.cached_tokens - job.external_tokens
        c.external_tokens += job.external_tokens
        c.cpu_cached_tokens += job.cpu_cached_tokens
        c.busy_prefill_s += prefill

    def _end_prefill(self, t: float, job: Job, out: list[tuple[float, str, Job]]) -> None:
        self._prefilling = None
        self._store(job, job.num_matched, len(job.block_hashes), job.block_hashes)
        if job.aborted:
            self._free(job)
            return
        job.num_generated = 1
        out.append((t, FIRST_TOKEN, job))
        self._store_output(job)
        if job.num_output_tokens <= 1:
            self._finish(t, job, out)
        elif self._step_end is None:
            self._batch.append(job)
            self._context += job.context_tokens
            self._step_start = t
            self._step_end = t + self.model.step_s(1, self._context)
        else:
            self._joining.append(job)

    def _end_step(self, t: float, out: list[tuple[float, str, Job]]) -> None:
        assert self._step_end is not None
        c = self.counters
        c.busy_decode_s += t - self._step_start
        c.num_steps += 1
        still: list[Job] = []
        for job in self._batch:
            job.num_generated += 1
            self._context += 1
            self._store_output(job)
            if job.num_generated >= job.num_output_tokens:
                self._context -= job.context_tokens
                self._finish(t, job, out)
            else:
                still.append(job)
                if self.stream_tokens:
                    out.append((t, TOKEN, job))
        for job in self._joining:
            self._context += job.context_tokens
        still.extend(self._joining)
        self._joining = []
        self._batch = still
        self._step_start = t
        self._step_end = t + self.model.step_s(len(still), self._context) if still else None

    def _finish(self, t: float, job: Job, out: list[tuple[float, str, Job]]) -> None:
        job.finish_s = t
        self._free(job)
        self.counters.requests_finished += 1
        self.counters.generation_tokens += job.num_output_tokens
        out.append((t, FINISHED, job))

    def _free(self, job: Job) -> None:
        self.cache.release(job.held, job.num_private)
        job.held, job.num_private = [], 0
        self._slots_used -= 1

    def _store(self, job: Job, first: int, last: int, hashes: Sequence[bytes]) -> None:
        """Blocks first..last-1 of the job's chain (`hashes`) now hold their KV (as many as it
        reserved: a request larger than the cache stores only what fits)."""
        last = min(last, first + job.num_private)
        if first >= last:
            return
        info: list[BlockInfo] = []
        if self.cache.log is not None:
            size, ids = job.block_size, job.token_ids
            mm = blocks_mm_keys(job.images, last, size, first) if job.images else {}
            info = [
                BlockInfo(
                    hashes[i - 1] if i else None,
                    tuple(ids[i * size : (i + 1) * size]),
                    job.cache_salt if i == 0 else None,
                    job.lora_name,
                    mm.get(i, ()),
                )
                for i in range(first, last)
            ]
        taken = self.cache.commit(hashes[first:last], info, job.block_size)
        job.held.extend(taken)
        job.num_private -= len(taken)
        assert job.num_private >= 0, "a job stored more blocks than it reserved"

    def _store_output(self, job: Job) -> None:
        """Output blocks whose last token now exists are stored (the prompt's at prefill end)."""
        hashes = job.final_hashes
        if job.next_block >= len(hashes):
            return
        full = job.context_tokens // job.block_size
        if full > job.next_block:
            last = min(full, len(hashes))
            self._store(job, job.next_block, last, hashes)
            job.next_block = last
