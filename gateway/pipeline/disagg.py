"""Forward to a disaggregated fleet: a prefill instance, then a decode one (vLLM NixlConnector).

The director routes a request to a prefill instance as it routes any request (cache-aware
within the prefill pool's load bound, with the pool's holds, overflow and flow control); one
attempt at that instance is then two legs, vLLM's protocol (docs/disaggregation.md):

1. Prefill: the request with `stream: false`, `max_tokens: 1` (and `max_completion_tokens`),
   no `stream_options`, and `kv_transfer_params: {do_remote_decode: true, ...}`, read whole. Its
   answer's `kv_transfer_params` name the blocks it holds for a decode instance; its usage says
   what the prefill read from its cache and wrote (what the client is billed for). Its prompt's
   blocks are recorded on it. A failure here (5xx, timeout, an answer without params) is the
   attempt's failure: the director tries the next prefill instance.
2. Decode: the request as the client sent it (the gateway's salt, stream and usage options),
   with those params, at the decode instance `router.pd.rank_decode` puts first (load, then its
   own prefix within the bound); a retryable failure moves to the next decode instance, with the
   same params (a decode instance that could not pull recomputes or fails, per its engine's
   policy); when every decode candidate tried failed, the attempt fails and the director moves
   to the next prefill instance, which prefills again.

The exchange then runs on the decode instance's lease: the recorder records the prompt's blocks
there at the first token (it pulled them), and `PrefillUsage` puts the prefill's cached tokens
into the usage the client and the ledger see — the prompt is counted once, as the prefill
instance computed it, whatever the transfer did — and marks the record's `cached_on`, so that
reconciliation holds the prefill instance's entries (not the decode's) to that count.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.directory.routing import RoutingDirectory
from gateway.fleet.replicas import Lease, ReplicaSet, ReplicaState
from gateway.pipeline.exchange import Exchange, ExchangeHooks
from gateway.pipeline.forwarder import Complete, Forwarder, Passthrough, RetryableFailure, Streaming
from gateway.request.state import Routed
from gateway.request.usage import EngineUsage
from router.pd import rank_decode

log = logging.getLogger(__name__)

MAX_DECODE_ATTEMPTS = 2
"""Decode instances tried per prefill: a second one covers a decode instance that died; more
would keep the prefill's held blocks waiting while the director could prefill elsewhere."""

REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill leg asks for (vLLM's toy proxy and vllm-router send these)."""


@dataclass
class PrefillLeg:
    """What the last prefill leg of one request answered (the decode's usage is rewritten with
    it); written only by `Disaggregation.attempt`, read by `PrefillUsage`."""

    replica: str = ""
    cached_tokens: int | None = None
    prompt_tokens: int | None = None


def prefill_payload(body: dict[str, Any]) -> bytes:
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("min_tokens", None)
    leg["kv_transfer_params"] = REMOTE_DECODE_PARAMS
    return orjson.dumps(leg)


def transfer_params(answer: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's params, or a retryable failure when it sent none usable."""
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise RetryableFailure("the prefill instance answered without kv_transfer_params")
    return params


class Disaggregation:
    """The two legs of one attempt (see the module docstring). `decode_ids`: the replicas in
    the decode role (the static `decode_engines`, and those discovery names, `set_discovered`);
    every other replica serving the model is a prefill instance."""

    def __init__(
        self,
        decode_ids: Collection[str],
        replicas: ReplicaSet,
        forwarder: Forwarder,
        directory: RoutingDirectory,
        rng: random.Random,
        protocol: str = "vllm",
        bootstrap_port: int | None = None,
    ) -> None:
        self.static_decode_ids = frozenset(decode_ids)
        self.decode_ids = self.static_decode_ids
        self.replicas = replicas
        self.forwarder = forwarder
        self.directory = directory
        self.rng = rng
        self.protocol = protocol
        """`vllm` (NixlConnector: prefill, then decode) or `sglang` (bootstrap: both at once)."""
        self.bootstrap_port = bootstrap_port
        """SGLang: the prefill instances' bootstrap port (None: each prefill URL's port)."""
        self.num_prefill_failures = 0
        self.num_decode_failures = 0

    def set_discovered(self, decode_ids: frozenset[str]) -> None:
        """Discovery's decode pool (pods whose role key says `decode`), beside the static one:
        from the next routing decision on, they are decode instances and the rest prefill."""
        self.decode_ids = self.static_decode_ids | decode_ids

    def is_decode(self, replica_id: str) -> bool:
        return replica_id in self.decode_ids

    def decode_pool(self, model: str) -> list[ReplicaState]:
        return [s for s in self.replicas.serving(model) if s.id in self.decode_ids]

    async def attempt(
        self,
        routed: Routed,
        prefill: ReplicaState,
        path: str,
        payload: bytes,
        stream: bool,
        headers: Mapping[str, str] | None,
        output_tokens: float,
        leg: PrefillLeg,
        prefill_lease: Lease | None = None,
    ) -> tuple[Passthrough | Complete | Streaming, Lease | None]:
        """One attempt: the prefill leg at `prefill`, then the decode leg; returns the decode's
        outcome with its kept lease (None for a passthrough, the client's 4xx).

        `prefill_lease` (the director's lease on `prefill`) is released when the prefill leg
        ends: the instance's compute is free then (it only holds blocks for the pull), so its
        pending prefill and in-flight count no longer weigh on the prefill pool's load bound
        while the decode instance pulls and queues (issue 42: the bound pushed the next
        request sharing the prefix off the instance that had just cached it)."""
        if self.protocol == "sglang":
            return await self._bootstrap_attempt(
                routed, prefill, path, payload, stream, headers, output_tokens, leg, prefill_lease
            )
        body = orjson.loads(payload)
        try:
            first = await self.forwarder.attempt(
                prefill.url + path, prefill_payload(body), False, headers
            )
        finally:
            if prefill_lease is not None:
                prefill_lease.release()
        if isinstance(first, Passthrough):
            return first, None
        if not isinstance(first, Complete):  # it was asked not to stream
            first.close()
            raise RetryableFailure("the prefill instance streamed an answer it was asked whole")
        try:
            params = transfer_params(first.body)
        except RetryableFailure:
            self.num_prefill_failures += 1
            raise
        usage = EngineUsage.parse(first.body.get("usage") or {})
        leg.replica = prefill.id
        leg.cached_tokens = usage.cached_tokens
        leg.prompt_tokens = usage.prompt_tokens
        if routed.hashes and prefill.id not in routed.unpredicted:
            await self.directory.record(prefill.id, routed.hashes)
        body["kv_transfer_params"] = params
        decode_payload = orjson.dumps(body)
        pool = {s.id: s for s in self.decode_pool(routed.parsed.model)}
        ranking = rank_decode([s.snapshot() for s in pool.values()], routed.route.overlap, self.rng)
        failures: list[str] = []
        for replica_id in ranking[:MAX_DECODE_ATTEMPTS]:
            state = pool[replica_id]
            with state.lease(0.0, output_tokens) as lease:
                try:
                    outcome = await self.forwarder.attempt(
                        state.url + path, decode_payload, stream, headers
                    )
                except RetryableFailure as exc:
                    self.num_decode_failures += 1
                    failures.append(str(exc))
                    if exc.connection:
                        self.replicas.mark_down(replica_id, str(exc))
                    log.warning(
                        "decode at %s after prefill at %s failed: %s", replica_id, prefill.id, exc
                    )
                    continue
                if isinstance(outcome, Passthrough):
                    return outcome, None
                return outcome, lease.keep()
        if not ranking:
            raise RetryableFailure("no healthy decode instance serves the model")
        raise RetryableFailure(f"every decode attempt failed ({len(failures)})")

    async def _bootstrap_attempt(
        self,
        routed: Routed,
        prefill: ReplicaState,
        path: str,
        payload: bytes,
        stream: bool,
        headers: Mapping[str, str] | None,
        output_tokens: float,
        leg: PrefillLeg,
        prefill_lease: Lease | None = None,
    ) -> tuple[Passthrough | Complete | Streaming, Lease | None]:
        """SGLang's protocol, as sglang-router's P/D mode sends it: the request to the prefill
        instance and to the decode instance at once, both with `bootstrap_host`,
        `bootstrap_port` (the prefill's bootstrap server) and a random `bootstrap_room` (a
        63-bit integer) where the two meet; the decode instance's answer is the client's. The
        prefill leg is read whole (`stream: false`, one token: a prefill instance computes only
        the first), for its usage. One decode instance per room: a failure of either leg fails
        the attempt, and the director prefills again, with a new room, at the next prefill
        instance."""
        split = urlsplit(prefill.url)
        body = orjson.loads(payload)
        body["bootstrap_host"] = split.hostname or ""
        body["bootstrap_port"] = self.bootstrap_port or split.port or 80
        body["bootstrap_room"] = self.rng.getrandbits(63)
        pool = {s.id: s for s in self.decode_pool(routed.parsed.model)}
        ranking = rank_decode([s.snapshot() for s in pool.values()], routed.route.overlap, self.rng)
        if not ranking:
            raise RetryableFailure("no healthy decode instance serves the model")
        state = pool[ranking[0]]
        prefill_leg = asyncio.ensure_future(
            self.forwarder.attempt(
                prefill.url + path, bootstrap_prefill_payload(body), False, headers
            )
        )
        if prefill_lease is not None:  # the prefill instance is free when its leg ends
            prefill_lease_done = prefill_lease  # (for mypy: narrowed in the callback)
            prefill_leg.add_done_callback(lambda _: prefill_lease_done.release())
        with state.lease(0.0, output_tokens) as lease:
            try:
                outcome = await self.forwarder.attempt(
                    state.url + path, orjson.dumps(body), stream, headers
                )
            except RetryableFailure as exc:
                self.num_decode_failures += 1
                if exc.connection:
                    self.replicas.mark_down(state.id, str(exc))
                log.warning("decode at %s (room with %s) failed: %s", state.id, prefill.id, exc)
                await _abandon(prefill_leg)
                raise
            except BaseException:  # cancelled (the client left): the prefill leg too
                await _abandon(prefill_leg)
                raise
            try:
                first = await prefill_leg
            except RetryableFailure:
                self.num_prefill_failures += 1
                _close(outcome)
                raise
            if isinstance(first, Passthrough) or isinstance(outcome, Passthrough):
                _close(outcome)
                return (first if isinstance(first, Passthrough) else outcome), None
            if not isinstance(first, Complete):  # it was asked not to stream
                first.close()
                _close(outcome)
                raise RetryableFailure("the prefill instance streamed an answer it was asked whole")
            usage = EngineUsage.parse(first.body.get("usage") or {})
            leg.replica = prefill.id
            leg.cached_tokens = usage.cached_tokens
            leg.prompt_tokens = usage.prompt_tokens
            if routed.hashes and prefill.id not in routed.unpredicted:
                await self.directory.record(prefill.id, routed.hashes)
            return outcome, lease.keep()


def bootstrap_prefill_payload(body: dict[str, Any]) -> bytes:
    """SGLang's prefill leg: the decode leg's request (bootstrap fields included), read whole,
    one token."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("min_tokens", None)
    return orjson.dumps(leg)


async def _abandon(leg: asyncio.Future[Passthrough | Complete | Streaming]) -> None:
    """Cancel a prefill leg no decode will pull from (its engine frees the room's blocks at
    its timeout), closing what it answered if it already had."""
    leg.cancel()
    (done,) = await asyncio.gather(leg, return_exceptions=True)
    if isinstance(done, Streaming):
        done.close()


def _close(outcome: Passthrough | Complete | Streaming) -> None:
    if isinstance(outcome, Streaming):
        outcome.close()


class PrefillUsage:
    """The recorder's hooks, with the usage's cached tokens taken from the prefill leg: the
    decode instance counts what it pulled as cached, but the client pays for what the prefill
    instance read and wrote."""

    def __init__(self, inner: ExchangeHooks, leg: PrefillLeg) -> None:
        self.inner = inner
        self.leg = leg

    async def first_token(self, exchange: Exchange) -> None:
        if self.leg.replica:  # before the ledger's open entry names the replica
            exchange.record.cached_on = self.leg.replica
        await self.inner.first_token(exchange)

    async def usage(self, exchange: Exchange, fields: dict[str, Any]) -> EngineUsage:
        if self.leg.cached_tokens is not None:
            exchange.record.cached_on = self.leg.replica  # reconciliation checks the prefill
            details = fields.get("prompt_tokens_details")
            details = dict(details) if isinstance(details, dict) else {}
            details["cached_tokens"] = self.leg.cached_tokens
            fields["prompt_tokens_details"] = details
        return await self.inner.usage(exchange, fields)

    async def moved(self, exchange: Exchange) -> None:
        await self.inner.moved(exchange)

    async def finish(self, exchange: Exchange) -> None:
        await self.inner.finish(exchange)

    def stream_broke(self, exchange: Exchange, exc: BaseException | str) -> None:
        self.inner.stream_broke(exchange, exc)
