"""The engine replicas behind the gateway: health, served models, and the load this gateway
has put on each (requests in flight, prefill tokens not yet answered by a first token).

Health: every replica is probed (GET /health) every `health_interval_s`; `unhealthy_after`
consecutive failures — or a connection failure while forwarding — mark it down, and one
successful probe marks it up again.

Restarts: each healthy probe also reads the replica's `/metrics` (`scrape_metrics`). The
`process_start_time_seconds` is reported through `on_start_marker` with every scrape (the
directory compares it with what this gateway and every other saw, so a restart bumps the epoch
once, and a report Redis missed is retried by the next); prefix-cache counters that went
backwards call `on_restart`. A replica that reports no start time and comes back up after being
marked down is treated as restarted too: an engine we could not reach may have lost its KV
cache, and a wrong prediction costs a request each to discover.

Suspicion (issue 45, item 17): an engine can be SIGKILLed and back on its port, with an empty
cache and a new start time, well within one health interval. Every sign that its connections
ended — a refused or reset connection while forwarding, a pooled keep-alive connection the
engine closed or reset (`suspect`, from `gateway.pipeline.upstream`), an answer whose cached
tokens contradict the directory's prediction (from reconciliation) — makes the replica
*suspect* at once: routing ignores its directory entries (`suspects`) until its identity is
checked, and a check starts at once, re-probing every `SUSPECT_PROBE_S` while it is away. When
it answers, its start marker is read and reported (a new one bumps its epoch, here and in
Redis) before the suspicion is lifted; an engine that reports none is forgotten (its entries
go). A replica marked down is suspect too, so one coming back is never routed on its past
life's entries while its restart is being checked.

Load signals (issue 9): the scrape also reads the engine's queue (`num_waiting`), which counts
every gateway's requests. The router sees it beside this gateway's own pending prefills
(`router.types.Replica.foreign_prefill_tokens`). Scrapes run every `metrics_interval_s`
(None: with every health probe), stretched so a round costs at most `MAX_SCRAPES_PER_S`, and at
once when a replica is first seen or comes back up. A healthy replica that answered a scrape or
a request within the probe interval is not probed: the cost follows the need, not the fleet.

Workers (`kvgate serve --workers N`, issue 17 item 4): worker 0's set `lead`s — after every
probe round, scrape round and change of a replica's health it sends its view of the fleet to
the other workers (gateway.fleet.podview) — and theirs `follow`: a replica the view covers is
neither probed nor scraped by them, its health, models and engine figures are the view's
(`adopt`: the newer evidence of up or down wins, so a follower's own connection failure still
marks a replica down at once, until worker 0 hears from it after that). A replica the view has
not covered for `stale_after_s` is probed and scraped by the follower itself again.

Membership: `states` holds the replicas the gateway routes to. The static `--engine` list is
fixed; discovery (gateway.fleet.discovery) `add`s and `remove`s replicas while the gateway runs, and
`hold`s a replica down while Kubernetes says it is not ready. A removed replica's state stays
reachable through `get` until its last in-flight request ends, so an exchange that outlives
its replica still finishes its bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, field, replace
from operator import itemgetter

import aiohttp
import orjson

from cachemap.redis.client import AnyRedis
from gateway.fleet.adapters import AdapterMirror, load_adapter
from gateway.fleet.engine_metrics import (
    SCRAPE_HEADERS,
    SCRAPE_PATH,
    EngineMetrics,
    parse_engine_metrics,
)
from gateway.fleet.podview import ViewEntry, ViewReceiver, ViewSender
from gateway.fleet.shared_load import NO_PEERS, PeerLoad, SharedLoad
from gateway.tasks import BackgroundTasks
from router.ahead import Ahead
from router.types import Replica, RouteRequest

log = logging.getLogger(__name__)


REQUEST_TOKENS_LEARNING_RATE = 0.05
"""Weight of each routed request in the mean uncached prefill per request (an EMA over ~20
requests): the size assumed for each request another gateway queued on an engine."""
MAX_SCRAPES_PER_S = 16.0
"""At most this many /metrics scrapes a second (each ~0.3-0.5 ms of CPU in aiohttp and the
parse): up to 16 replicas are read every `metrics_interval_s`, 64 every 4 s, so an idle
gateway's background cost stops growing with the fleet (issue 17: <= 2% of a core at 64)."""
STALE_AFTER_ROUNDS = 2
"""A follower counts a replica as covered by worker 0's view for this many of worker 0's send
rounds (plus one probe timeout, a round's longest) past its last entry: one lost or late
datagram does not make both workers probe, two rounds missing do."""
SUSPECT_PROBE_S = 0.05
"""A suspect replica that does not answer is probed again this often: an engine restarted on
its port is checked within 50 ms of its /health answering (each failed probe costs a refused
connect, microseconds)."""
SUSPECT_CHECK_S = 30.0
"""...for at most this long: a replica still away after that is left to the health interval."""
PREFILL_RATE_WINDOW = 40
"""Measured prefills the engines' prefill rate is read from: the last this many
(`FleetLoad.observe_prefill`)..."""
PREFILL_RATE_KEPT = 20
"""...of which the fastest this many count (ratio of their tokens to their seconds, so a long
prefill weighs what it took)."""
MIN_PREFILL_SAMPLES = 8
"""Prefills measured before the rate is trusted over `engine_prefill_tokens_per_s`."""
DEFAULT_OUTPUT_TOKENS = 256.0
"""Output tokens assumed for a request without max_tokens until the engines' usage has taught
the mean: a chat answer of a few paragraphs."""
_RATE, _TOKENS, _SECONDS = itemgetter(0), itemgetter(1), itemgetter(2)
"""The fields of a measured prefill (`FleetLoad.prefills`)."""


@dataclass
class FleetLoad:
    """What this gateway's own traffic says about everyone's: the mean uncached prefill tokens
    and the mean output tokens of a request (gateways behind one Service see the same mix)."""

    mean_request_tokens: float = 0.0
    num_routed: int = 0
    mean_output_tokens: float = DEFAULT_OUTPUT_TOKENS
    num_answered: int = 0
    prefills: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=PREFILL_RATE_WINDOW), repr=False
    )
    """The last prefills measured, (tokens a second, tokens, seconds) (`observe_prefill`)..."""
    measured_tokens_per_s: float = 0.0
    """...and the rate read from them (`prefill_tokens_per_s`)."""
    num_prefills: int = 0
    num_prefills_unmeasured: int = 0
    """First tokens not measured: other gateways' prefills were queued on the replica when
    this one's began (`ReplicaState.prefill_behind_peers`), so its time counts theirs."""
    on_freed: Callable[[], None] | None = field(default=None, repr=False)
    """Called when a lease frees room on a replica (its prefill ended, or it was released):
    flow control's wake-up (gateway.pipeline.flow)."""
    on_leased: Callable[[], None] | None = field(default=None, repr=False)
    """Called when a lease starts: the shared load's idle loop wakes for its next round
    (gateway.fleet.shared_load)."""
    on_released: Callable[[], None] | None = field(default=None, repr=False)
    """Called when a lease's prefill ends or the lease is released: the shared load publishes
    the figures at the end of the loop turn, as it does a placement (gateway.fleet.shared_load)."""

    def observe(self, uncached_tokens: float) -> None:
        self.num_routed += 1
        if self.num_routed == 1:
            self.mean_request_tokens = uncached_tokens
        else:
            self.mean_request_tokens += REQUEST_TOKENS_LEARNING_RATE * (
                uncached_tokens - self.mean_request_tokens
            )

    def observe_output(self, completion_tokens: int) -> None:
        """An engine's usage: the output tokens one request took."""
        self.num_answered += 1
        if self.num_answered == 1:
            self.mean_output_tokens = float(completion_tokens)
        else:
            self.mean_output_tokens += REQUEST_TOKENS_LEARNING_RATE * (
                completion_tokens - self.mean_output_tokens
            )

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        """A first token: `tokens` uncached prompt tokens prefilled in `seconds`, from when the
        engine began the prefill as far as this gateway can tell (`ReplicaState.prefill_started_s`)
        to its first byte here.

        The rate is read from the fastest half of the last `PREFILL_RATE_WINDOW`: whatever
        else a measured prefill shares the engine with only slows it (other gateways' prefills
        queued ahead of it that this gateway's view had not caught yet, decode steps in the
        batch, a wait for KV blocks), so the engine's own speed is the fast end of the
        measurements, not their mean. Four gateways' means read 28,000-34,000 tokens/s
        of engines one gateway read at 49,700 (issue 39)."""
        if tokens <= 0 or seconds <= 0:
            return
        self.prefills.append((tokens / seconds, tokens, seconds))
        self.num_prefills += 1
        # heapq.nlargest's own definition with a key, in C: its Python loop and a key call a
        # prefill were ~4% of the gateway's CPU a small request (`bench-cpu`, issue 41)
        fastest = sorted(self.prefills, key=_RATE, reverse=True)[:PREFILL_RATE_KEPT]
        self.measured_tokens_per_s = sum(map(_TOKENS, fastest)) / sum(map(_SECONDS, fastest))

    def prefill_tokens_per_s(self, default: float) -> float:
        """The engines' prefill rate as this gateway measured it (`default` until
        `MIN_PREFILL_SAMPLES` prefills were): what flow control counts a running prefill's
        progress and its room at (gateway.pipeline.flow)."""
        if self.num_prefills < MIN_PREFILL_SAMPLES:
            return default
        return self.measured_tokens_per_s

    def expected_output_tokens(self, max_tokens: int | None) -> float:
        """What a request will generate: its max_tokens when it sets one (load generators set
        it exactly), else the mean the engines reported."""
        return float(max_tokens) if max_tokens is not None else self.mean_output_tokens


@dataclass
class ReplicaState:
    url: str
    healthy: bool = False
    consecutive_failures: int = 0
    models: frozenset[str] = frozenset()
    max_model_len: int | None = None
    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    num_prefilling: int = 0
    """This gateway's requests on the replica before their first token."""
    prefill_started_s: float = field(default=0.0, repr=False)
    """When the replica began its current prefill of ours, as far as this gateway can tell
    (monotonic): a request sent to it with none of ours pending, or a prefill of ours ending
    with others pending (engines prefill first come, first served). Flow control subtracts
    the progress since from the work queued there."""
    prefill_behind_peers: bool = field(default=False, repr=False)
    """Other gateways had prefills queued on the replica (`peer`) when `prefill_started_s` was
    set: the prefill's first token is not measured (`Lease.prefilled`), since the time to it
    counts theirs ahead of it (engines prefill first come, first served)."""
    num_requests: int = 0
    decode_tokens: float = 0.0
    """Output tokens expected from this gateway's requests on the replica (router.types)."""
    peer: PeerLoad | None = None
    """Other gateways' requests here, when they share their load over Redis (None: unknown)."""
    metrics: EngineMetrics | None = None
    own_waiting_at_scrape: int = 0
    """`num_prefilling` (with the peers') when the last scrape answered: the known share of
    the engine's queue then."""
    own_running_at_scrape: int = 0
    """`num_inflight` (with the peers') when the last scrape answered: the known share of the
    engine's running then."""
    held_down: str | None = None
    """Why discovery keeps the replica out of routing (Kubernetes: not ready), or None."""
    removed: bool = False
    """Discovery removed it: it stays reachable only for its in-flight requests."""
    fleet: FleetLoad = field(default_factory=FleetLoad, repr=False)
    probed: bool = field(default=False, repr=False)
    heard_s: float = field(default=0.0, repr=False)
    """When it last answered (monotonic): a scrape, or a request committed to it."""
    checked_s: float = field(default=0.0, repr=False)
    """When a health probe last found it up (monotonic)."""
    down_s: float = field(default=0.0, repr=False)
    """When this gateway last marked it down (monotonic)."""
    scraped_s: float = field(default=0.0, repr=False)
    """When `metrics` was read (monotonic): by this gateway, or by worker 0 for a follower."""
    covered_until_s: float = field(default=0.0, repr=False)
    """A follower: worker 0's view speaks for it until then (monotonic); 0: it never has."""
    suspect: bool = False
    """It may have restarted since its entries were written: routing ignores them until its
    identity is checked (module docstring, "Suspicion")."""
    suspect_s: float = field(default=0.0, repr=False)
    """When it last became suspect (monotonic)."""
    suspicions: int = 0
    """Times it became suspect."""
    checking: bool = field(default=False, repr=False)
    """An identity check of it is running."""
    adapters: AdapterMirror = field(default_factory=AdapterMirror, repr=False)
    adapters_listed: frozenset[str] = frozenset()
    """The models its /v1/models lists with a `parent`: LoRA adapters (vLLM's cards)."""
    """Its LoRA adapters' residency as this gateway can tell (gateway.fleet.adapters)."""

    def observe_adapters(self) -> None:
        """The last scrape's `vllm:lora_requests_info` into the adapter mirror."""
        metrics = self.metrics
        if metrics is not None and metrics.running_lora_adapters is not None:
            running, waiting = metrics.lora_adapters_in_use()
            self.adapters.observe(metrics.max_lora, running, waiting, time.monotonic())

    def began_prefill(self) -> None:
        """The replica began a prefill of ours, as far as this gateway can tell: now, behind
        whatever other gateways had queued there (`prefill_behind_peers`)."""
        self.prefill_started_s = time.monotonic()
        peer = self.peer
        self.prefill_behind_peers = peer is not None and peer.prefill_tokens > 0

    @property
    def id(self) -> str:
        return self.url

    def lease(self, uncached_tokens: float, output_tokens: float = 0.0) -> Lease:
        """Count one attempt on this replica (see `Lease`)."""
        return Lease(self, uncached_tokens, output_tokens)

    def known_at_scrape(self) -> None:
        """A scrape answered (ours or worker 0's): the requests whose load is counted exactly
        — this gateway's and its peers' — are the known share of the engine's figures."""
        peer = self.peer or NO_PEERS
        self.own_waiting_at_scrape = self.num_prefilling + peer.num_prefilling
        self.own_running_at_scrape = self.num_inflight + peer.num_inflight

    def queued_prefill_tokens(self) -> float:
        """`snapshot()`'s `pending_prefill_tokens + foreign_prefill_tokens`, without building
        the snapshot (flow control reads it for every replica on every turn of its queue)."""
        queued = self.pending_prefill_tokens + (self.peer or NO_PEERS).prefill_tokens
        metrics = self.metrics
        waiting = metrics.num_waiting if metrics is not None else None
        if waiting is not None:
            foreign = (waiting or 0.0) - self.own_waiting_at_scrape
            if foreign > 0:
                queued += foreign * self.fleet.mean_request_tokens
        return queued

    def kv_capacity_tokens(self) -> float:
        """The tokens one of the engine's ranks holds in its KV, as its metrics said
        (`num_gpu_blocks` × `block_size`); 0: unknown. A request is served by one rank, so no
        replica saves it more than this (`router.capacity`)."""
        metrics = self.metrics
        if metrics is None or not metrics.num_gpu_blocks or not metrics.kv_block_size:
            return 0.0
        return float(metrics.num_gpu_blocks * metrics.kv_block_size)

    def snapshot(self) -> Replica:
        metrics = self.metrics
        waiting = metrics.num_waiting if metrics is not None else None
        running = metrics.num_running if metrics is not None else None
        peer = self.peer or NO_PEERS
        return Replica(
            self.url,
            self.healthy,
            self.num_inflight + peer.num_inflight,
            self.pending_prefill_tokens + peer.prefill_tokens,
            engine_num_waiting=waiting or 0.0,
            own_num_waiting=self.own_waiting_at_scrape if waiting is not None else 0.0,
            foreign_request_tokens=self.fleet.mean_request_tokens if waiting is not None else 0.0,
            decode_tokens=self.decode_tokens + peer.decode_tokens,
            engine_num_running=running or 0.0,
            own_num_running=self.own_running_at_scrape if running is not None else 0.0,
            request_output_tokens=self.fleet.mean_output_tokens if running is not None else 0.0,
        )


class Lease:
    """One attempt's claim on a replica's load counters: while it holds, the request counts in
    `num_inflight` and its expected output in `decode_tokens`, and until its first byte
    (`prefilled`) its uncached prefill counts in `pending_prefill_tokens` — the load the router
    sees. Each release happens once, whatever path the attempt takes: a `with` block releases
    it all unless the attempt committed (`keep`), in which case the exchange releases it when it
    ends.
    """

    __slots__ = (
        "_done_prefill",
        "_kept",
        "_released",
        "output_tokens",
        "state",
        "uncached_tokens",
    )

    def __init__(self, state: ReplicaState, uncached_tokens: float, output_tokens: float) -> None:
        self.state = state
        self.uncached_tokens = uncached_tokens
        self.output_tokens = output_tokens
        state.decode_tokens += output_tokens
        state.num_inflight += 1
        state.num_requests += 1
        state.pending_prefill_tokens += uncached_tokens
        if not state.num_prefilling:
            state.began_prefill()
        state.num_prefilling += 1
        state.fleet.observe(uncached_tokens)
        leased = state.fleet.on_leased
        if leased is not None:
            leased()
        self._done_prefill = self._released = self._kept = False

    def prefilled(self, first_byte: bool = False) -> None:
        """The first byte came back (`first_byte`: the prefill's time is measured, from when
        the replica began it) or the attempt ended: the prefill is done."""
        if self._done_prefill:
            return
        self._done_prefill = True
        state = self.state
        if first_byte and state.num_prefilling:
            if state.prefill_behind_peers:
                state.fleet.num_prefills_unmeasured += 1
            else:
                state.fleet.observe_prefill(
                    self.uncached_tokens, time.monotonic() - state.prefill_started_s
                )
        state.pending_prefill_tokens = max(state.pending_prefill_tokens - self.uncached_tokens, 0.0)
        state.num_prefilling = max(state.num_prefilling - 1, 0)
        if state.num_prefilling:
            state.began_prefill()
        freed = state.fleet.on_freed
        if freed is not None:
            freed()
        released = state.fleet.on_released
        if released is not None:
            released()

    def release(self) -> None:
        """The request is off the replica."""
        self.prefilled()
        if not self._released:
            self._released = True
            state = self.state
            state.num_inflight -= 1
            state.decode_tokens = max(state.decode_tokens - self.output_tokens, 0.0)
            released = state.fleet.on_released
            if released is not None:
                released()

    def keep(self) -> Lease:
        """The attempt committed: the exchange owns the lease now."""
        self._kept = True
        return self

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.prefilled(first_byte=self._kept)
        if not self._kept:
            self.release()


class ReplicaSet:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        interval_s: float,
        timeout_s: float,
        unhealthy_after: int,
        on_restart: Callable[[str], Awaitable[None]],
        on_start_marker: Callable[[str, str], Awaitable[object]] | None = None,
        on_kv_capacity: Callable[[str, EngineMetrics], None] | None = None,
        scrape_metrics: bool = True,
        metrics_interval_s: float | None = None,
    ) -> None:
        self.fleet = FleetLoad()
        self.states = {url: ReplicaState(url, fleet=self.fleet) for url in urls}
        self.static = frozenset(urls)
        """The `--engine` replicas: discovery never removes these."""
        self._retired: dict[str, ReplicaState] = {}
        self._session: aiohttp.ClientSession | None = None
        self._interval_s = interval_s
        self._metrics_interval_s = metrics_interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._timeout_s = timeout_s
        self._unhealthy_after = unhealthy_after
        self._on_restart = on_restart
        self._on_start_marker = on_start_marker
        self._on_kv_capacity = on_kv_capacity
        """Called with the replica and its metrics after every scrape (its own or worker 0's):
        the directory's size for it, from the KV capacity it reports (or none)."""
        self._scrape_metrics = scrape_metrics
        self._tasks = BackgroundTasks("replicas")
        self._sender: ViewSender | None = None
        self._receiver: ViewReceiver | None = None
        self._lapsed = False
        self.view_lapses = 0
        """A follower: times worker 0's view went silent on some replica (it probed them)."""
        self.shared_load: SharedLoad | None = None
        self.suspicions = 0
        """Times a replica became suspect (each starts an identity check)."""
        self._suspects: set[str] = set()

    def share_load(
        self,
        client: AnyRedis,
        round_s: float,
        spread_herd: bool = True,
        pace_s: float = 0.0,
        ahead: bool = False,
    ) -> SharedLoad:
        """Publish this gateway's load to its peers on `client` and count theirs (from
        `start` to `stop`; gateway.fleet.shared_load)."""
        self.shared_load = SharedLoad(
            client,
            self.states.values,
            round_s,
            spread_herd=spread_herd,
            pace_s=pace_s,
            ahead=ahead,
        )
        self.fleet.on_leased = self.shared_load.wake
        self.fleet.on_released = self.shared_load.changed
        return self.shared_load

    def herd(self) -> tuple[int, int]:
        """The live peers on the shared load and this gateway's place among them, for the
        router's load ties (`SharedLoad.herd`); (0, 0) without a shared load."""
        return self.shared_load.herd() if self.shared_load is not None else (0, 0)

    async def pace(self) -> None:
        """This gateway's turn to decide, with peers (`SharedLoad.pace`; at once without)."""
        if self.shared_load is not None:
            await self.shared_load.pace()

    @property
    def looks_ahead(self) -> bool:
        """Whether requests register the requests ahead of them (`SharedLoad.ahead`): a
        shared load with `place_ahead` on."""
        return self.shared_load is not None and self.shared_load.ahead

    async def register_ahead(
        self, route: RouteRequest, deadline_s: float
    ) -> tuple[str, bool, list[Ahead]] | None:
        """`SharedLoad.register`: None without a shared load."""
        if self.shared_load is None:
            return None
        return await self.shared_load.register(route, deadline_s)

    def decided_ahead(self, rid: str, replica: str | None) -> None:
        """The request registered as `rid` was placed on `replica` (None: nowhere):
        `SharedLoad.decided`."""
        if self.shared_load is not None:
            self.shared_load.decided(rid, replica)

    def published(self, state: ReplicaState, seen: Replica | None = None) -> Replica:
        """`state`'s snapshot (`seen`, when taken already) with this gateway's own figures as
        its last write published them (what its peers read), not its exact leases: the view
        every gateway deciding with the requests ahead shares (`router.ahead`)."""
        seen = state.snapshot() if seen is None else seen
        own = self.shared_load.own.get(state.url) if self.shared_load is not None else None
        inflight, prefill, decode = (own[1], own[3], own[4]) if own is not None else (0, 0.0, 0.0)
        peer = state.peer or NO_PEERS
        return replace(
            seen,
            num_inflight=inflight + peer.num_inflight,
            pending_prefill_tokens=prefill + peer.prefill_tokens,
            decode_tokens=decode + peer.decode_tokens,
        )

    def get(self, replica_id: str) -> ReplicaState:
        """A routed replica's state, or a removed one's while its requests finish."""
        state = self.find(replica_id)
        if state is None:
            raise KeyError(replica_id)
        return state

    def find(self, replica_id: str) -> ReplicaState | None:
        """`get`, or None for a replica the set no longer knows (removed, and idle since)."""
        state = self.states.get(replica_id)
        return state if state is not None else self._retired.get(replica_id)

    def models(self) -> list[str]:
        return sorted({m for s in self.states.values() for m in s.models})

    def serving(self, model: str) -> list[ReplicaState]:
        return [s for s in self.states.values() if model in s.models]

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self.states.values())

    def suspects(self) -> Set[str]:
        """The replicas whose directory entries routing must ignore now (read per request:
        kept as a set, not found by a walk of the fleet)."""
        return self._suspects

    # -- suspicion (issue 45, item 17) -------------------------------------------------------
    def suspect(self, replica_id: str, why: str) -> None:
        """The replica may have restarted: ignore its entries from now until its identity is
        checked, and check it at once."""
        state = self.states.get(replica_id)
        if state is None:
            return
        if not state.suspect:
            log.warning("replica %s is suspect (%s): checking its identity", replica_id, why)
            self.suspicions += 1
            state.suspicions += 1
        state.suspect = True
        state.suspect_s = time.monotonic()
        self._suspects.add(replica_id)
        if self._session is not None and not state.checking:
            state.checking = True
            self._tasks.spawn(self._check(state), name=f"check {state.url}")

    async def _check(self, state: ReplicaState) -> None:
        """Probe a suspect replica until its identity is checked (`_probe` lifts the
        suspicion), every `SUSPECT_PROBE_S`, for at most `SUSPECT_CHECK_S`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SUSPECT_CHECK_S
        try:
            while state.suspect and not state.removed and state.held_down is None:
                await self._probe(state)
                if not state.suspect or loop.time() >= deadline:
                    return
                await asyncio.sleep(SUSPECT_PROBE_S)
        finally:
            state.checking = False

    async def _verify(self, state: ReplicaState) -> None:
        """A suspect replica answered a probe (and the scrape that follows it): report its
        start marker (a new one is a restart: its epoch moves) or, with none to read, forget
        its entries; then route on its entries again."""
        if not state.suspect:
            return
        since = state.suspect_s
        if self._scrape_metrics and state.scraped_s < since and not await self._scrape(state):
            return  # its /metrics did not answer: still suspect (the check probes again)
        metrics = state.metrics
        marker = metrics.start_marker if metrics is not None and state.scraped_s >= since else None
        if marker is not None and self._on_start_marker is not None:
            await self._on_start_marker(state.url, marker)
        else:
            await self._on_restart(state.url)
        if state.suspect_s == since:  # not suspected again while we checked
            state.suspect = False
            self._suspects.discard(state.url)

    # -- membership (discovery) --------------------------------------------------------------
    def add(self, url: str, held_down: str | None = None) -> ReplicaState:
        """A replica joined: route to it once a probe has found it healthy (probed at once,
        unless it is held down)."""
        state = self.states.get(url)
        if state is not None:
            return state
        state = ReplicaState(url, fleet=self.fleet, held_down=held_down)
        self.states[url] = state
        self._retired.pop(url, None)
        log.info("replica %s joined", url)
        if self._session is not None:
            self._spawn_probe(state)
        return state

    def remove(self, url: str) -> ReplicaState | None:
        """A replica left: no new request goes to it; in-flight ones finish where they are."""
        state = self.states.pop(url, None)
        if state is None:
            return None
        state.healthy = False
        state.removed = True
        self._suspects.discard(url)
        log.info("replica %s left", url)
        self._retired = {u: s for u, s in self._retired.items() if s.num_inflight > 0}
        if state.num_inflight > 0:
            self._retired[url] = state
        return state

    def hold(self, url: str, why: str | None) -> None:
        """Keep a replica out of routing (`why`), or let probes bring it back (None)."""
        state = self.states.get(url)
        if state is None or state.held_down == why:
            return
        state.held_down = why
        if why is not None:
            self.mark_down(url, why)
        elif self._session is not None:
            self._spawn_probe(state)

    def _spawn_probe(self, state: ReplicaState) -> None:
        self._tasks.spawn(self._probe(state), name=f"probe {state.url}")

    # -- one prober per pod (gateway.fleet.podview) --------------------------------------------
    def lead(self, sender: ViewSender) -> None:
        """Worker 0: send the view to the other workers (before `start`)."""
        self._sender = sender

    def follow(self, receiver: ViewReceiver) -> None:
        """Another worker: route on worker 0's view (before `start`); `receiver` adopts."""
        self._receiver = receiver

    @property
    def sender(self) -> ViewSender | None:
        return self._sender

    @property
    def receiver(self) -> ViewReceiver | None:
        return self._receiver

    def view_period_s(self) -> float:
        """How often worker 0 sends its view: every probe round and every scrape round, so the
        shorter of their intervals (discovery sends its endpoint set as often)."""
        period = self._interval_s
        if self._scrape_metrics and self._metrics_interval_s is not None:
            period = min(period, self._scrape_interval_s())
        return period

    def stale_after_s(self) -> float:
        """How long past its last entry a replica stays covered by worker 0's view:
        `STALE_AFTER_ROUNDS` of its send period, plus a probe's timeout (a round waits on its
        slowest replica)."""
        return STALE_AFTER_ROUNDS * self.view_period_s() + self._timeout_s

    def _publish(self) -> None:
        if self._sender is not None:
            self._sender.send(self._entries())

    def _entries(self) -> list[ViewEntry]:
        return [
            ViewEntry(
                url=s.url,
                healthy=s.healthy,
                since_s=max(s.heard_s, s.checked_s) if s.healthy else s.down_s,
                models=tuple(sorted(s.models)),
                max_model_len=s.max_model_len,
                metrics=s.metrics,
                scraped_s=s.scraped_s,
            )
            for s in self.states.values()
            if s.probed
        ]

    def _covered(self, state: ReplicaState, now: float) -> bool:
        return state.covered_until_s > now

    async def adopt(self, entries: list[ViewEntry]) -> None:
        """A follower: worker 0's entries, each for a replica this worker routes to (others,
        and replicas discovery holds down here, are left to this worker)."""
        now = time.monotonic()
        if self._lapsed:
            log.info("worker 0's view of the replicas is back")
            self._lapsed = False
        covered_until = now + self.stale_after_s()
        for entry in entries:
            state = self.states.get(entry.url)
            if state is None or state.held_down is not None or state.removed:
                continue
            state.covered_until_s = covered_until
            await self._adopt_one(state, entry)

    async def _adopt_one(self, state: ReplicaState, entry: ViewEntry) -> None:
        """The newer evidence wins: worker 0's up after our own mark-down, its down after the
        last answer we had; its engine figures when newer than ours, read as a scrape of ours
        (our share of the queue now, the restart checks)."""
        heard_here = state.heard_s
        before = state.metrics
        if entry.models:
            state.models = frozenset(entry.models)
            state.max_model_len = entry.max_model_len
        fresh = entry.metrics is not None and entry.scraped_s > state.scraped_s
        if fresh:
            state.metrics = entry.metrics
            state.scraped_s = entry.scraped_s
            state.heard_s = max(state.heard_s, entry.scraped_s)
            state.known_at_scrape()
            state.observe_adapters()
        if entry.healthy and not state.healthy and entry.since_s > state.down_s:
            await self._came_up(state)
        elif not entry.healthy and state.healthy and entry.since_s > heard_here:
            self.mark_down(state.url, "worker 0 marked it down")
        state.probed = True
        if fresh:
            await self._maybe_restarted(state, before)

    async def _came_up(self, state: ReplicaState) -> None:
        """A probed replica is healthy again (ours or worker 0's finding): one that reports no
        start time may have lost its KV cache while we could not reach it."""
        state.consecutive_failures = 0
        if state.probed:
            log.warning("replica %s is back up", state.url)
            if state.metrics is None or state.metrics.start_marker is None:
                await self._on_restart(state.url)
        state.healthy = True
        self._publish()

    # -- the loops -------------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        """Probe every replica once (so the first request sees real health), then keep probing;
        a follower adopts worker 0's view as it comes."""
        self._session = session
        await self.probe_all()
        self._tasks.spawn(
            self._loop(lambda: self._interval_s, self.probe_all), name="health probes"
        )
        if self._scrape_metrics and self._metrics_interval_s is not None:
            self._tasks.spawn(
                self._loop(self._scrape_interval_s, self.scrape_all), name="metrics scrapes"
            )
        if self._receiver is not None:
            self._tasks.spawn(self._receiver.run(), name="pod view")
        if self.shared_load is not None:
            await self.shared_load.start()

    async def stop(self) -> None:
        if self.shared_load is not None:
            await self.shared_load.stop()
        await self._tasks.close()
        for end in (self._sender, self._receiver):
            if end is not None:
                end.close()

    def _scrape_interval_s(self) -> float:
        """`metrics_interval_s`, stretched so a round costs at most `MAX_SCRAPES_PER_S`."""
        assert self._metrics_interval_s is not None
        return max(self._metrics_interval_s, len(self.states) / MAX_SCRAPES_PER_S)

    async def _loop(
        self, interval_s: Callable[[], float], round_: Callable[[], Awaitable[None]]
    ) -> None:
        while True:
            await asyncio.sleep(interval_s())
            try:
                await round_()
            except Exception:  # a round must never kill the loop
                log.exception("replica round %s failed", getattr(round_, "__name__", round_))

    async def probe_all(self) -> None:
        """Probe every replica not heard from within the interval (`_heard_lately`) nor
        covered by worker 0's view (a follower); worker 0 then sends its view."""
        now = time.monotonic()
        self._note_lapses(now)
        await asyncio.gather(
            *(
                self._probe(s)
                for s in list(self.states.values())
                if not self._heard_lately(s, now) and not self._covered(s, now)
            )
        )
        self._publish()

    def _note_lapses(self, now: float) -> None:
        """A follower whose view went silent on a replica it had covered says so, once."""
        if self._receiver is None or self._lapsed:
            return
        lapsed = [s.url for s in self.states.values() if 0.0 < s.covered_until_s <= now]
        if lapsed:
            self._lapsed = True
            self.view_lapses += 1
            log.warning(
                "worker 0's view of %d replicas is older than %.1f s: probing them here",
                len(lapsed),
                self.stale_after_s(),
            )

    def _heard_lately(self, state: ReplicaState, now: float) -> bool:
        """A healthy replica that answered a scrape or a request within the probe interval (or
        the scrape interval, when the fleet stretches it) needs no probe: it has just shown what
        a probe would. A replica that stops answering is probed again within that interval,
        and a failed request marks it down at once. When the scrapes ride on the probes, every
        probe still runs."""
        return (
            self._scrape_metrics
            and self._metrics_interval_s is not None
            and state.healthy
            and state.probed
            and state.held_down is None
            and now - state.heard_s < max(self._interval_s, self._scrape_interval_s())
        )

    async def scrape_all(self) -> None:
        """Read every healthy replica's /metrics not covered by worker 0's view: load signals,
        restarts; worker 0 then sends its view."""
        now = time.monotonic()
        await asyncio.gather(
            *(
                self._scrape_and_check(s)
                for s in list(self.states.values())
                if s.healthy and not self._covered(s, now)
            )
        )
        self._publish()

    async def _scrape_and_check(self, state: ReplicaState) -> None:
        before = state.metrics
        await self._scrape(state)
        await self._maybe_restarted(state, before)

    async def _probe(self, state: ReplicaState) -> None:
        assert self._session is not None, "start() binds the session"
        if state.held_down is not None or state.removed:
            state.probed = True
            return
        try:
            async with self._session.get(state.url + "/health", timeout=self._timeout) as resp:
                ok = resp.status == 200
            if ok and (not state.healthy or not state.probed):
                ok = await self._learn_models(state)
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if state.held_down is not None or state.removed:  # changed while we probed
            return
        if ok:
            state.consecutive_failures = 0
            state.checked_s = time.monotonic()
            before = state.metrics
            # scrape with every probe, or on coming up (a restart must be known before routing)
            if self._scrape_metrics and (
                self._metrics_interval_s is None
                or not state.healthy
                or not state.probed
                or state.suspect
            ):
                await self._scrape(state)
            if not state.healthy:
                await self._came_up(state)
            await self._maybe_restarted(state, before)
            await self._verify(state)
            state.probed = True
        else:
            state.consecutive_failures += 1
            if state.healthy and state.consecutive_failures >= self._unhealthy_after:
                self.mark_down(state.url, "failed health probes")
            state.probed = True

    async def _scrape(self, state: ReplicaState) -> bool:
        """Read its /metrics; False when it did not answer at all (an answer that is not a
        200 reads nothing, but is an answer)."""
        assert self._session is not None
        try:
            async with self._session.get(
                state.url + SCRAPE_PATH, headers=SCRAPE_HEADERS, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    return True
                peer = state.peer or NO_PEERS  # the known share of the queue it reports...
                own_waiting = state.num_prefilling + peer.num_prefilling
                own_running = state.num_inflight + peer.num_inflight  # ...and of its running
                text = (await resp.read()).decode(errors="replace")
            state.metrics = parse_engine_metrics(text)
            state.heard_s = state.scraped_s = time.monotonic()
            state.own_waiting_at_scrape = own_waiting
            state.own_running_at_scrape = own_running
            state.observe_adapters()
        except ValueError as exc:
            log.debug("metrics of %s unreadable: %s", state.url, exc)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("metrics of %s unavailable: %s", state.url, exc)
            return False
        return True

    async def _maybe_restarted(self, state: ReplicaState, before: EngineMetrics | None) -> None:
        now = state.metrics
        if now is None:
            return
        if self._on_kv_capacity is not None:  # every scrape: the ratio it is sized by moves
            self._on_kv_capacity(state.url, now)
        marker = now.start_marker
        if marker is not None and self._on_start_marker is not None:
            # every scrape: the directory compares (cheaply) and retries what Redis missed
            await self._on_start_marker(state.url, marker)
        elif before is not None and now.restarted_since(before):
            log.info("replica %s restarted (its prefix-cache counters went backwards)", state.url)
            await self._on_restart(state.url)

    async def _learn_models(self, state: ReplicaState) -> bool:
        assert self._session is not None
        async with self._session.get(state.url + "/v1/models", timeout=self._timeout) as resp:
            if resp.status != 200:
                return False
            body = orjson.loads(await resp.read())
        cards = body.get("data") or []
        state.models = frozenset(str(c["id"]) for c in cards if "id" in c)
        state.adapters_listed = frozenset(
            str(c["id"]) for c in cards if "id" in c and c.get("parent") not in (None, c["id"])
        )
        lens = [c.get("max_model_len") for c in cards if isinstance(c.get("max_model_len"), int)]
        state.max_model_len = min(lens) if lens else None
        return bool(state.models)

    async def load_adapter(self, state: ReplicaState, name: str, path: str) -> bool:
        """Register a LoRA adapter at the replica (gateway.fleet.adapters); it then serves it."""
        if self._session is None:
            return False
        ok = await load_adapter(self._session, state.url, name, path, self._timeout)
        if ok:
            state.models = state.models | {name}
        return ok

    def mark_down(self, replica_id: str, why: str) -> None:
        """Route around the replica until a probe finds it up; it is suspect from now (it may
        come back as a new engine: `suspect`)."""
        state = self.find(replica_id)
        if state is None:
            return  # removed meanwhile: nothing routes to it any more
        if state.held_down is None and not state.removed:
            self.suspect(replica_id, why)
        state.down_s = time.monotonic()
        if state.healthy:
            log.warning("replica %s marked down: %s", replica_id, why)
            state.healthy = False
            self._publish()
