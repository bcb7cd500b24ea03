"""Step 4 of the pipeline, record: what happens at an exchange's first byte, usage and end.

1. First token: the exchange's instant is set; the prompt's blocks are recorded on the replica
   that answered (the engine has written their KV); the observers run.
2. Usage: parsed once (`EngineUsage`); the token estimate learns the model's bytes per token
   from the engine's prompt count; the observers run (and may rewrite the wire object).
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
from gateway.request.state import ExchangeObserver
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

    async def first_token(self, exchange: Exchange) -> None:
        record = exchange.record
        record.first_token_s = time.monotonic()
        if record.routed.hashes:
            await self.directory.record(record.replica, record.routed.hashes)
        for observer in self.observers:
            await observer.on_first_token(record)

    async def usage(self, exchange: Exchange, fields: dict[str, Any]) -> EngineUsage:
        record = exchange.record
        usage = record.usage = EngineUsage.parse(fields)
        if usage.prompt_tokens:
            parsed = record.parsed
            self.estimator.learn(parsed.model, len(parsed.rendered), usage.prompt_tokens)
        for observer in self.observers:
            await observer.on_usage(record, usage)
        return usage

    async def finish(self, exchange: Exchange) -> None:
        record = exchange.record
        for observer in self.observers:
            await observer.on_finish(record)
        exchange.trace.finished(record)

    def stream_broke(self, exchange: Exchange, exc: BaseException) -> None:
        log.warning("stream from %s broke after its first byte: %s", exchange.replica_url, exc)
