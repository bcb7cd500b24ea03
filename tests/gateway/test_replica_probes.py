"""Background work follows need (issue 17): a replica that answers its scrapes is not also
health-probed, one that stops answering them is probed again, and the scrape interval stretches
with the fleet. Stand-in replicas answer over real loopback HTTP (loadgen.bench.idle)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from gateway.fleet.replicas import MAX_SCRAPES_PER_S, ReplicaSet
from loadgen.bench.idle import StandInLog, stand_ins


async def _never(_: str) -> None:
    raise AssertionError("no replica restarted")


async def _until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_scraped_replicas_are_not_probed_until_their_scrapes_fail() -> None:
    log = StandInLog()
    with stand_ins(2, log) as urls:
        replicas = ReplicaSet(
            urls,
            interval_s=0.3,
            timeout_s=2.0,
            unhealthy_after=2,
            on_restart=_never,
            scrape_metrics=True,
            metrics_interval_s=0.05,
        )
        async with aiohttp.ClientSession() as session:
            await replicas.start(session)
            try:
                probes_at_start = log.hits["/health"]
                assert probes_at_start == 2  # the first round: one each
                await _until(lambda: log.hits["/metrics"] >= 30)
                # scraped every ~0.125 s (2 replicas / MAX_SCRAPES_PER_S), probed never since
                assert log.hits["/health"] <= probes_at_start + 2  # a loaded machine's lag
                log.failing.add("/metrics")
                await _until(lambda: log.hits["/health"] >= probes_at_start + 6)
                assert all(s.healthy for s in replicas.states.values())
            finally:
                await replicas.stop()


def test_the_scrape_interval_stretches_with_the_fleet() -> None:
    def interval(num: int) -> float:
        urls = [f"http://127.0.0.1:{9000 + i}" for i in range(num)]
        fleet = ReplicaSet(
            urls,
            interval_s=2.0,
            timeout_s=1.0,
            unhealthy_after=2,
            on_restart=_never,
            metrics_interval_s=1.0,
        )
        return fleet._scrape_interval_s()

    assert interval(4) == interval(16) == 1.0
    assert interval(64) == 64 / MAX_SCRAPES_PER_S == 4.0


async def test_a_suspect_replica_is_checked_at_once_and_routed_on_again_once_known() -> None:
    """Issue 45, item 17: suspicion hides a replica's entries at once and checks it at once —
    not at the next health probe, 30 s away here — and a replica that stopped answering is
    re-probed every `SUSPECT_PROBE_S` until it answers; the suspicion ends only after its start
    marker has been reported (the directory bumps its epoch if that is new)."""
    log = StandInLog()
    markers: list[tuple[str, str]] = []

    async def on_start_marker(replica: str, marker: str) -> None:
        markers.append((replica, marker))

    with stand_ins(1, log) as urls:
        (url,) = urls
        port = int(url.rsplit(":", 1)[1])
        replicas = ReplicaSet(
            urls,
            interval_s=30.0,
            timeout_s=2.0,
            unhealthy_after=1,
            on_restart=_never,
            on_start_marker=on_start_marker,
        )
        async with aiohttp.ClientSession() as session:
            await replicas.start(session)
            try:
                reported = len(markers)
                replicas.suspect(url, "a kept-alive connection ended")
                assert replicas.suspects() == {url}  # at once, before any probe
                await _until(lambda: not replicas.suspects())
                assert len(markers) > reported  # its identity was read before
                # a replica that refuses: marked down (suspect), re-probed until it answers
                log.down.add(port)
                replicas.mark_down(url, "connection refused")
                assert replicas.suspects() == {url}
                probes = log.hits["/health"]
                await _until(lambda: log.hits["/health"] >= probes + 3)
                assert not replicas.states[url].healthy and replicas.suspects() == {url}
                log.down.discard(port)
                await _until(lambda: replicas.states[url].healthy and not replicas.suspects())
                assert replicas.suspicions == 2
            finally:
                await replicas.stop()
