"""The gateway's configuration: one frozen settings object.

Sources, strongest first: command-line flags (passed as init arguments), `KVGATE_*` environment
variables (lists as JSON, e.g. KVGATE_ENGINES='["http://a:8000"]'), the YAML file given by
`--config` (same field names), then the defaults below, each a named constant with its reason.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from cachemap.affinity import DEFAULT_AFFINITY_CAPACITY, DEFAULT_AFFINITY_TTL_S
from cachemap.directory import DEFAULT_REPLICA_CAPACITY_BLOCKS, DEFAULT_TTL_S
from cachemap.events import DEFAULT_BLOCK_SIZE, DEFAULT_OFFLOAD_COST, DEFAULT_SPECULATIVE_TTL_S
from cachemap.keys import DEFAULT_BLOCK_BYTES
from cachemap.multimodal import DEFAULT_TOKENS_PER_IMAGE
from gateway.request.tenant import BILLING_PROFILES, check_tenant_name
from router.adapters import DEFAULT_ADAPTER_BUSY_S
from router.fairness import (
    DEFAULT_DECODE_WEIGHT,
    DEFAULT_FLOOR_SHARE,
    DEFAULT_LOWER_BAND_ROOM_SHARE,
)
from router.fanout import DEFAULT_MIN_HOLD_TOKENS
from router.filters import (
    DEFAULT_ABSOLUTE_SLACK_TOKENS,
    DEFAULT_DECODE_TOKEN_WEIGHT,
    DEFAULT_RELATIVE_SLACK,
)
from router.overflow import DEFAULT_HOT_SHARE
from router.registry import DEFAULT_CONSISTENT_HASH_BLOCKS, POLICIES
from router.scorers import DEFAULT_DISPLACEMENT_HALF_LIFE_S, DEFAULT_DISPLACEMENT_HOT_S

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_METRICS_PORT = 9090
"""The admin port (/metrics, the API documents): Prometheus' conventional port, and the one the
image EXPOSEs beside 8080."""
DEFAULT_HEALTH_INTERVAL_S = 2.0
"""Probe every replica every 2 s: a dead replica stops receiving traffic within ~2 probes."""
DEFAULT_HEALTH_TIMEOUT_S = 1.0
"""vLLM answers /health from its API process in milliseconds even under load."""
DEFAULT_UNHEALTHY_AFTER = 2
"""Consecutive failed probes before a replica is marked down (one lost packet is not a death)."""
DEFAULT_CONNECT_TIMEOUT_S = 2.0
"""A replica that cannot accept a TCP connection in 2 s is down; retry the next one."""
DEFAULT_FIRST_BYTE_TIMEOUT_S = 120.0
"""From sending a request to the engine's first token (its queue and prefill): a 128k-token
prefill at 13k tokens/s takes ~10 s, so 120 s leaves room for ~10 of them queued ahead. Past it
the engine is hung or hopelessly behind, and the attempt moves to the next replica."""
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0
"""Silence allowed between an engine's streamed chunks: a decode step takes 10–100 ms and a
preempted request waits out its recompute (a prefill, seconds); 30 s of nothing is a stalled
engine, and the client gets a clean error instead of a stream that never ends."""
DEFAULT_SHUTDOWN_GRACE_S = 30.0
"""After SIGTERM, requests in flight get 30 s to finish (an agent's step streams for seconds to
tens of seconds); the chart derives it from terminationGracePeriodSeconds."""
DEFAULT_MAX_ATTEMPTS = 3
"""An upstream failure before the first byte is retried on the next-best replica, twice."""
DEFAULT_MAX_PROMPT_BYTES = 4 * 1024 * 1024
"""4 MiB of rendered prompt (~1M tokens): beyond any served context window."""
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""8 MiB of request body: twice the default prompt limit, room for JSON's escapes and structure
around a prompt of `max_prompt_bytes` (code full of quotes and newlines grows by about a third)."""
DEFAULT_CLIENT_KEEP_ALIVE_S = 75.0
"""An idle client connection is kept 75 s: longer than the clients' and load balancers' own idle
limits (httpx and the openai SDK 5 s, aiohttp 15 s, AWS ALB and nginx 60 s), so the client, not
the gateway, ends an idle connection, and never while its next request is on the wire (uvicorn's
5 s equals httpx's: the two raced)."""
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
"""A whole body within 60 s: 8 MiB arrives in that time at 1.2 Mbit/s, so only a stalled (or
hostile) upload waits this long, holding its connection for nothing."""
DEFAULT_BYTES_PER_TOKEN = 4.0
"""English BPE averages ~4 bytes per token; the gateway learns the real ratio per model from the
engines' usage and uses this only until the first response."""
DEFAULT_UPSTREAM_MAX_CONNECTIONS = 1024
DEFAULT_ENGINE_PREFILL_TOKENS_PER_S = 13_000.0
"""An H100 prefilling an 8B model; set it to your engines' measured prefill throughput."""
DEFAULT_FANOUT_MAX_HOLD_S = 10.0
"""However long a leader's prefill is expected to take, no sibling waits more than 10 s."""
# -- fair flow control (issue 43; docs/flow-control.md) ------------------------------------------
DEFAULT_FLOW_MAX_PENDING_PREFILL_S = 0.1
"""A replica has room while the prefill queued on it (this gateway's unanswered prefills, less
the progress of the one running, and other gateways' waiting requests) is under 0.1 s of work:
the next request is sent (at that moment: a timer follows the running prefill's progress) while
the engine still has a tenth of a second to go, over twice the dispatch latency measured on a
loaded gateway (10-46 ms at load ~7), so the engine does not run dry; and a request the fair
queue picks waits at the engine behind at most that. A request arriving just after every
replica took a long prefill waits for one of them, plus this: the noisy neighbour's B at p99
0.86-0.87 s against 0.91-1.02 s at 0.25 (docs/flow-control.md)."""
DEFAULT_FLOW_MAX_QUEUED_PER_SCOPE = 256
"""A scope may have 256 requests waiting in the gateway (a flood of closed-loop clients, or an
agent's fan-out, fits); the next is a 429 with Retry-After: its own backlog is full."""
DEFAULT_FLOW_MAX_QUEUED = 4096
"""Requests waiting in one gateway in all: 4,096 of ~1 KB of state each (the body is held by
its handler anyway); past it the fleet is full for everyone and a request gets a 503."""
DEFAULT_FLOW_AFFINITY_WAIT_MS = 0.0
"""Off: a request whose cached replica is full is placed by the router at once, by cache and
load, as any request (issue 39). The wait (0.5 s until then) paid when past its bound a request
went cold to a replica with room (B's conversations beside a flood hit 0.86-0.89 at 0 against
0.99 at 250-1000 ms); with the router placing it instead, `kvgate bench-fairness --scenario
affinity` reads B's hit ratio 0.992 at 0 and at 500 ms, TTFT p50 0.23 / 0.32 against 0.39 /
0.39 s, p99 3.16-3.18 s in all four runs, B's turns 220 / 197 against 182 / 163; and bench
point 1's first 1,000 requests (one gateway, time scale 4, A B B A) TTFT mean 0.95 / 0.85 s
against 2.54 / 1.42 s, hit ratio 0.097 / 0.100 against 0.095 / 0.097 (docs/flow-control.md).
The wait held its scope's later requests behind it (a scope's sub-queue is in order)."""
DEFAULT_FLOW_MAX_QUEUE_S = 60.0
"""No request waits in the gateway longer than 60 s: beyond it a client's own timeout (the
SDKs' are 60-600 s) would give up anyway, and an explicit 429/503 lets it back off."""
DEFAULT_REDIS_DEADLINE_S = 0.005
"""A lookup is one script call, ~0.2 ms on a LAN: 5 ms is 25× that, and routing locally beats
waiting longer (a prefill of the whole prompt costs tens of ms at worst)."""
DEFAULT_REDIS_DEADLINE_PER_BLOCK_S = 20e-6
"""Added to a lookup's deadline per block of its chain: the directory's script walks the chain a
block at a time (~3–7 µs each in Redis, the higher figure under load), so a 100k-token agent
prompt of 6,250 blocks takes 20–45 ms in Redis alone, past any fixed few-ms deadline on every
turn (docs/benchmarks-archive.md, "Lookups of long chains"). 20 µs a block allows 3× that
and bounds the
wait at ~1.6% of the prompt's own prefill (6,250 × 16 tokens at 13,000 tokens/s: 7.7 s). The
shared event index's lookup bisects on prefix marks (~1 ms for that chain) and walks only past
them; the allowance is then a bound it rarely nears."""
DEFAULT_REDIS_DEADLINE_CAP_S = 0.025
"""How far a lookup's deadline may follow Redis's recent p99 up (`gateway.deadline`):
5× the base, room for a lookup queued behind other gateways' 2–4 ms write chunks, while a Redis
that stopped answering costs each of the few requests before the breaker opens at most 25 ms
(a 10k-token prefill costs ~0.8 s)."""
DEFAULT_BILLING_LEDGER_DEADLINE_S = 0.05
"""One MGET on the billing store: ~0.2 ms on a LAN; 50 ms before billing from local state."""
DEFAULT_REDIS_WRITE_DEADLINE_S = 0.5
"""Records, drops and epoch bumps run off the request path; half a second rides out a Redis
failover's first hiccup without piling up writes."""

# -- tenants, isolation and rate limits (issue 6) ---------------------------------------------
DEFAULT_TENANTS_RELOAD_INTERVAL_S = 1.0
"""Look at the tenants file once a second: a revoked key stops working within a second (the
kubelet takes up to a minute to update a mounted Secret anyway), and a stat() costs nothing."""
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_RATE_LIMIT_TIMEOUT_S = 0.1
"""The deadline of one rate-limit round trip to Redis
(gateway.pipeline.ratelimit.DEFAULT_TIMEOUT_S)."""

# -- billing (issue #7) ---------------------------------------------------------------------------
DEFAULT_BILLING_PROFILE = "openai"
"""The gateway speaks OpenAI's API: bill its clients by OpenAI's current (5.6) rules."""
DEFAULT_BILLING_LOOKBACK_BLOCKS = 20
"""Anthropic walks back at most 20 blocks from a breakpoint [A]."""
DEFAULT_BILLING_OPENAI_TTL_S = 1800.0
"""OpenAI 5.6 keeps entries ≥ 30 minutes after the latest use: simulated as exactly 30."""
DEFAULT_BILLING_LEDGER_MAX_ENTRIES = 200_000
"""Cache entries a gateway keeps per billing profile (~0.37 KB each: ~75 MB), an hour of 55
requests/s that each write one; the pass that enforces it takes ~0.1 s on the event loop at
this size. Past it the soonest-expiring go first (docs/billing.md#decisions)."""
DEFAULT_BILLING_WAL_DEADLINE_S = 5.0
"""An fdatasync takes milliseconds on a healthy volume; 5 s is a disk that stopped: the request
fails (503) instead of hanging on it."""
# -- billing hardening, round 2 (issue 45, items 1-3) ---------------------------------------------
DEFAULT_BILLING_REDIS_ALLOW_UNSAFE_FSYNC = False
"""A shipped segment is deleted on the store's reply: refuse a store that may lose it."""
DEFAULT_BILLING_WAL_TAKEOVER = False
"""Only where every gateway's WAL directory is on one shared volume (the chart's persistence)."""
DEFAULT_BILLING_WAL_LEASE_S = 30.0
"""A live gateway renews its directory's lease every 10 s: a directory whose lease is 30 s old
and whose lock is free has no live owner (a container restart takes a few seconds, and 30 s
covers clock skew between nodes of tens of seconds' worth of NTP trouble)."""
# -- Kubernetes, engine load signals, observability (issue 9; docs/operations.md) --------------
DEFAULT_METRICS_INTERVAL_S = 1.0
"""Read each replica's /metrics once a second: its queue is what other gateways have sent in the
last second, and every gateway scrapes every engine, so G gateways cost each engine G scrapes/s
(vLLM renders /metrics in its API process)."""
DEFAULT_LOAD_SHARE_INTERVAL_S = 0.1
"""Ten rounds a second: another gateway's 2-s agent prefill is counted here within 5% of its
length; one Redis round trip each (cost measured in docs/benchmarks-archive.md)."""
DISCOVERY_MODES = ("static", "kubernetes")
DEFAULT_WATCH_TIMEOUT_S = 290
"""Ask the API server to end each watch after ~5 min (its own default is 5–10): a quiet watch is
re-opened from the last resourceVersion, and a dead connection is noticed within that time."""
DEFAULT_DISCOVERY_RETRY_S = 2.0
"""After a failed list or watch (API server away, RBAC missing) try again every 2 s."""

# -- endpoint-picker mode (issue 18; docs/deployment.md) -------------------------------------
MODES = ("standalone", "epp")
DEFAULT_EPP_PORT = 9002
"""GIE's endpoint pickers listen for ext-proc on 9002; Envoy configs and charts expect it."""
DEFAULT_EPP_MAX_MESSAGE_TIMEOUT_S = 30.0
"""The longest Envoy lets the picker extend its message timer (its `max_message_timeout`, set to
the same value in the shipped Envoy config): a fan-out hold's bound (at most `fanout_max_hold_s`,
10 s) plus the pick after it fits with room."""

# -- hardening round 2: the upstream client and the relay (issue 45, items 5-6) ---------------
DEFAULT_UPSTREAM_MAX_HEADER_BYTES = 64 * 1024
"""An engine's response head is ~200 bytes; 64 KiB is the limit uvicorn and h11 put on the heads
they read, and bounds llhttp's cost, which copies a header value at every read (quadratic: an
8 MB header cost the event loop 332 ms)."""
DEFAULT_UPSTREAM_MAX_BODY_BYTES = 64 * 1024 * 1024
"""The most of an engine's whole answer (non-streamed, or a 4xx) the gateway holds: an engine
answers whole only what it cannot stream (`prompt_logprobs`, beam search, `best_of`), and a
128k-token prompt's `prompt_logprobs` with 5 alternatives each (~300 B a token, ~40 MB) fits."""
DEFAULT_TENANT_INFLIGHT_SHARE = 0.5
"""Without `tenant_max_inflight`, a tenant may hold half the upstream slots (512 of 1,024): one
tenant's many streams leave the other half to everyone else, and a gateway serving one tenant
still takes it far past any engine's batch (vLLM's default max_num_seqs is 256)."""
DEFAULT_CLIENT_DRAIN_TIMEOUT_S = 10.0
"""How long the relay waits for a client to read what fills its socket buffer (~48 KB: asyncio's
high-water mark down to its low-water mark): a client slower than ~5 KB/s reads slower than an
engine streams tokens and would hold an engine connection for ever; a 100 kbit/s mobile link
takes ~4 s."""

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "kvgate_config_file", default=None
)


# -- KV events: what one engine's feed may cost (issue 45, item 8) --
DEFAULT_KV_EVENTS_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The largest KV event message read (`ZMQ_MAXMSGSIZE`): a batch covers one engine step, whose
new blocks a chunked prefill bounds (16,384 tokens are ~100 kB); 4 MiB is ~800k tokens in one
step. A 5 MB batch cost ~180 ms of the event loop to decode and apply."""
DEFAULT_KV_EVENTS_DRAIN_BUDGET_S = 0.005
"""Event loop time one callback of a feed's reader spends applying batches (at least one): a
flood is applied over several loop turns, with requests served in between."""
DEFAULT_KV_EVENTS_MAX_BLOCKS = 1_000_000
"""Blocks a domain may hold over all tiers (16M tokens at 16 a block, above any GPU plus CPU
offload tier of one engine today; ~300 MB of index): a bound when the engine's metrics give no
KV capacity, and on the tiers they do not cover."""
DEFAULT_CHECK_EVERY = 1000
DEFAULT_EVENTS_LEASE_S = 5.0
"""How long an engine's events stay with a gateway that stopped renewing (shared event index):
a dead owner's engines are taken over within 5 s (their missed batches replayed where the
engine keeps them), while renewals every ~1.7 s ride out a Redis failover (~2 s)."""
"""Every Nth precise request (and the first) is compared with the engine's /tokenize: one
extra engine call per thousand requests, and a mismatch shows within seconds under load."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT
    """The admin port: /metrics (GET and HEAD), /openapi.json, /docs, /redoc — operators only,
    never on `port` (0: any free port; None: none of them is served)."""
    engines: list[str] = Field(default_factory=list)
    decode_engines: list[str] = Field(default_factory=list)
    """Prefill/decode disaggregation (vLLM's NixlConnector, docs/disaggregation.md): these
    engine URLs are the decode pool, every one of `engines` a prefill instance. Each request is
    prefilled where its prefix is cached (the policy, within the prefill pool's load bound),
    then decoded at the least-loaded decode instance (its own cached prefix counted) with the
    prefill's `kv_transfer_params`. Empty: every engine serves requests whole."""
    pd_protocol: Literal["vllm", "sglang"] = "vllm"
    """How a disaggregated request is sent (docs/disaggregation.md). `vllm`: vLLM's
    NixlConnector protocol — the prefill instance first, its `kv_transfer_params` then to the
    decode instance. `sglang`: SGLang's bootstrap protocol (`--disaggregation-mode`), as
    sglang-router's P/D mode sends it — the request to the prefill and the decode instance at
    once, both with `bootstrap_host`, `bootstrap_port` and a random `bootstrap_room`."""
    pd_bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    """`pd_protocol: sglang`: the prefill instances' bootstrap port (SGLang's
    `--disaggregation-bootstrap-port`, 8998 by default); None: each prefill URL's own port (the
    simulated engine's bootstrap server is its HTTP port)."""
    policy: str = "cache_aware"
    tenants: list[str] = Field(default_factory=list)
    """`NAME:KEY` pairs for the quick start; keys are hashed on load and never kept in clear."""
    server_secret: SecretStr | None = None
    server_secret_file: Path | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    directory_capacity_blocks: int = DEFAULT_REPLICA_CAPACITY_BLOCKS
    """Directory entries (`block_bytes` of prompt each) kept per replica at most: the
    approximate directory's LRU bound, in process and in Redis. A replica whose engine reports
    a smaller KV (vLLM's `vllm:cache_config_info`: `num_gpu_blocks` × `block_size` tokens, × the
    DP ranks) keeps what that KV holds instead — tokens × the bytes a token the gateway learned
    from every response / `block_bytes` entries — from its first scrape, and follows it when the
    engine's figures or the ratio move, so the directory forgets a prefix about when the engine
    evicts it (docs/design/directory.md, "Capacity from the engine"). An engine that reports no
    KV capacity (SGLang) keeps this number."""
    directory_size_from_engines: bool = True
    """Cap each replica's directory entries at its engine's reported KV (above). False: every
    replica keeps `directory_capacity_blocks` — for engines with a KV tier their GPU figure does
    not count (a CPU offload tier: LMCache, vLLM's KV offloading)."""
    directory_ttl_s: float = DEFAULT_TTL_S
    absolute_slack_tokens: float = DEFAULT_ABSOLUTE_SLACK_TOKENS
    relative_slack: float = DEFAULT_RELATIVE_SLACK
    decode_token_weight: float = DEFAULT_DECODE_TOKEN_WEIGHT
    """Prefill tokens of load the bound counts per output token a replica still generates (its
    running requests, this gateway's and, from the engine's metrics, others'); 0: prefill
    only."""
    consistent_hash_blocks: int = DEFAULT_CONSISTENT_HASH_BLOCKS
    bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    unhealthy_after: int = DEFAULT_UNHEALTHY_AFTER
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S
    """Bounds an attempt up to the engine's first token (the answer's end, for the few requests
    an engine cannot stream); past it the next replica is tried."""
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    """Bounds each silence of an engine's stream after its first token."""
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    """SIGTERM drains: no new connection or RPC is taken, those in flight get this long to
    finish, then are cut (and billed as aborted); billing and the directory are flushed."""
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """The largest request body any front end reads (413 over it, refused while reading; gRPC's
    maximum message length)."""
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    """How long a request body may take to arrive, whole (408 after)."""
    upstream_max_connections: int = DEFAULT_UPSTREAM_MAX_CONNECTIONS
    # -- hardening round 2 (issue 45, items 5-6; docs/reliability.md) ----------------------
    upstream_max_header_bytes: int = DEFAULT_UPSTREAM_MAX_HEADER_BYTES
    """The longest response head an engine may send (a 502 past it, before any byte is relayed)."""
    upstream_max_body_bytes: int = DEFAULT_UPSTREAM_MAX_BODY_BYTES
    """The largest whole body (a non-streamed answer, a 4xx) read from an engine, or assembled
    from its stream, and the longest event held back (502 past it); a 5xx's body is read only
    for the log's first 200 bytes."""
    tenant_max_inflight: int | None = None
    """Requests one tenant may have in flight at once in this process (429 past it); a tenant's
    `max_inflight` in the tenants file overrides it. None: half of `upstream_max_connections`."""
    client_drain_timeout_s: float = DEFAULT_CLIENT_DRAIN_TIMEOUT_S
    """How long a stream waits for its client to read before it is cut (engine connection
    closed, billed as aborted)."""
    client_keep_alive_s: float = DEFAULT_CLIENT_KEEP_ALIVE_S
    """How long an idle client connection is kept open (uvicorn's `timeout_keep_alive`)."""

    @field_validator("tenant_max_inflight")
    @classmethod
    def _positive_or_none(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("must be positive (or absent: half of upstream_max_connections)")
        return value

    def effective_tenant_max_inflight(self) -> int:
        """`tenant_max_inflight`, or its default share of the upstream slots."""
        if self.tenant_max_inflight is not None:
            return self.tenant_max_inflight
        return max(1, int(self.upstream_max_connections * DEFAULT_TENANT_INFLIGHT_SHARE))

    debug_headers: bool = False
    """Operator debugging only: adds x-kvgate-replica / -matched-blocks / -decision headers.
    Off by default, because they tell a client about cache state."""
    seed: int | None = None
    log_level: str = "info"
    log_format: Literal["plain", "json"] = "plain"
    """Every log line (kvgate's, uvicorn's, the access log) in one format: `plain` text or one
    JSON object per line (the access log's fields as keys)."""
    mode: str = "standalone"
    """`standalone`: kvgate serves the OpenAI API and relays the engines' streams. `epp`: it is
    also an endpoint picker behind Envoy (ext-proc on `epp_port`): Envoy carries the bytes,
    kvgate admits, routes, holds and bills (docs/deployment.md)."""
    epp_port: int = DEFAULT_EPP_PORT
    """The ext-proc gRPC port in `epp` mode (0: any free port)."""
    epp_max_message_timeout_s: float = DEFAULT_EPP_MAX_MESSAGE_TIMEOUT_S
    """Envoy's `max_message_timeout`: a held request asks Envoy to wait this long at most."""
    workers: int = 1
    """Gateway processes in this pod (every core of a node; docs/operations.md#workers). 1: this
    process serves. N > 1: it supervises N workers sharing the public ports (SO_REUSEPORT) and
    serves the admin port with their metrics merged; needs `redis_url`, so they agree on
    placement. The chart sets it to the requested CPU."""
    worker_index: int | None = None
    """Set by the supervisor in each worker's environment (KVGATE_WORKER_INDEX), never by hand:
    the worker's WAL is `billing_wal_dir/worker-<index>`."""
    worker_admin_fd: int | None = None
    """Set by the supervisor in each worker's environment (KVGATE_WORKER_ADMIN_FD), never by
    hand: the open loopback socket (a port the kernel picked) the worker serves its admin
    routes on, for the supervisor to merge; the pod's `/pod` lists the ports."""
    worker_view_fds: tuple[int, ...] = ()
    """Set by the supervisor in each worker's environment (KVGATE_WORKER_VIEW_FDS), never by
    hand: the pod view's datagram sockets — worker 0 sends its probes' and scrapes' findings on
    them, every other worker receives on its one (gateway.fleet.podview)."""
    worker_placement_fds: tuple[int, ...] = ()
    """Set by the supervisor (KVGATE_WORKER_PLACEMENT_FDS), never by hand: this worker's
    receiving end of the pod's placement channel, then the other workers' sending ends
    (gateway.directory.siblings)."""

    # -- shared state: the directory (issue #3), rate limits (issue #6) ------------------------
    redis_url: str | None = None
    """redis://, rediss:// or unix:// — every gateway with the same URL shares one directory,
    one set of rate limits and one view of hot prefixes and fan-out leaders."""
    redis_cluster: bool | None = None
    """True / False, or None to ask the server (`cluster_enabled`)."""
    redis_deadline_s: float = DEFAULT_REDIS_DEADLINE_S
    redis_deadline_per_block_s: float = DEFAULT_REDIS_DEADLINE_PER_BLOCK_S
    """Added to `redis_deadline_s` per block of the chain a lookup reads (directory and event
    index): a lookup's script cost grows with its chain."""
    redis_deadline_cap_s: float = Field(default=DEFAULT_REDIS_DEADLINE_CAP_S, gt=0)
    """The directory's lookup deadline follows twice Redis's recent p99 round trip from
    `redis_deadline_s` up to this (never below `redis_deadline_s`)."""
    redis_write_deadline_s: float = DEFAULT_REDIS_WRITE_DEADLINE_S
    scrape_metrics: bool = True
    """Read each replica's /metrics with every health probe (restarts, load signals)."""
    share_load: bool = True
    """With `redis_url`: publish this gateway's requests in flight per replica and read every
    other gateway's, so the load bound counts theirs exactly (gateway.fleet.shared_load);
    false: other gateways' requests are seen only through the engines' /metrics."""
    load_share_interval_s: float = DEFAULT_LOAD_SHARE_INTERVAL_S
    """How often `share_load` publishes and reads (one Redis round trip)."""
    spread_herd: bool = True
    """With `share_load` and other gateways live: a tie between equally good replicas (the
    load tie-break's) is ranked as the gateways' requests of one instant would be placed in
    the order of their ids, this gateway's at its place (router.herd), so gateways deciding a
    burst at once spread its new prompts rather than all sending them to the same least-loaded
    replica; a gateway alone routes as before either way."""
    place_ahead: bool = False
    """With `share_load` and other gateways live: each request registers its routing inputs
    in Redis and is decided on the published load with the requests registered before it and
    not yet published placed first (gateway.fleet.ahead, router.ahead): N gateways place a
    burst as one gateway would, for one more round trip a decision; a gateway alone routes as
    before either way. Off by default: the model wins (docs/design/directory.md, "The requests
    looked up ahead"), the live runs so far were on an overloaded machine and do not resolve it."""
    herd_pace_ms: float = Field(default=0.0, ge=0)
    """With `share_load` and other gateways live: this gateway's decisions at least this far
    apart, each after the wait on a fresh read of the peers' figures, so a burst's next request
    sees the peers' placements of the last one's instant (docs/design/directory.md, "The
    herd": `kvgate sim --pace`). About the time a peer's placement takes to reach Redis (a
    loop turn and a round trip: 1-2 ms); 0: off (live at 1.5 ms, four gateways read worse TTFT than
    unpaced in two pairs of runs: docs/design/directory.md, "Pacing, live")."""

    # -- hot prefixes and fan-out (issue #5) ----------------------------------------------------
    engine_prefill_tokens_per_s: float = DEFAULT_ENGINE_PREFILL_TOKENS_PER_S
    """What one replica prefills per second: derives the hot-prefix threshold and hold bounds."""
    overflow: bool = True
    overflow_hot_share: float = DEFAULT_HOT_SHARE
    overflow_threshold_per_min: float | None = None
    """A fixed requests/min/replica threshold instead of the one derived from the prefill rate."""
    fanout_hold: bool = True
    fanout_min_tokens: float = DEFAULT_MIN_HOLD_TOKENS
    fanout_max_hold_s: float = DEFAULT_FANOUT_MAX_HOLD_S

    # -- fair flow control (issue 43; docs/flow-control.md) ----------------------------------
    flow_control: bool = True
    """At saturation, requests wait in the gateway in per-scope queues, dequeued fairly (VTC
    within a priority band) when a replica has room; with room, a request dispatches at once."""
    flow_max_pending_prefill_s: float = DEFAULT_FLOW_MAX_PENDING_PREFILL_S
    """A replica has room while its queued prefill is under this much work (at the prefill rate
    `flow_measure_rate` says)."""
    flow_measure_rate: bool = True
    """Flow control counts the running prefills' progress and its room at the engines' prefill
    rate as this gateway's first tokens measure it (uncached tokens over the time from the
    engine beginning each prefill to its first byte), `engine_prefill_tokens_per_s` until 8
    were measured; false: at `engine_prefill_tokens_per_s` always."""
    flow_floor_share: float = DEFAULT_FLOOR_SHARE
    """Dispatches each lower backlogged band earns per dispatch of the best band (0: strict)."""
    flow_lower_band_room_share: float = DEFAULT_LOWER_BAND_ROOM_SHARE
    """While a better band is active (requests queued, or one seen in the last 5 s), a lower
    band's request gets room only under this share of `flow_max_pending_prefill_s`, so the
    better band's next request finds at most that much of it queued at the engine (1: the whole
    bound for every band)."""
    flow_decode_weight: float = DEFAULT_DECODE_WEIGHT
    """What one output token costs in the fairness counters, in prompt tokens."""
    flow_max_queued_per_scope: int = DEFAULT_FLOW_MAX_QUEUED_PER_SCOPE
    flow_max_queued: int = DEFAULT_FLOW_MAX_QUEUED
    flow_max_queue_s: float = DEFAULT_FLOW_MAX_QUEUE_S
    flow_affinity_wait_ms: float = DEFAULT_FLOW_AFFINITY_WAIT_MS
    """When the replica holding a request's cached prefix has no room (and others do), the
    request waits in the gateway for it up to this long, and never longer than the prefill that
    cache saves; then (at 0: at once) the router places it as any request, its cached replica
    included, by cache and load (docs/flow-control.md, "The bounded affinity wait")."""
    flow_share_counters: bool = True
    """With `redis_url`: every gateway (and worker) publishes the service its fair queue gave
    each scope and adds the others' to its counters (batched, approximate), so the fleet's
    shares follow the weights however traffic is spread over gateways
    (gateway.pipeline.flow_shared); false: shares hold per gateway."""
    flow_share_interval_s: float = DEFAULT_LOAD_SHARE_INTERVAL_S
    """How often `flow_share_counters` publishes and reads (one Redis pipeline)."""

    @field_validator("flow_max_pending_prefill_s", "flow_max_queue_s")
    @classmethod
    def _flow_positive_seconds(cls, value: float) -> float:
        if not value > 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("flow_affinity_wait_ms")
    @classmethod
    def _flow_affinity_wait(cls, value: float) -> float:
        if not 0.0 <= value < float("inf"):
            raise ValueError("must be zero or a positive number of milliseconds")
        return value

    @field_validator("flow_max_queued_per_scope", "flow_max_queued")
    @classmethod
    def _flow_positive_count(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("flow_floor_share")
    @classmethod
    def _flow_share(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("must be between 0 and 1")
        return value

    @field_validator("flow_lower_band_room_share")
    @classmethod
    def _flow_room_share(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(
                "must be above 0 and at most 1 (a share of flow_max_pending_prefill_s; 1: "
                "every band gets the whole bound)"
            )
        return value

    @field_validator("flow_decode_weight")
    @classmethod
    def _flow_weight(cls, value: float) -> float:
        if not 0.0 <= value < float("inf"):
            raise ValueError("must be zero or a positive number")
        return value

    # -- tenants, isolation and rate limits (issue 6; docs/tenants.md) ------------------------
    tenants_file: Path | None = None
    """A YAML (or *.json) file of tenants, policies and key hashes, edited by `kvgate tenants`,
    or a mounted Kubernetes Secret holding one; reloaded when it changes."""
    tenants_reload_interval_s: float = DEFAULT_TENANTS_RELOAD_INTERVAL_S
    rate_limit_timeout_s: float = DEFAULT_RATE_LIMIT_TIMEOUT_S
    # -- gRPC (issue 8) --
    grpc_port: int | None = None
    """Serve `kvgate.v1.Gateway` on this port beside HTTP (0: any free port); None: no gRPC."""

    # -- Kubernetes discovery, engine load signals, tracing (issue 9; docs/operations.md) ------
    metrics_interval_s: float | None = DEFAULT_METRICS_INTERVAL_S
    """How often each replica's /metrics is read (load signals, restarts); None: with every
    health probe. Needs `scrape_metrics`."""
    discovery: str = "static"
    """`static`: the `engines` list. `kubernetes`: the engines list plus the ready endpoints of
    the EndpointSlices matching `discovery_label_selector`, watched live."""
    discovery_label_selector: str | None = None
    """Which EndpointSlices are engines, e.g. `kubernetes.io/service-name=vllm` (required with
    `discovery: kubernetes`: an empty selector would include the gateway's own Service)."""
    discovery_namespace: str | None = None
    """None: the pod's own namespace in a cluster, else the kubeconfig context's (or default)."""
    discovery_port_name: str | None = None
    """The EndpointSlice port to use, by name; None: the slice's only port."""
    discovery_scheme: str = "http"
    kubeconfig: Path | None = None
    """None: the in-cluster service account when running in a pod, else ~/.kube/config."""
    discovery_watch_timeout_s: int = DEFAULT_WATCH_TIMEOUT_S
    discovery_retry_s: float = DEFAULT_DISCOVERY_RETRY_S
    discovery_pod_annotations: bool = False
    """Read each discovered engine's Pod (RBAC: `get pods`) for its `kvgate.io/kv-events-port`,
    `kvgate.io/kv-events-replay-port` and `kvgate.io/data-parallel-size` annotations, which
    override `kv_events_port`, `kv_events_replay_port` and `engine_dp_size` for that engine
    (docs/precise.md)."""
    discovery_role_key: str | None = None
    """Prefill/decode roles from discovery (docs/disaggregation.md): the pod label or annotation
    (e.g. `kvgate.io/role`, or llm-d's `llm-d.ai/role`) whose value `decode` puts a discovered
    engine in the decode pool; `prefill`, `both`, any other value or none leave it a prefill
    instance. Each discovered engine's Pod is read for it (RBAC: `get pods`); a pod replaced by
    one of another role, or leaving, changes the pools. Needs `discovery: kubernetes`, `mode:
    standalone` and `workers: 1`."""
    otlp_endpoint: str | None = None
    """Export OpenTelemetry traces over OTLP/HTTP to this URL (e.g.
    http://otel-collector:4318/v1/traces); None: no tracing, and no span is made."""
    trace_sample_ratio: float = 1.0
    """Share of requests traced (the root's decision; a sampled-out request costs no spans)."""
    service_name: str = "kvgate"
    """OpenTelemetry `service.name` of the spans."""

    # -- precise mode: keys from the model's tokenizer, residency from KV events (issue 16;
    # docs/precise.md) ---------------------------------------------------------------------
    tokenizer_dir: Path | None = None
    """The model's tokenizer directory (`tokenizer.json`, `tokenizer_config.json`: the files the
    engines load; in Kubernetes a mounted volume). Set: precise mode — requests are tokenized
    with the model's chat template and keyed per engine block; None: approximate (bytes)."""
    engine_block_size: int = DEFAULT_BLOCK_SIZE
    """The engines' KV block size in tokens (vLLM `--block-size`, SGLang `--page-size`)."""
    kv_events_port: int | None = None
    """Each engine's KV events PUB port on its host (vLLM `kv_events_config.endpoint`); rank r
    of a DP engine on port + r. None: only `kv_events_endpoints`."""
    kv_events_replay_port: int | None = None
    """Each engine's replay ROUTER port (vLLM `replay_endpoint`; off by default in vLLM)."""
    kv_events_endpoints: dict[str, str] = Field(default_factory=dict)
    """Engine URL -> its PUB endpoint (rank 0), e.g. {"http://10.0.0.7:8000": "tcp://10.0.0.7:5557"}."""
    kv_events_replay_endpoints: dict[str, str] = Field(default_factory=dict)
    kv_events_topic: str = ""
    """The engines' `kv_events_config.topic` (a SUB prefix filter)."""
    engine_dp_size: int = 1
    """Data-parallel ranks per engine behind one HTTP port: each rank a cache domain with its
    own events (port + r); the request is sent with `X-data-parallel-rank`."""
    kv_events_shared: bool = False
    """Index the KV events in the shared Redis (`redis_url`): one live gateway owns each
    engine's events (a lease) and writes them; every gateway's lookups read them. False: every
    gateway ingests every engine in process (docs/precise.md, "Who ingests")."""
    kv_events_lease_s: float = DEFAULT_EVENTS_LEASE_S
    """An engine's events pass to another gateway this long after their owner stopped renewing."""
    # -- what one engine's events may cost (issue 45, item 8; docs/precise.md, "Limits") --
    kv_events_max_message_bytes: int = DEFAULT_KV_EVENTS_MAX_MESSAGE_BYTES
    """The largest KV event message read (ZMQ_MAXMSGSIZE on the SUB and replay sockets)."""
    kv_events_drain_budget_s: float = DEFAULT_KV_EVENTS_DRAIN_BUDGET_S
    """Event loop time one read of a feed spends applying batches (the rest on the next turn)."""
    kv_events_max_blocks: int = DEFAULT_KV_EVENTS_MAX_BLOCKS
    """Blocks a domain may hold over all tiers (also capped at the engine's `num_gpu_blocks` on
    the GPU when its metrics give it); past it the domain is wiped."""
    lora_adapters: dict[str, str] = Field(default_factory=dict)
    """LoRA adapter name -> its base model (vLLM `--lora-modules name=path`; a request names
    the adapter as its `model`). Precise mode keys a request for an adapter under it, as the
    engine hashes its blocks (vLLM mixes `lora_name` into every block's extra keys): it matches
    its adapter's blocks only, never the base model's or another adapter's (approximate keys
    root in the model name, the adapter's). Both modes route it by residency
    (docs/adapters.md); a tenant whose `models` leave it out gets a 404, as for a model that
    does not exist."""
    lora_loading: Literal["preloaded", "on_demand"] = "preloaded"
    """Adapters: `preloaded` routes a request only to replicas whose /v1/models lists its
    adapter; `on_demand` also to the base model's other replicas, registering the adapter at
    the one chosen (`/v1/load_lora_adapter`, the engines need VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    lora_adapter_paths: dict[str, str] = Field(default_factory=dict)
    """`on_demand`: the `lora_path` sent to load each adapter (default: its name)."""
    adapter_busy_s: float = Field(default=DEFAULT_ADAPTER_BUSY_S, gt=0)
    """An adapter sent to a replica this recently counts as in use there: routing never evicts
    it for another at the replica's `max_lora` (gateway.fleet.adapters)."""
    mm_tokens_per_image: int = DEFAULT_TOKENS_PER_IMAGE
    """Precise mode: placeholder tokens each image of a chat expands into, as the engines
    expand it (`kvgate engine --mm-tokens-per-image`; docs/precise.md, *Images*)."""
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    displacement_hot_s: float = DEFAULT_DISPLACEMENT_HOT_S
    """`cache_pressure` in precise mode: a block the placement would evict that was used less
    than this long ago weighs a whole live block (router.scorers; an agent's step interval)."""
    displacement_half_life_s: float = DEFAULT_DISPLACEMENT_HALF_LIFE_S
    """`cache_pressure`: past the hot horizon, an evicted block's weight halves this often."""
    # -- conversation affinity (issue 40; cachemap.affinity, router.scorers) ----------------
    affinity_weight: float | None = None
    """`cache_aware`, `cache_pressure`: the weight of a conversation's home, the replica its
    previous request went to, kept after its KV is evicted everywhere (0: off; unset: 1 in
    precise mode, 0 in approximate mode, whose prediction already keeps conversations home)."""
    affinity_capacity: int = DEFAULT_AFFINITY_CAPACITY
    """Conversations whose home this gateway remembers (least recently routed first out)."""
    affinity_ttl_s: float = DEFAULT_AFFINITY_TTL_S
    """A conversation silent this long is new: its home is forgotten."""
    room_weight: float | None = None
    """`cache_aware`, `cache_pressure`: the weight of a replica's room (less KV committed to the
    live conversations homed there scores higher; decides where a turn with nothing cached
    anywhere goes, among the replicas equally fit by load only; 0: off; unset: 0.05 in precise
    mode, 0 in approximate mode). docs/precise.md, "Room and stickiness"."""
    stickiness: float | None = None
    """`cache_aware`, `cache_pressure`: a conversation's home stays within the load bound while
    over it by less than this many times the tokens cached there (0: off; unset: 1 in precise
    mode, 0 in approximate mode, whose overlap at the home is predicted)."""
    offload_cost: float = DEFAULT_OFFLOAD_COST
    tokenizer_check_every: int = DEFAULT_CHECK_EVERY
    """Every Nth precise request (and the first) is checked against the engine's /tokenize (0:
    the first only)."""

    @field_validator("discovery")
    @classmethod
    def _known_discovery(cls, value: str) -> str:
        if value not in DISCOVERY_MODES:
            raise ValueError(
                f"unknown discovery {value!r}; choose one of {', '.join(DISCOVERY_MODES)}"
            )
        return value

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        if value not in MODES:
            raise ValueError(f"unknown mode {value!r}; choose one of {', '.join(MODES)}")
        return value

    @field_validator("discovery_scheme")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if value not in ("http", "https"):
            raise ValueError("discovery_scheme must be http or https")
        return value

    @field_validator("engine_block_size", "engine_dp_size", "mm_tokens_per_image")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("lora_adapters")
    @classmethod
    def _adapters(cls, value: dict[str, str]) -> dict[str, str]:
        for adapter, base in value.items():
            if not adapter or not base or adapter == base:
                raise ValueError(
                    f"{adapter!r}: {base!r}: an adapter and its base model are two non-empty names"
                )
        return value

    @field_validator("tokenizer_dir")
    @classmethod
    def _tokenizer_files(cls, value: Path | None) -> Path | None:
        if value is not None:
            missing = [
                n for n in ("tokenizer.json", "tokenizer_config.json") if not (value / n).is_file()
            ]
            if missing:
                raise ValueError(f"{value} has no {' or '.join(missing)} (the model's tokenizer)")
        return value

    @field_validator("trace_sample_ratio", "offload_cost")
    @classmethod
    def _ratio(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("must be a ratio between 0 and 1")
        return value

    @field_validator(
        "metrics_interval_s",
        "load_share_interval_s",
        "flow_share_interval_s",
        "discovery_retry_s",
        "discovery_watch_timeout_s",
        "speculative_ttl_s",
        "kv_events_lease_s",
        "kv_events_drain_budget_s",
        "displacement_half_life_s",
        "affinity_ttl_s",
    )
    @classmethod
    def _positive_interval(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("affinity_weight", "room_weight", "stickiness")
    @classmethod
    def _non_negative_weight(cls, value: float | None) -> float | None:
        if value is not None and not value >= 0:
            raise ValueError("must be a non-negative weight (0: off)")
        return value

    @field_validator("affinity_capacity")
    @classmethod
    def _positive_capacity(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be a positive number of conversations")
        return value

    @model_validator(mode="after")
    def _discovery_needs_a_selector(self) -> Settings:
        if self.discovery == "kubernetes" and not self.discovery_label_selector:
            raise ValueError(
                "discovery: kubernetes needs discovery_label_selector (which EndpointSlices are "
                "engines, e.g. kubernetes.io/service-name=vllm)"
            )
        return self

    @field_validator("grpc_port", "epp_port", "metrics_port")
    @classmethod
    def _port_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 65535:
            raise ValueError("must be a TCP port, 0..65535 (0: any free port)")
        return value

    # -- billing (issue #7; docs/billing.md) ------------------------------------------------
    billing_wal_dir: Path | None = None
    """Billing is on when set: this gateway's write-ahead log of billing records (one directory
    per gateway, on a persistent volume)."""
    billing_profile: str = DEFAULT_BILLING_PROFILE
    billing_profiles: dict[str, str] = Field(default_factory=dict)
    """tenant name → billing profile, over `billing_profile`."""
    billing_prices_file: Path | None = None
    """A YAML/JSON price table over the defaults (gateway/billing/pricing/prices.py)."""
    billing_model_map: dict[str, str] = Field(default_factory=dict)
    """Served model → the price-table model it is billed as (e.g. kvgate-sim-8b → sonnet-5);
    a key "<profile>:<model>" applies under one profile only."""
    billing_tokenizer: str | None = None
    """`module:function` counting tokens, for exact breakpoint positions; default: bytes mapped
    to tokens proportionally (the error bound is in docs/billing.md)."""
    billing_redis_url: str | None = None
    """The shared ledger store: a standalone Redis with appendonly yes, appendfsync always.
    Without one, the WAL directory is the ledger. With one, the contract's cache entries are
    shared there too, so every gateway bills a tenant from one ledger."""
    billing_ledger_deadline_s: float = DEFAULT_BILLING_LEDGER_DEADLINE_S
    """How long a request's first token waits for the shared cache entries before this
    gateway bills from its own (see docs/billing.md)."""
    billing_lookback_blocks: int = DEFAULT_BILLING_LOOKBACK_BLOCKS
    billing_openai_ttl_s: float = DEFAULT_BILLING_OPENAI_TTL_S
    billing_deepseek_unit: str = "64"
    billing_deepseek_holidays: list[dt.date] = Field(default_factory=list)
    billing_ledger_max_entries: int = DEFAULT_BILLING_LEDGER_MAX_ENTRIES
    """Bounds the tenant-visible cache entries kept in memory (per billing profile)."""
    billing_wal_deadline_s: float = DEFAULT_BILLING_WAL_DEADLINE_S
    """How long a request waits for its billing record to be durable before it fails (503)."""
    billing_gateway_id: str | None = None
    """This gateway's name in ledger records (default host:pid)."""
    # -- billing hardening, round 2 (issue 45, items 1-3) ---------------------------------
    billing_redis_allow_unsafe_fsync: bool = DEFAULT_BILLING_REDIS_ALLOW_UNSAFE_FSYNC
    """Accept a ledger store without appendonly yes / appendfsync always (and no WAITAOF): a
    store crash may then lose shipped records whose segments are already deleted."""
    billing_wal_takeover: bool = DEFAULT_BILLING_WAL_TAKEOVER
    """Ship the WAL directories beside `billing_wal_dir` whose gateway is gone (lock free,
    lease expired): the pods of a Deployment on one shared volume (docs/billing.md)."""
    billing_wal_lease_s: float = DEFAULT_BILLING_WAL_LEASE_S
    """How old a directory's lease must be before another gateway takes it over."""
    admin_keys: list[str] = Field(default_factory=list)
    """Keys for /admin/billing/*: clear keys (hashed on load, never kept) or `sha256:<hex>`."""

    # -- control surfaces (issue 45 items 11, 13) ------------------------------------------------
    epp_token: SecretStr | None = None
    """The picker's shared token: an ext-proc stream must carry `authorization: Bearer TOKEN`
    (Envoy's `grpc_service.initial_metadata`) or is refused UNAUTHENTICATED before a message is
    read. None: any client that reaches `epp_port` may pose as Envoy (keep the port private)."""
    admin_port_auth: bool = False
    """Every route of the admin port (/metrics, the API documents, /pod) takes an `admin_keys`
    key (401 without): /metrics names every tenant's token counts. Off: only the writes do."""

    @field_validator("billing_profile")
    @classmethod
    def _known_billing_profile(cls, value: str) -> str:
        if value not in BILLING_PROFILES:
            raise ValueError(
                f"unknown billing profile {value!r}; choose one of {', '.join(BILLING_PROFILES)}"
            )
        return value

    @field_validator("billing_profiles")
    @classmethod
    def _known_billing_profiles(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, profile in value.items():
            if profile not in BILLING_PROFILES:
                raise ValueError(
                    f"tenant {tenant!r}: unknown billing profile {profile!r}; choose one of "
                    f"{', '.join(BILLING_PROFILES)}"
                )
        return value

    @field_validator("billing_deepseek_unit")
    @classmethod
    def _deepseek_unit(cls, value: str) -> str:
        if value not in ("64", "request_boundaries"):
            raise ValueError("billing_deepseek_unit must be '64' or 'request_boundaries'")
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(POLICIES)}")
        return value

    @field_validator("engines")
    @classmethod
    def _engine_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"engine URL {redact_url(url)!r} must start with http:// or https://"
                )
        return [url.rstrip("/") for url in value]

    @field_validator("tenants")
    @classmethod
    def _tenant_pairs(cls, value: list[str]) -> list[str]:
        for pair in value:
            name, sep, key = pair.partition(":")
            if not sep or not name or not key:
                raise ValueError(f"tenant {pair.split(':')[0]!r} must be given as NAME:KEY")
            check_tenant_name(name)
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"redis_url {redact_url(value)!r} must start with one of {', '.join(REDIS_SCHEMES)}"
            )
        return value

    @field_validator(
        "tenants_reload_interval_s",
        "rate_limit_timeout_s",
        "billing_ledger_deadline_s",
        "epp_max_message_timeout_s",
        "body_read_timeout_s",
        "billing_wal_deadline_s",
        "billing_wal_lease_s",
        "first_byte_timeout_s",
        "stream_idle_timeout_s",
        "connect_timeout_s",
        "shutdown_grace_s",
        "client_drain_timeout_s",
        "client_keep_alive_s",
    )
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("decode_token_weight")
    @classmethod
    def _non_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must be zero or positive")
        return value

    @model_validator(mode="after")
    def _workers_share_a_directory(self) -> Settings:
        if self.workers > 1 and not self.redis_url:
            raise ValueError(
                f"workers: {self.workers} needs redis_url (--redis-url): workers with a directory "
                "each of their own would place one conversation on different replicas; run "
                "Redis beside the gateway (a sidecar on a unix socket, docs/operations.md#workers)"
            )
        return self

    @model_validator(mode="after")
    def _shared_events_need_redis(self) -> Settings:
        if self.kv_events_shared and not (self.redis_url and self.tokenizer_dir):
            raise ValueError(
                "kv_events_shared needs redis_url (--redis-url: where the index is shared) and "
                "tokenizer_dir (--tokenizer-dir: precise mode)"
            )
        return self

    @model_validator(mode="after")
    def _decode_pool_is_standalone(self) -> Settings:
        if self.decode_engines and self.mode != "standalone":
            raise ValueError(
                "decode_engines needs mode: standalone (the gateway drives both legs of a "
                "disaggregated request; an endpoint picker forwards one)"
            )
        if set(self.decode_engines) & set(self.engines):
            raise ValueError("an engine is in engines (prefill) and decode_engines at once")
        if self.discovery_role_key is not None:
            if not self.discovery_role_key.strip():
                raise ValueError("discovery_role_key must name a pod label or annotation")
            if self.discovery != "kubernetes":
                raise ValueError("discovery_role_key needs discovery: kubernetes")
            if self.mode != "standalone":
                raise ValueError(
                    "discovery_role_key needs mode: standalone (the gateway drives both legs "
                    "of a disaggregated request; an endpoint picker forwards one)"
                )
            if self.workers != 1:
                raise ValueError(
                    "discovery_role_key needs workers: 1 (worker 0's endpoint sets carry no "
                    "roles to the other workers yet)"
                )
        return self

    @model_validator(mode="after")
    def _body_holds_a_prompt(self) -> Settings:
        if self.max_body_bytes < self.max_prompt_bytes:
            raise ValueError(
                f"max_body_bytes ({self.max_body_bytes}) must be at least max_prompt_bytes "
                f"({self.max_prompt_bytes}): a body holds its prompt"
            )
        return self

    @model_validator(mode="after")
    def _admin_auth_needs_keys(self) -> Settings:
        if self.admin_port_auth and not self.admin_keys:
            raise ValueError("admin_port_auth needs admin_keys: no key could open the admin port")
        if self.epp_token is not None and not self.epp_token.get_secret_value():
            raise ValueError("epp_token is empty: set a token or leave it unset")
        return self

    @field_validator(
        "block_bytes",
        "directory_capacity_blocks",
        "max_attempts",
        "unhealthy_after",
        "max_body_bytes",
        "max_prompt_bytes",
        "billing_ledger_max_entries",
        "workers",
        "upstream_max_header_bytes",
        "upstream_max_body_bytes",
        "kv_events_max_message_bytes",
        "kv_events_max_blocks",
    )
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    def secret_bytes(self) -> bytes:
        """The server secret that keys every tenant's salt.

        Gateways that share a directory must share it. Without one, a random secret is made and
        a warning logged: fine for a single gateway, wrong for a fleet.
        """
        if self.server_secret is not None:
            return self.server_secret.get_secret_value().encode()
        if self.server_secret_file is not None:
            return self.server_secret_file.read_bytes().strip()
        log.warning(
            "no server secret configured (KVGATE_SERVER_SECRET or --server-secret-file): "
            "using a random one; gateways that must agree on salts need the same secret"
        )
        return secrets.token_bytes(32)


def redact_url(url: str) -> str:
    """A URL fit for a message: whatever precedes an '@' (a user and password) becomes ***."""
    scheme, sep, rest = url.rpartition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


def describe_errors(exc: ValidationError) -> str:
    """Invalid settings as lines of "field: reason", never the values given: pydantic's own
    text repeats each input (and a model-level error the whole input), which would print every
    tenant key, admin key and the Redis password to the terminal and the logs."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"  {where}: {error['msg']}")
    return "\n".join(lines)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings from flags (`overrides`, None values ignored), env, the YAML file, defaults."""
    token = _config_file.set(config_file)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _config_file.reset(token)
