"""The engine replicas behind the gateway: health, served models, and the load this gateway
has put on each (requests in flight, prefill tokens not yet answered by a first token).

Health: every replica is probed (GET /health) every `health_interval_s`; `unhealthy_after`
consecutive failures — or a connection failure while forwarding — mark it down, and one
successful probe marks it up again.

Restarts: each healthy probe also reads the replica's `/metrics` (`scrape_metrics`). A new
`process_start_time_seconds` is reported through `on_start_marker` (the directory compares it
with what every gateway saw, so a restart bumps the epoch once); prefix-cache counters that went
backwards call `on_restart`. A replica that reports no start time and comes back up after being
marked down is treated as restarted too: an engine we could not reach may have lost its KV
cache, and a wrong prediction costs a request each to discover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from gateway.engine_metrics import EngineMetrics, parse_engine_metrics
from router.types import Replica

log = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    url: str
    healthy: bool = False
    consecutive_failures: int = 0
    models: frozenset[str] = frozenset()
    max_model_len: int | None = None
    num_inflight: int = 0
    pending_prefill_tokens: float = 0.0
    num_requests: int = 0
    metrics: EngineMetrics | None = None
    probed: bool = field(default=False, repr=False)

    @property
    def id(self) -> str:
        return self.url

    def snapshot(self) -> Replica:
        return Replica(self.url, self.healthy, self.num_inflight, self.pending_prefill_tokens)


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
        scrape_metrics: bool = True,
    ) -> None:
        self.states = {url: ReplicaState(url) for url in urls}
        self._session: aiohttp.ClientSession | None = None
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._unhealthy_after = unhealthy_after
        self._on_restart = on_restart
        self._on_start_marker = on_start_marker
        self._scrape_metrics = scrape_metrics
        self._task: asyncio.Task[None] | None = None

    def get(self, replica_id: str) -> ReplicaState:
        return self.states[replica_id]

    def models(self) -> list[str]:
        return sorted({m for s in self.states.values() for m in s.models})

    def serving(self, model: str) -> list[ReplicaState]:
        return [s for s in self.states.values() if model in s.models]

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self.states.values())

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Probe every replica once (so the first request sees real health), then keep probing."""
        self._session = session
        await self.probe_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe round must never kill the loop
                log.exception("health probe round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.states.values()))

    async def _probe(self, state: ReplicaState) -> None:
        assert self._session is not None, "start() binds the session"
        try:
            async with self._session.get(state.url + "/health", timeout=self._timeout) as resp:
                ok = resp.status == 200
            if ok and (not state.healthy or not state.probed):
                ok = await self._learn_models(state)
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok:
            state.consecutive_failures = 0
            before = state.metrics
            if self._scrape_metrics:
                await self._scrape(state)
            if not state.healthy:
                if state.probed:
                    log.info("replica %s is back up", state.url)
                    if state.metrics is None or state.metrics.start_marker is None:
                        await self._on_restart(state.url)
                state.healthy = True
            await self._maybe_restarted(state, before)
            state.probed = True
        else:
            state.consecutive_failures += 1
            if state.healthy and state.consecutive_failures >= self._unhealthy_after:
                self.mark_down(state.url, "failed health probes")
            state.probed = True

    async def _scrape(self, state: ReplicaState) -> None:
        assert self._session is not None
        try:
            async with self._session.get(state.url + "/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                text = (await resp.read()).decode(errors="replace")
            state.metrics = parse_engine_metrics(text)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log.debug("metrics of %s unavailable: %s", state.url, exc)

    async def _maybe_restarted(self, state: ReplicaState, before: EngineMetrics | None) -> None:
        now = state.metrics
        if now is None:
            return
        marker = now.start_marker
        if marker is not None and self._on_start_marker is not None:
            if before is None or before.start_marker != marker:
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
        lens = [c.get("max_model_len") for c in cards if isinstance(c.get("max_model_len"), int)]
        state.max_model_len = min(lens) if lens else None
        return bool(state.models)

    def mark_down(self, replica_id: str, why: str) -> None:
        state = self.states[replica_id]
        if state.healthy:
            log.warning("replica %s marked down: %s", replica_id, why)
        state.healthy = False
