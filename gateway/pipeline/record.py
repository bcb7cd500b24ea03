"""Step 4 of the pipeline, record: what happens at an exchange's first byte, usage and end.

1. First token: the exchange's instant is set; the prompt's blocks are recorded on the replica
   that answered (the engine has written their KV); the observers run.
2. Usage: parsed once (`EngineUsage`); the token estimate learns the tenant's bytes per token
   for the model from the engine's prompt count, the fleet its mean output per request; the
   observers run (and may rewrite the wire object).
3. Finish: the observers run, then the request's trace ends.

Observers run in the order given (`gateway.server.app`): rate-limit settlement,
reconciliation, billing, metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from gateway.directory.routing import RoutingDirectory
from gateway.pipeline.exchange import Exchange
from gateway.request.state import ExchangeObserver, ExchangeRecord, is_idle_hook
from gateway.request.tokens import TokenEstimator
from gateway.request.usage import EngineUsage

log = logging.getLogger(__name__)


class Recorder:
    """The `ExchangeHooks` every exchange of the pipeline calls."""

    def __init__(
        self,
        directory: RoutingDirectory,
        estimator: TokenEstimator,
        observers: Sequence[ExchangeObserver] = (),
    ) -> None:
        self.directory = directory
        self.estimator = estimator
        self.observers = list(observers)
        # each event's hooks, bound once, without those marked idle (`idle_hook`)
        self._on_first_token = [
            o.on_first_token for o in self.observers if not is_idle_hook(o.on_first_token)
        ]
        self._on_usage = [o.on_usage for o in self.observers if not is_idle_hook(o.on_usage)]
        self._on_finish = [o.on_finish for o in self.observers if not is_idle_hook(o.on_finish)]

    async def first_token(self, exchange: Exchange) -> None:
        record = exchange.record
        record.first_token_s = time.monotonic()
        await self._record_blocks(record)
        for on_first_token in self._on_first_token:
            await on_first_token(record)

    async def usage(self, exchange: Exchange, fields: dict[str, Any]) -> EngineUsage:
        record = exchange.record
        usage = record.usage = EngineUsage.parse(fields)
        if usage.completion_tokens is not None:  # the mean output a request without max_tokens
            exchange.lease.state.fleet.observe_output(usage.completion_tokens)  # is assumed
        if usage.prompt_tokens:
            self.estimator.learn(record.parsed, usage.prompt_tokens, tenant=record.tenant.name)
        for on_usage in self._on_usage:
            await on_usage(record, usage)
        return usage

    async def moved(self, exchange: Exchange) -> None:
        """A non-streamed exchange moved to another replica before its answer was whole: the
        prompt's blocks are on the new replica too (observers saw the first token already)."""
        await self._record_blocks(exchange.record)

    async def _record_blocks(self, record: ExchangeRecord) -> None:
        """The prompt's blocks in the directory for the replica that holds them now, unless its
        KV events route it (`Routed.unpredicted`); what the lookup read it to hold goes along
        (`Routed.held`)."""
        routed = record.routed
        if routed.hashes and record.replica not in routed.unpredicted:
            await self.directory.record(
                record.replica, routed.hashes, routed.held.get(record.replica)
            )

    async def finish(self, exchange: Exchange) -> None:
        record = exchange.record
        for on_finish in self._on_finish:
            await on_finish(record)
        exchange.trace.finished(record)

    def stream_broke(self, exchange: Exchange, exc: BaseException | str) -> None:
        """The client is told only that the engine failed; the log names the replica and what
        the HTTP library (or the engine) said."""
        log.warning("stream from %s broke after its first byte: %s", exchange.replica_url, exc)
