"""Fair flow control through a real gateway and real engines (issue 43): the noisy neighbour.

Tenant A (acme) floods two engines with closed-loop clients of distinct long prompts; tenant B
(globex) sends a short prompt at a time. Without flow control B's request joins the engines'
FIFO queues behind A's backlog; with it A's backlog waits in the gateway, in A's own sub-queue,
and B's request overtakes it. The test counts, for each of B's requests, A's requests served
ahead of it after it came, in the gateway's dispatch order and the engines' FIFO order (a
count of events in order, not of a wall-clock window: it holds on a loaded machine)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.billing.wal import read_directory
from gateway.request.parsed import CHAT, ParsedRequest
from gateway.tenancy.tenant_file import add_key
from loadgen.engine.timing import TimingModel
from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.clients import anthropic_client, director, grpc_stub
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, engine_of, metrics_url
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

PREFILL_TOKENS_PER_S = 10_000
TIMING = TimingModel(prefill_tokens_per_s=PREFILL_TOKENS_PER_S, decode_s_per_token=0.0005)
"""A's prompt (~2,000 tokens) prefills in ~0.2 s: 24 of them are a backlog of ~2 s per engine,
which builds even when a loaded machine takes ~1 s to turn a flooder's answer into its next
request (at ~50 ms a prefill, the engines drained faster than a load average of ~12 let the
flood refill them, and no backlog was left to overtake)."""
A_CLIENTS = 24
B_REQUESTS = 3
B_MAX_TOKENS = 1_000
"""B's prompts (~130 tokens) are under it, A's (~2,000) over: how an engine tells them apart."""


class _Overtaking:
    """For each of B's requests, how many of A's requests were served ahead of it after it
    came: A's requests the gateway sent to an engine between B's entry into flow control and
    B's own dispatch (the gateway's dispatch order), plus A's requests waiting in the FIFO of
    B's engine when B reached it (the engine's order). Counted in the engines' and the
    gateway's own order of events, not by the wall clock: how long anything takes on a loaded
    machine does not change it. Without flow control B enters no gateway queue: the engine's
    FIFO alone counts."""

    def __init__(self, engines: list[Served]) -> None:
        self.a_dispatched: dict[int, list[None]] = {}
        """Per engine (its core's id), one item per A request it was sent (appended on the
        engine's thread, its length read on the gateway's)."""
        self.entered: dict[int, int] | None = None
        self.ahead: list[int] = []
        for served in engines:
            core = engine_of(served).core
            self.a_dispatched[id(core)] = []
            core.submit = functools.partial(self._submit, core, core.submit)  # type: ignore[method-assign]

    def _submit(
        self, core: Any, submit: Callable[[float, Any], None], now: float, job: Any
    ) -> None:
        sent = self.a_dispatched[id(core)]
        if job.num_prompt_tokens >= B_MAX_TOKENS:  # one of A's long prompts
            sent.append(None)
        else:  # B's, one at a time: whatever waits at this engine is A's
            since = 0 if self.entered is None else len(sent) - self.entered[id(core)]
            self.ahead.append(since + core.num_waiting)
            self.entered = None
        submit(now, job)

    def watch(self, gateway: Served) -> None:
        """Mark B's entry into the gateway's flow control (where it may wait)."""
        flow = director(gateway).flow
        if flow is None:
            return
        try_enter = flow.try_enter

        def entering(tenant: Any, *args: Any) -> Any:
            if tenant.name == "globex":
                self.entered = {core: len(sent) for core, sent in self.a_dispatched.items()}
            return try_enter(tenant, *args)

        flow.try_enter = entering  # type: ignore[method-assign,assignment]

    def reset(self) -> list[int]:
        ahead, self.ahead, self.entered = self.ahead, [], None
        return ahead


async def _noisy_neighbour(gateway: Served) -> list[int]:
    """Every status seen while A floods and B sends its requests one at a time."""
    statuses: list[int] = []
    stop = asyncio.Event()
    saturated = asyncio.Event()
    answered = 0

    async def post(client: httpx.AsyncClient, key: str, content: str) -> int:
        r = await client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 1,
            },
        )
        statuses.append(r.status_code)
        return r.status_code

    async def flooder(client: httpx.AsyncClient, i: int) -> None:
        nonlocal answered
        n = 0
        while not stop.is_set():  # bounded: the B side sets it
            await post(client, TENANT_KEY, f"A{i}-{n} " + words(f"flood{i}-{n}", 1_500))
            answered += 1
            if answered >= 4:  # the engines are busy, the other clients' requests behind
                saturated.set()
            n += 1

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0, limits=limits) as client:
        flood = [asyncio.create_task(flooder(client, i)) for i in range(A_CLIENTS)]
        try:
            await asyncio.wait_for(saturated.wait(), 30.0)
            for k in range(B_REQUESTS):
                assert await post(client, OTHER_KEY, f"B{k} " + words(f"light{k}", 100)) == 200
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*flood), 30.0)
    return statuses


def test_a_light_tenant_overtakes_a_flooding_tenants_backlog(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, timing=TIMING)
    overtaking = _Overtaking(engines)
    common: dict[str, Any] = {
        "engine_prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "flow_max_pending_prefill_s": 0.04,
    }
    off = start_gateway(engines, flow_control=False, **common)
    statuses_off = asyncio.run(_noisy_neighbour(off))
    off.stop()
    ahead_off = overtaking.reset()
    on = start_gateway(engines, **common)
    overtaking.watch(on)
    statuses_on = asyncio.run(_noisy_neighbour(on))
    ahead_on = overtaking.reset()
    assert set(statuses_on) == {200} and set(statuses_off) == {200}
    assert len(ahead_off) == len(ahead_on) == B_REQUESTS
    # off: B waits behind the engines' FIFO backlog of A's requests (~12 per engine);
    # on: behind what is already at its engine (about one prefill), not A's queue
    median_off, median_on = (sorted(a)[B_REQUESTS // 2] for a in (ahead_off, ahead_on))
    assert median_off >= 6 and median_on <= 2, (ahead_off, ahead_on)
    metrics = httpx.get(metrics_url(on) + "/metrics").text
    assert 'kvgate_flow_dispatched_total{band="0",how="queued"}' in metrics
    assert "kvgate_flow_queue_seconds_bucket" in metrics and "kvgate_replica_room_tokens" in metrics
    tenant_port = httpx.get(on.url + "/metrics", headers={"authorization": f"Bearer {TENANT_KEY}"})
    assert "kvgate_flow" not in tenant_port.text


# -- bounded and explicit, in every API's shape -------------------------------------------------
def _ask(gateway: Served, key: str, content: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
            **extra,
        },
        timeout=30.0,
    )


def test_a_full_queue_answers_in_each_apis_shape_and_a_client_gone_reaches_no_engine(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """No room (a lease the test holds on the only replica): acme's two requests wait; a third
    of acme's is a 429 (its own backlog), globex's first a 503 (the gateway's queue is full), in
    OpenAI's, Anthropic's and gRPC's shapes; a queued client that leaves is removed and never
    reaches the engine; once the room is back the others are answered."""
    (engine,) = start_engines(1)
    gateway = start_gateway([engine], flow_max_queued_per_scope=2, flow_max_queued=2, grpc_port=0)
    d = director(gateway)
    assert d.flow is not None
    flow = d.flow
    state = d.replicas.states[engine.url]
    hold = gateway.on_loop(lambda: state.lease(10**9))
    seen = len(engine_of(engine).seen_headers)

    async def queued() -> tuple[list[int], None]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as client:

            async def one(n: int) -> int:
                r = await client.post(
                    "/v1/chat/completions",
                    headers={"authorization": f"Bearer {TENANT_KEY}"},
                    json={
                        "model": MODEL,
                        "max_tokens": 1,
                        "messages": [{"role": "user", "content": f"queued {n}"}],
                    },
                )
                return r.status_code

            waiting = [asyncio.create_task(one(n)) for n in range(2)]
            # both queued before the third is sent: sent at once, the gateway could take the
            # third first, queue it, and give one of the two the 429 (the test then waited
            # 30 s on a request nothing would dispatch)
            await asyncio.to_thread(
                wait_until, lambda: gateway.on_loop(lambda: len(flow.queue)) == 2, 10.0, "queued"
            )
            assert await one(2) == 429  # over the scope's limit: a 429 at once
            await asyncio.to_thread(_refusals_in_every_shape, gateway)
            waiting[1].cancel()  # its client leaves while it waits
            await asyncio.to_thread(
                wait_until,
                lambda: gateway.on_loop(lambda: len(flow.queue)) == 1,
                10.0,
                "the client gone removed",
            )
            gateway.on_loop(hold.release)  # room again
            return [await waiting[0]], None

    statuses, _ = asyncio.run(queued())
    assert statuses == [200]
    assert len(engine_of(engine).seen_headers) == seen + 1  # the one that left never got there
    rejects = gateway.on_loop(lambda: dict(flow.stats.rejects))
    assert rejects["client_gone"] == 1 and rejects["scope_full"] >= 3
    assert rejects["gateway_full"] >= 3


def _refusals_in_every_shape(gateway: Served) -> None:
    # OpenAI: acme's own backlog is full (429 + Retry-After), globex finds the gateway full (503)
    own = _ask(gateway, TENANT_KEY, "one too many")
    assert own.status_code == 429 and own.json()["error"]["code"] == "queue_full"
    assert int(own.headers["retry-after"]) >= 1
    full = _ask(gateway, OTHER_KEY, "no room for anyone")
    assert full.status_code == 503 and full.json()["error"]["code"] == "overloaded"
    assert "retry-after" in full.headers and "acme" not in full.text
    # Anthropic: rate_limit_error and overloaded_error
    with pytest.raises(anthropic.RateLimitError) as limited:
        anthropic_client(gateway).messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        anthropic_client(gateway, OTHER_KEY).messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
    assert overloaded.value.status_code == 529  # Anthropic's status for overloaded_error
    assert "retry-after" in overloaded.value.response.headers
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    # gRPC: RESOURCE_EXHAUSTED and UNAVAILABLE
    for key, code in (
        (TENANT_KEY, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (OTHER_KEY, grpc.StatusCode.UNAVAILABLE),
    ):
        with pytest.raises(grpc.RpcError) as info:
            grpc_stub(gateway).Generate(
                pb.GenerateRequest(
                    model=MODEL,
                    messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="x")])],
                    sampling=pb.Sampling(max_tokens=1),
                ),
                metadata=(("authorization", f"Bearer {key}"),),
                timeout=10.0,
            )
        error: Any = info.value
        assert error.code() == code, error.details()


def test_priority_outside_the_keys_range_is_a_400_naming_it(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1))
    r = _ask(gateway, TENANT_KEY, "hi", priority=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = _ask(gateway, TENANT_KEY, "hi", priority="high")
    assert r.status_code == 400 and "'priority' must be an integer" in r.json()["error"]["message"]
    assert _ask(gateway, TENANT_KEY, "hi", priority=0).status_code == 200  # its own band


def test_priority_on_anthropic_and_grpc_is_checked_and_orders_their_requests_in_the_queue(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served], tmp_path: Path
) -> None:
    """`priority` on the Messages API (the real anthropic SDK, `extra_body`) and on gRPC (the
    proto's field): outside the key's range a 400 / INVALID_ARGUMENT naming it; within it, the
    request waits in its band of the gateway's queue (no room: a lease the test holds) beside
    an OpenAI request of the key's own band, and every one is answered once room is back."""
    tenants = tmp_path / "tenants.yaml"
    key, _, _ = add_key(tenants, "mixed", priority=5, priority_range=(0, 5))
    (engine,) = start_engines(1)
    gateway = start_gateway([engine], tenants_file=tenants, grpc_port=0)
    flow = director(gateway).flow
    assert flow is not None
    client = anthropic_client(gateway, key)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"priority": 6},
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "'priority' 6" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"priority": "urgent"},
        )
    assert "'priority' must be an integer" in bad.value.body["error"]["message"]  # type: ignore[index]

    def grpc_request(priority: int) -> Any:
        return grpc_stub(gateway).Generate(
            pb.GenerateRequest(
                model=MODEL,
                messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="g")])],
                sampling=pb.Sampling(max_tokens=1),
                priority=priority,
            ),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=30.0,
        )

    with pytest.raises(grpc.RpcError) as info:
        grpc_request(-1)
    error: Any = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'priority' -1" in error.details()

    state = director(gateway).replicas.states[engine.url]
    hold = gateway.on_loop(lambda: state.lease(10**9))

    async def queued() -> list[object]:
        def bands() -> dict[int, int]:
            out: dict[int, int] = {}
            for (_, band), n in flow.queue.depths().items():
                out[band] = out.get(band, 0) + n
            return out

        def openai_default() -> int:
            return _ask(gateway, key, "openai, the key's band").status_code

        def anthropic_urgent() -> str:
            answer = client.messages.create(
                model=MODEL,
                max_tokens=1,
                messages=[{"role": "user", "content": "anthropic, urgent"}],
                extra_body={"priority": 0},
            )
            return answer.type

        def grpc_urgent() -> int:
            return int(grpc_request(0).usage.prompt_tokens > 0)

        tasks = [
            asyncio.create_task(asyncio.to_thread(f))
            for f in (openai_default, anthropic_urgent, grpc_urgent)
        ]
        await asyncio.to_thread(
            wait_until,
            lambda: gateway.on_loop(bands) == {5: 1, 0: 2},
            10.0,
            "one request in band 5 and two in band 0",
        )
        gateway.on_loop(hold.release)
        return list(await asyncio.gather(*tasks))

    assert asyncio.run(queued()) == [200, "message", 1]
    dispatched = gateway.on_loop(lambda: dict(flow.stats.dispatched))
    assert dispatched[("0", "queued")] == 2 and dispatched[("5", "queued")] == 1


def test_queue_time_is_in_the_billing_record_and_the_access_log(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request that waited for room (a lease the test holds, released once the request has
    waited at least 50 ms) has that wait in its billing record (`queue_ms`) and its access
    line; one that found room has 0."""
    (engine,) = start_engines(1)
    gateway = start_gateway(
        [engine], billing_wal_dir=tmp_path / "wal", billing_model_map={MODEL: "sonnet-5"}
    )
    flow = director(gateway).flow
    assert flow is not None
    assert _ask(gateway, TENANT_KEY, "room at once").status_code == 200
    state = director(gateway).replicas.states[engine.url]
    hold = gateway.on_loop(lambda: state.lease(10**9))

    async def queued() -> httpx.Response:
        waiting = asyncio.create_task(asyncio.to_thread(_ask, gateway, TENANT_KEY, "waits"))
        await asyncio.to_thread(
            wait_until, lambda: gateway.on_loop(lambda: len(flow.queue)) == 1, 10.0, "queued"
        )
        since = time.monotonic()
        await asyncio.to_thread(wait_until, lambda: time.monotonic() - since >= 0.05, 5.0, "50 ms")
        gateway.on_loop(hold.release)
        return await waiting

    caplog.set_level(logging.INFO, logger="kvgate.access")
    answer = asyncio.run(queued())
    assert answer.status_code == 200
    billing_id = answer.json()["usage"]["kvgate_billing"]["id"]
    records = {r["id"]: r for r in read_directory(tmp_path / "wal")}
    assert records[billing_id]["queue_ms"] >= 50
    assert [r["queue_ms"] for i, r in records.items() if i != billing_id] == [0]

    def access_line() -> dict[str, Any] | None:  # logged when the exchange ends: wait for it
        for r in caplog.records:
            fields: dict[str, Any] = r.__dict__.get("fields", {})
            if fields.get("request_id") == answer.headers["x-request-id"]:
                return fields
        return None

    wait_until(lambda: access_line() is not None, what="the queued request's access line")
    line = access_line()
    assert line is not None and line["queue_ms"] >= 50


def test_a_request_queued_before_its_tenant_was_learnt_is_leased_at_the_learnt_size(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """A request keyed at the default bytes per token waits for room; while it waits, its
    tenant's first answer teaches the estimator a ratio 1.5 times the default. Let through, it is
    placed, and its lease counts, at the learnt size: at the stale one, the room's progress
    estimate would expect its prefill to end after the engine had finished it (in the noisy
    neighbour every A request queued at the start was 1.6 times its real size, so the next
    request went only when the first token came back and the engines idled between prefills)."""
    (engine,) = start_engines(1)
    gateway = start_gateway([engine])
    the_director = director(gateway)
    state = the_director.replicas.states[engine.url]
    hold = gateway.on_loop(lambda: state.lease(10**9))
    leased: list[float] = []
    lease = state.lease

    def recording(uncached_tokens: float, output_tokens: float = 0.0) -> Any:
        leased.append(uncached_tokens)
        return lease(uncached_tokens, output_tokens)

    state.lease = recording  # type: ignore[method-assign]
    flow = the_director.flow
    assert flow is not None
    default = the_director.estimator.default_bytes_per_token
    content = words("queued-before-learning", 400)
    keyed: list[float] = []
    wait = flow.wait

    async def waiting(*args: Any, **kwargs: Any) -> Any:
        keyed.append(args[3])  # its prompt tokens as keyed: at the default ratio
        return await wait(*args, **kwargs)

    flow.wait = waiting  # type: ignore[method-assign]

    async def queued() -> httpx.Response:
        waiting = asyncio.create_task(asyncio.to_thread(_ask, gateway, TENANT_KEY, content))
        await asyncio.to_thread(
            wait_until, lambda: gateway.on_loop(lambda: len(flow.queue)) == 1, 10.0, "queued"
        )

        def learn() -> None:  # the tenant's first answer, 1.5 times the default ratio
            parsed = ParsedRequest(CHAT, MODEL, {}, b"x" * 3_000, False, False)
            the_director.estimator.learn(parsed, round(3_000 / (1.5 * default)), tenant="acme")

        gateway.on_loop(learn)
        gateway.on_loop(hold.release)
        return await waiting

    answer = asyncio.run(queued())
    assert answer.status_code == 200
    (tokens,) = leased
    (at_default,) = keyed
    assert tokens == pytest.approx(at_default / 1.5, rel=0.01), (tokens, at_default)


@pytest.mark.parametrize("share", [True, False])
def test_two_gateways_on_one_redis_share_their_fairness_counters(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    fresh_redis: RedisServer,
    share: bool,
) -> None:
    """Gateway 1 has acme and globex backlogged (no room: a lease the test holds there), two
    requests each, acme's first; gateway 2 serves acme three requests. Sharing (the default
    with a Redis), gateway 1's counter for acme grows by what gateway 2 served it, so globex
    is ahead there and the fleet's shares even out; without, gateway 1 knows only its own.
    Either way every request is answered once room is back."""
    (engine,) = start_engines(1)
    # (share_load off: gateway 2 must not count the lease gateway 1's test holds)
    common: dict[str, Any] = {
        "redis_url": fresh_redis.url,
        "flow_share_counters": share,
        "share_load": False,
    }
    one = start_gateway([engine], flow_share_interval_s=0.05, **common)
    two = start_gateway([engine], flow_share_interval_s=0.05, **common)
    flow = director(one).flow
    assert flow is not None
    tenants = one.app.state.tenants
    acme, globex = (tenants.authenticate(k).scope for k in (TENANT_KEY, OTHER_KEY))
    state = director(one).replicas.states[engine.url]
    hold = one.on_loop(lambda: state.lease(10**9))

    def counters() -> tuple[float, float]:
        def read() -> tuple[float, float]:
            return flow.queue.counter(acme, 0) or 0.0, flow.queue.counter(globex, 0) or 0.0

        return one.on_loop(read)

    async def run() -> tuple[list[int], float]:
        asks = [
            asyncio.create_task(asyncio.to_thread(_ask, one, key, f"{key} {n}"))
            for key in (TENANT_KEY, OTHER_KEY)
            for n in range(2)
        ]
        await asyncio.to_thread(
            wait_until, lambda: one.on_loop(lambda: len(flow.queue)) == 4, 10.0, "4 queued"
        )
        if share:  # gateway 1 has read acme's total once (a scope's first read is its
            # baseline: service published before it would count as history, not as news)
            shared = flow.shared
            assert shared is not None
            start = one.on_loop(lambda: shared.rounds)
            await asyncio.to_thread(
                wait_until,
                lambda: one.on_loop(lambda: shared.rounds) >= start + 2,
                10.0,
                "gateway 1's rounds with acme tracked",
            )
        before = counters()
        served = [
            (
                await asyncio.to_thread(
                    _ask, two, TENANT_KEY, f"elsewhere {n} " + words(f"e{n}", 300)
                )
            )
            for n in range(3)
        ]
        assert [r.status_code for r in served] == [200, 200, 200]
        prompt = sum(r.json()["usage"]["prompt_tokens"] for r in served)
        if share:  # gateway 2's service reaches gateway 1's counter for acme (not globex's)
            await asyncio.to_thread(
                wait_until,
                lambda: counters()[0] - before[0] >= 0.9 * prompt,
                10.0,
                "gateway 2's service in gateway 1's counter",
            )
        gained = counters()[0] - before[0]
        assert counters()[1] == before[1]
        one.on_loop(hold.release)
        return [(await a).status_code for a in asks], gained

    statuses, gained = asyncio.run(run())
    assert statuses == [200] * 4
    metrics = httpx.get(metrics_url(one) + "/metrics").text
    assert ('kvgate_flow_shared_rounds_total{event="ok"}' in metrics) is share
    if not share:
        assert gained == 0.0  # nothing dispatched at gateway 1 while it held: its own counters


# -- the bounded affinity wait ------------------------------------------------------------------
HISTORY_WORDS = 6_000
"""A conversation's history of ~8,000 tokens: at the gateway's assumed 250 prefill tokens/s its
cache saves ~32 s of prefill, more than either wait below (20 s, 0.3 s): the bound is the wait."""


def _turn(gateway: Served, history: str, n: int) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": history},
                {"role": "user", "content": f"question {n}"},
            ],
            "max_tokens": 1,
        },
        timeout=30.0,
    )


@pytest.mark.parametrize(
    ("released", "held_tokens"),
    [(True, 10**9), (False, 2_000), (False, 10**9)],
    ids=["room-within-the-bound", "past-it-its-cache-kept", "past-it-its-replica-overloaded"],
)
def test_a_request_waits_a_bounded_time_for_its_full_cached_replica(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    released: bool,
    held_tokens: int,
) -> None:
    """A conversation's second turn finds the replica holding its history full (a lease the
    test holds) while the other is idle. It waits in the gateway for its replica, the other
    replica free for anyone else (a request of another tenant goes there at once): (a) room
    back within the bound, it lands on its replica as a prefix hit; past the bound (0.3 s), its
    replica still full, the router places it as any request, its cached replica included: (b)
    held by 2,000 tokens (within the router's load slack), it still lands there, a prefix hit
    (issue 39: it was sent cold to the idle replica, and bench point 1 lost hits and TTFT);
    (c) held by 10^9 tokens, the router's load bound sends it to the idle replica, cold."""
    engines = start_engines(2)
    wait_ms = 20_000.0 if released else 300.0
    gateway = start_gateway(engines, engine_prefill_tokens_per_s=250, flow_affinity_wait_ms=wait_ms)
    flow = director(gateway).flow
    assert flow is not None
    history = "History:" + words(f"affinity/{released}", HISTORY_WORDS)
    first = _turn(gateway, history, 0)
    assert first.status_code == 200
    home = first.headers["x-kvgate-replica"]
    state = director(gateway).replicas.states[home]
    hold = gateway.on_loop(lambda: state.lease(held_tokens))

    async def second() -> tuple[httpx.Response, httpx.Response]:
        turn = asyncio.create_task(asyncio.to_thread(_turn, gateway, history, 1))
        if released:
            await asyncio.to_thread(
                wait_until,
                lambda: gateway.on_loop(lambda: len(flow.queue)) == 1,
                10.0,
                "the turn waiting for its replica",
            )
            # the fleet is not held idle: another tenant's request goes to the free replica
            other = await asyncio.to_thread(_ask, gateway, OTHER_KEY, "meanwhile")
            assert gateway.on_loop(lambda: len(flow.queue)) == 1  # the turn still waits
            gateway.on_loop(hold.release)
            return await turn, other
        answer = await turn  # past the bound, its replica still full
        gateway.on_loop(hold.release)
        return answer, answer

    answer, other = asyncio.run(second())
    assert answer.status_code == 200 and other.status_code == 200
    cached = answer.json()["usage"]["engine_cached_tokens"]
    outcomes = gateway.on_loop(lambda: dict(flow.stats.affinity))
    if released:
        assert other.headers["x-kvgate-replica"] != home
    if released or held_tokens < 10**9:
        assert answer.headers["x-kvgate-replica"] == home
        assert cached >= 0.9 * first.json()["usage"]["prompt_tokens"]  # a prefix hit
    else:
        assert answer.headers["x-kvgate-replica"] != home
        assert cached == 0  # cold elsewhere: the router's load bound
    assert outcomes == ({"waited": 1} if released else {"bound": 1})
    metrics = httpx.get(metrics_url(gateway) + "/metrics").text
    outcome = "waited" if released else "bound"
    assert f'kvgate_flow_affinity_total{{outcome="{outcome}"}} 1.0' in metrics


# -- fan-out holds and the queue compose --------------------------------------------------------
FANOUT_TIMING = TimingModel(prefill_tokens_per_s=2_000, decode_s_per_token=0.001)
"""The leader's ~4,000-token write takes ~2 s: its siblings are sent while it writes."""
SHARED = "Shared context:" + words("flow/fanout", 3_000)


async def _subtask(client: httpx.AsyncClient, key: str, i: int) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SHARED},
                {"role": "user", "content": f"Subtask {i}:" + words(f"flow/task{i}", 50)},
            ],
            "max_tokens": 1,
        },
    )


def test_held_fan_out_siblings_are_charged_once_not_queued_and_go_to_their_leaders_replica(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """The fleet has no room (a lease the test holds fills one replica, the fan-out's leader's
    ~4,000-token prefill the other): siblings sent while the leader writes are held by it, not
    queued too (one dispatch each, `sibling`, none `queued`: they take no queue share twice),
    and each goes to the leader's replica as a prefix hit when it lands; another tenant's
    request meanwhile waits in the queue."""
    engines = start_engines(2, timing=FANOUT_TIMING)
    gateway = start_gateway(engines, engine_prefill_tokens_per_s=2_000)
    d = director(gateway)
    flow, flights = d.flow, d.placement.flights
    assert flow is not None and flights is not None
    full = d.replicas.states[engines[1].url]
    hold = gateway.on_loop(lambda: full.lease(10**9))
    siblings = 6

    async def fan_out() -> tuple[httpx.Response, list[httpx.Response], httpx.Response]:
        def state() -> tuple[dict[tuple[str, str], int], int, int]:
            return dict(flow.stats.dispatched), len(flow.queue), len(flights)

        async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as client:
            leader = asyncio.create_task(_subtask(client, TENANT_KEY, 0))
            await asyncio.to_thread(
                wait_until, lambda: gateway.on_loop(lambda: len(flights)) > 0, 10.0, "the leader"
            )
            held = [
                asyncio.create_task(_subtask(client, TENANT_KEY, i)) for i in range(1, siblings + 1)
            ]
            other = asyncio.create_task(_subtask(client, OTHER_KEY, 99))
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    gateway.on_loop(state)[0].get(("0", "sibling")) == siblings
                    and gateway.on_loop(state)[1] == 1
                ),
                10.0,
                "the siblings held and globex's request queued",
            )
            assert gateway.on_loop(state)[2] > 0, "the leader landed before they were held"
            answers = [await h for h in held]
            first = await leader
            gateway.on_loop(hold.release)
            return first, answers, await other

    first, answers, other = asyncio.run(fan_out())
    assert first.status_code == other.status_code == 200
    assert [a.status_code for a in answers] == [200] * siblings
    leader_replica = first.headers["x-kvgate-replica"]
    assert leader_replica == engines[0].url
    assert {a.headers["x-kvgate-replica"] for a in answers} == {leader_replica}
    shared_tokens = first.json()["usage"]["prompt_tokens"] * 0.8
    assert all(a.json()["usage"]["engine_cached_tokens"] >= shared_tokens for a in answers)
    dispatched = gateway.on_loop(lambda: dict(flow.stats.dispatched))
    # acme: the leader immediate, every sibling once as a sibling; globex's the one queued
    assert dispatched == {("0", "immediate"): 1, ("0", "sibling"): siblings, ("0", "queued"): 1}


# -- every exit path gives the room back --------------------------------------------------------
EXIT_TIMING = TimingModel(prefill_tokens_per_s=PREFILL_TOKENS_PER_S, decode_s_per_token=0.002)
"""~0.1 s per 1,000-token prefill, ~0.1 s of decode for 50 tokens: a stream cut mid-way is
cut while the engine still decodes it."""


async def _every_exit(gateway: Served, shared_prefix: str) -> list[str]:
    """Requests that end in every way the gateway knows, side by side on two full engines:
    answered (streamed and not), fan-out siblings of one prefix, clients that leave while
    queued or while their answer streams, answers cut by the engines (a 500 before the first
    byte, a hang past the first-byte timeout: both retried on the other replica), queue
    timeouts (429 / 503). What each ended with."""
    outcomes: list[str] = []

    async def one(client: httpx.AsyncClient, n: int) -> None:
        if n % 4 == 0 and n:  # fan-out siblings: after their leader (n = 0) is placed
            await asyncio.sleep(0.05)
        content = (shared_prefix if n % 4 == 0 else "") + f"R{n} " + words(f"exit{n}", 1_200)
        key = TENANT_KEY if n % 3 else OTHER_KEY
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        headers = {"authorization": f"Bearer {key}"}
        try:
            if n % 5 == 0:  # streamed, its client gone after the first chunk
                body |= {"max_tokens": 50, "stream": True}
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    async for _ in r.aiter_raw():
                        break
                outcomes.append(f"cut {r.status_code}")
                return
            body["max_tokens"] = 2
            timeout = 0.3 if n % 7 == 0 else 30.0  # the client leaves (queued, or in flight)
            r = await client.post(
                "/v1/chat/completions", json=body, headers=headers, timeout=timeout
            )
            outcomes.append(str(r.status_code))
        except httpx.TimeoutException:
            outcomes.append("client left")

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as client:
        await asyncio.gather(*(one(client, n) for n in range(40)))
    return outcomes


def test_every_way_a_request_ends_gives_its_room_back(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """Tokens in transit, claims and leases are returned whichever way a request ends (issue
    43: an unexplained stall at a room bound of 0.05 s, the suspect a leak of them): after 40
    requests ending every way (`_every_exit`), on engines that fail and hang some first bytes,
    with a queue bound that times some out, nothing is left counted — no transit, no claim, no
    lease, an empty queue, the admin port's gauges at rest — and the next request is answered
    at once, without waiting for room."""
    engines = start_engines(1, timing=EXIT_TIMING, fail_first_bytes=2)
    engines += start_engines(1, timing=EXIT_TIMING, hang_first_bytes=1)
    gateway = start_gateway(
        engines,
        engine_prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
        flow_max_pending_prefill_s=0.02,
        flow_max_queue_s=1.5,
        first_byte_timeout_s=1.0,
        fanout_min_tokens=100,
    )
    d = director(gateway)
    flow = d.flow
    assert flow is not None
    outcomes = asyncio.run(_every_exit(gateway, words("shared prefix", 800) + " "))
    assert {"200", "client left"} <= set(outcomes), outcomes
    assert any(o.startswith("cut") for o in outcomes), outcomes

    def at_rest() -> bool:
        states = d.replicas.states.values()
        return not flow.queue and all(s.num_inflight == 0 for s in states)

    wait_until(lambda: gateway.on_loop(at_rest), 30.0, "every request off the engines")

    def left_counted() -> tuple[float, dict[str, float], list[float], list[int]]:
        states = list(d.replicas.states.values())
        return (
            flow.transit_tokens,
            dict(flow.claimed),
            [s.pending_prefill_tokens for s in states],
            [s.num_prefilling for s in states],
        )

    transit, claimed, pending, prefilling = gateway.on_loop(left_counted)
    assert transit < 1e-6 and claimed == {}, (transit, claimed)
    # (a float's rounding may leave ~1e-13 of the sums: no room is lost to it)
    assert max(pending) < 1e-6 and prefilling == [0, 0], (pending, prefilling)
    page = httpx.get(metrics_url(gateway) + "/metrics").text
    gauges = {
        (s.name, s.labels.get("replica")): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name
        in (
            "kvgate_replica_room_tokens",
            "kvgate_flow_transit_tokens",
            "kvgate_flow_prefill_tokens_per_s",
        )
    }
    assert gauges[("kvgate_flow_transit_tokens", None)] < 1e-6
    rate = gauges[("kvgate_flow_prefill_tokens_per_s", None)]  # measured from the first tokens
    assert rate > 0
    timed = {
        s.labels["sample"]: s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "kvgate_flow_prefills_timed_total"
    }
    assert timed["measured"] >= 1 and timed["behind_peers"] == 0  # one gateway: no peers
    for served in engines:  # the whole room bound on each: 0.02 s at the prefill rate
        room = gauges[("kvgate_replica_room_tokens", served.url)]
        assert room == pytest.approx(rate * 0.02)

    def immediate() -> int:
        return flow.stats.dispatched.get(("0", "immediate"), 0)

    before = gateway.on_loop(immediate)
    assert _ask(gateway, TENANT_KEY, "after it all").status_code == 200
    assert gateway.on_loop(immediate) == before + 1  # room at once: it did not queue


def test_a_request_failing_between_its_dispatch_and_its_placement_gives_its_room_back(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """A request let through from the queue that fails before it is placed (here: re-sizing it
    after its wait raises) gives its tokens in transit back: held, they would count against
    the fleet's room for good, and a transit above the room bound stops the queue."""
    (engine,) = start_engines(1)
    gateway = start_gateway([engine])
    d = director(gateway)
    flow = d.flow
    assert flow is not None
    state = d.replicas.states[engine.url]
    hold = gateway.on_loop(lambda: state.lease(10**9))  # no room: the request queues

    def resize_fails(*_: object) -> bool:
        raise RuntimeError("re-sizing failed")

    d.keying.resize_after_wait = resize_fails  # type: ignore[method-assign,assignment]

    async def queued_then_failing() -> int:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as client:
            request = asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    headers={"authorization": f"Bearer {TENANT_KEY}"},
                    json={
                        "model": MODEL,
                        "max_tokens": 1,
                        "messages": [{"role": "user", "content": words("queued", 200)}],
                    },
                )
            )
            await asyncio.to_thread(
                wait_until, lambda: gateway.on_loop(lambda: len(flow.queue)) == 1, 10.0, "queued"
            )
            gateway.on_loop(hold.release)  # room: it is let through, and fails
            return (await request).status_code

    assert asyncio.run(queued_then_failing()) == 500
    assert gateway.on_loop(lambda: flow.transit_tokens) == 0.0
