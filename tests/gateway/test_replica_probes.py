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
