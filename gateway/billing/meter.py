"""The meter: the live gateway's side of billing, an exchange observer plus a request hook.

1. Start (`prepare`, a director request hook, before routing): the tenant's profile
   (`profile_for`), an explicit cached-content object expanded into the prompt, the prompt's
   blocks and marks (`layout`), the marks validated (a 400 names the rule), billing-only fields
   stripped from what the engine sees; the start instant is read from `clock` when routing
   ends (`routed`: after any fan-out hold, so a held request starts at its release).
2. First token (`on_first_token`): the request is admitted to the tenant-visible cache ledger
   (lookup, writes, refreshes), its entries visible from now. Token positions come from the
   engine's count when already known (non-streamed), else a tokenizer or bytes-per-token.
   With a billing store, the entries the request can touch are read from it first and the
   ones it changed joined back (`shared`): every gateway bills from one ledger. The exchange's
   open entry goes to the WAL (its would-be aborted record: what is known now), so a crash of
   this gateway before the end still bills it (the next start writes that record).
3. Usage (`on_usage`, before the client sees it): the plan is billed on the engine's exact
   counts, the record is appended to the WAL (fsync'd) and only then the usage is rewritten:
   `prompt_tokens_details.cached_tokens` becomes the contract's R (the physical hit stays in
   `engine_cached_tokens`), the profile's fields join, with `cost` and `kvgate_billing`.
4. Finish: an exchange that ended without usage is billed from its estimates (`aborted`).
   One cut while its usage's record was being written (the drain's grace cancels the request
   there) is billed by that record once it lands, and by an aborted one only if it failed.
   Its own record written (either way), its open entry is settled.

A WAL that cannot write (a full or stalled disk) fails the request with `BillingUnavailable`
(503, or an error event mid-stream): nothing is served unrecorded.

`max_tokens: 0` (Anthropic's ping, which the Messages front end lets through) reads and
refreshes entries: the engine is asked for one token, the usage reports and bills none.

The bill follows the contract, not the replica: the ledger is per isolation scope and model,
whichever replica served. Front ends other than the OpenAI one pass their breakpoints as marks
on an OpenAI-shaped body (see `layout`); a request built elsewhere can carry a ready `Pending`
on a `BilledRequest`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from cachemap.rendering import GENERATION_PROMPT
from gateway.billing.contents import load_snapshot, save_snapshot
from gateway.billing.pending import BilledRequest, Pending, profile_for
from gateway.billing.pricing.clock import Clock, WallClock
from gateway.billing.pricing.layout import (
    BlockCounts,
    Layout,
    Tokenizer,
    chat_layout,
    completion_layout,
    counted_ends,
    fit_to_total,
    proportional_ends,
    strip_marks,
)
from gateway.billing.pricing.ledger import CacheLedger
from gateway.billing.pricing.model import (
    BillingError,
    Block,
    CachedContent,
    Charge,
    Entry,
    MeteredRequest,
    Plan,
)
from gateway.billing.pricing.money import ZERO
from gateway.billing.pricing.prices import PriceTable
from gateway.billing.pricing.rules import (
    SPECS,
    ProfileOptions,
    breakpoints,
    check_anthropic_marks,
    translate_mark,
)
from gateway.billing.pricing.usage import merge_into_openai_usage
from gateway.billing.records import build_record
from gateway.billing.shared import SharedEntries, join, scope_id
from gateway.billing.wal import WalUnavailable, WriteAheadLog
from gateway.errors import GatewayError, InvalidRequest
from gateway.request.parsed import CHAT, ParsedRequest
from gateway.request.state import ExchangeRecord, Routed
from gateway.request.tenant import Tenant
from gateway.request.tokens import TokenEstimator
from gateway.request.usage import EngineUsage
from gateway.settings import Settings

log = logging.getLogger(__name__)

SHARED_PROFILES = frozenset({"anthropic", "openai", "openai_legacy", "google_implicit", "deepseek"})
"""Profiles with cache entries to share across gateways (google_explicit has none: its objects
are shared whole, see `sync_object`)."""
CONTENTS_FILE = "contents.json"


class BillingUnavailable(GatewayError):
    """503: the billing record could not be made durable (the WAL's disk failed or stalled),
    so the answer is not served — nothing is served unrecorded."""

    status = 503
    type = "service_unavailable_error"

    def __init__(self, detail: str) -> None:
        super().__init__(
            "billing is unavailable: the request's record could not be written; retry later",
            code="billing_unavailable",
        )
        self.detail = detail


def _state(entry: Entry | None) -> tuple[Decimal, Decimal, Decimal] | None:
    return None if entry is None else (entry.visible_at, entry.last_use, entry.ttl_s)


@dataclass(slots=True)
class TenantSpend:
    """A tenant's billed cost since start and what the same exchanges would have cost with no
    caching (the console's spend and savings; exported as `kvgate_tenant_cost_dollars`)."""

    cost: Decimal = ZERO
    without_caching: Decimal = ZERO


@dataclass(slots=True)
class OpenBill:
    pending: Pending
    request: MeteredRequest
    plan: Plan
    ledger: CacheLedger | None
    visible_at: Decimal
    estimated_tokens: int
    billed: bool = False
    first_token: Decimal | None = None
    """The first token's instant, when it came after the entries became visible (a fan-out
    leader admitted at its BlockStored); else `visible_at` is it."""
    opened: bool = False
    """Its open entry is in the WAL."""
    written: asyncio.Task[None] | None = None
    """The background write of its shared entries (billing store), if any."""
    recording: asyncio.Task[None] | None = None
    """The write of the usage's record, once started: it outlives a cancelled exchange (the
    drain's grace), and its outcome decides whether the finish writes an aborted record."""


class BillingMeter:
    """Prices every exchange under its tenant's profile and writes one durable record each.

    Invariants: a record is on stable storage before the usage reaches the client; each
    exchange is recorded exactly once (usage, else an `aborted` record at finish, else — the
    gateway died — its open entry's record at the next start); the cache ledger is keyed by
    (isolation scope, model) — the tenant, or in a `user`-scoped tenant each end user — and
    never shared across scopes.
    """

    def __init__(
        self,
        settings: Settings,
        prices: PriceTable,
        wal: WriteAheadLog,
        *,
        estimator: TokenEstimator | None = None,
        tokenizer: Tokenizer | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.prices = prices
        self.wal = wal
        self.estimator = estimator or TokenEstimator(settings.bytes_per_token)
        """The gateway's one bytes-per-token estimate (learned by the pipeline's recorder)."""
        self.tokenizer = tokenizer
        self.counts = BlockCounts()
        """The tokenizer's counts of blocks seen before (a continuation counts what it adds)."""
        self.clock: Clock = clock or WallClock()
        self.options = ProfileOptions(
            lookback_blocks=settings.billing_lookback_blocks,
            openai_ttl_s=Decimal(str(settings.billing_openai_ttl_s)),
            deepseek_unit=settings.billing_deepseek_unit,
            deepseek_holidays=frozenset(settings.billing_deepseek_holidays),
        )
        self.gateway_id = settings.billing_gateway_id or f"{socket.gethostname()}:{os.getpid()}"
        self.ledgers: dict[str, CacheLedger] = {}
        self._open: dict[int, OpenBill] = {}
        """Exchanges admitted to the ledger and not yet billed, by record identity."""
        self._unpriced_warned: set[tuple[str, str]] = set()
        self.shared: SharedEntries | None = None
        """The entries every gateway shares (set by `Billing.start` with a billing store)."""
        self._confirmed: dict[str, asyncio.Future[OpenBill | None]] = {}
        """Fan-out leaders admitted at their BlockStored (`landed`), until their first token."""
        self._tasks: set[asyncio.Future[None]] = set()
        self.spend: dict[str, TenantSpend] = {}
        """By tenant: what its durable records cost, and the same without caching."""

    # -- helpers -------------------------------------------------------------------------------
    def spent(self, tenant: str, charge: Charge | None, without_caching: bool = True) -> None:
        """A record's charge is durable: add it to the tenant's spend. A cached-content
        operation (`without_caching=False`) has no counterpart without caching: its creation
        and rent are what caching costs, the prompts that read it count in full there."""
        if charge is None:
            return
        spend = self.spend.get(tenant)
        if spend is None:
            spend = self.spend[tenant] = TenantSpend()
        spend.cost += charge.cost
        if without_caching:
            spend.without_caching += charge.cost_without_caching

    def ledger(self, profile: str) -> CacheLedger:
        found = self.ledgers.get(profile)
        if found is None:
            found = self.ledgers[profile] = CacheLedger(
                profile, self.prices, self.options, self.settings.billing_ledger_max_entries
            )
        return found

    def price_model(self, profile: str, model: str) -> str | None:
        """The price-table model a served model is billed as: `billing_model_map` keys
        "<profile>:<model>" first, then "<model>", else the served name itself."""
        mapping = self.settings.billing_model_map
        name = mapping.get(f"{profile}:{model}", mapping.get(model, model))
        if self.prices.get(profile, name) is not None:
            return name
        if (profile, name) not in self._unpriced_warned:
            self._unpriced_warned.add((profile, name))
            log.warning(
                "billing: no price for model %r under profile %r (map it with "
                "billing_model_map); its requests are recorded as unpriced",
                name,
                profile,
            )
        return None

    def _ends(self, pending: Pending, num_tokens: int) -> list[int]:
        ends = [b.end for b in pending.layout.blocks]
        if pending.counted is not None:
            return fit_to_total(pending.counted, num_tokens)
        return proportional_ends(ends, pending.layout.num_bytes, num_tokens)

    def _estimate_tokens(self, body: Any, pending: Pending) -> int:
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return int(usage["prompt_tokens"])
        if pending.counted:
            return pending.counted[-1]
        tokens = self.estimator.tokens(
            pending.model, pending.layout.num_bytes, tenant=pending.tenant
        )
        return max(round(tokens), 1)

    # -- 1. start ------------------------------------------------------------------------------
    async def prepare(self, parsed: ParsedRequest, tenant: Tenant) -> ParsedRequest:
        """The director's request hook (see the module docstring, step 1)."""
        if isinstance(parsed, BilledRequest) and parsed.billing is not None:
            # built before admission (an explicit object's creation): its scope is known now
            parsed.billing.scope = tenant.scope
            return parsed
        object_id = parsed.body.get("cached_content")
        if isinstance(object_id, str):
            await self.sync_object(object_id)
        return self.prepare_sync(parsed, tenant)

    async def sync_object(self, object_id: str) -> None:
        """With a billing store, take an explicit object as the store has it (another gateway
        may have created, extended or deleted it)."""
        if self.shared is None:
            return
        found = await self.shared.get_object(object_id)
        if isinstance(found, CachedContent):
            self.ledger("google_explicit").objects[object_id] = found

    async def publish_object(self, obj: CachedContent) -> None:
        """With a billing store, store an explicit object's new state for every gateway."""
        if self.shared is not None:
            await self.shared.put_object(obj)

    def prepare_sync(self, parsed: ParsedRequest, tenant: Tenant) -> BilledRequest:
        try:
            return self._prepare(parsed, tenant)
        except BillingError as exc:
            raise InvalidRequest(str(exc)) from None

    def _prepare(self, parsed: ParsedRequest, tenant: Tenant) -> BilledRequest:
        profile = profile_for(self.settings, tenant)
        start = self.clock.now()
        body = parsed.body
        rendered = parsed.rendered
        obj = None
        object_id = body.get("cached_content")
        if object_id is not None:
            obj = self._expand(profile, parsed, tenant, object_id, start)
            leading = obj.payload["messages"]
            assert isinstance(leading, list)
            body = {**body, "messages": [*leading, *body["messages"]]}
            if obj.payload.get("tools"):
                body["tools"] = obj.payload["tools"]
            from cachemap.rendering import render_chat

            rendered = render_chat(body["messages"], body.get("tools")).encode()
        layout = (
            chat_layout(body, rendered)
            if parsed.kind == CHAT
            else completion_layout(body, rendered)
        )
        if layout.marked and profile in ("anthropic", "openai"):
            unpositioned = self._metered(profile, layout, [0] * len(layout.blocks))
            marks = breakpoints(unpositioned, SPECS[profile])
            if profile == "anthropic":
                check_anthropic_marks(marks, self.options)
        counted = None
        if self.tokenizer is not None:
            counted = counted_ends(
                rendered,
                [b.end for b in layout.blocks],
                self.tokenizer,
                keys=layout.keys,
                cache=self.counts,
                scope=tenant.scope,
            )
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        ping = max_tokens == 0
        pending = Pending(
            request_id="req-" + secrets.token_hex(16),
            tenant=tenant.name,
            profile=profile,
            model=parsed.model,
            price_model=self.price_model(profile, parsed.model),
            start=start,
            layout=layout,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            cached_content=obj,
            counted=counted,
            scope=tenant.scope,
        )
        if obj is not None or layout.marked:
            body = strip_marks(body)
        if ping:  # Anthropic's ping: the engine generates one token, nobody is billed for it
            body = {k: v for k, v in body.items() if k != "max_completion_tokens"}
            body["max_tokens"] = 1
        return BilledRequest(
            parsed.kind,
            parsed.model,
            body,
            rendered,
            parsed.stream,
            parsed.include_usage,
            breakpoints=parsed.breakpoints,
            prewarm=parsed.prewarm,
            billing=pending,
        )

    def _expand(
        self, profile: str, parsed: ParsedRequest, tenant: Tenant, object_id: Any, t: Decimal
    ) -> CachedContent:
        if profile != "google_explicit":
            raise BillingError(
                f"'cached_content' needs the google_explicit billing profile; this tenant's "
                f"is {profile!r}"
            )
        if not isinstance(object_id, str) or parsed.kind != CHAT:
            raise BillingError("'cached_content' must be an id string on a chat request")
        obj = self.ledger(profile).content(tenant.name, object_id, t, scope=tenant.scope)
        served = obj.payload.get("model", obj.model)
        if served != parsed.model:
            raise BillingError(f"cached content {object_id!r} was created for model {served!r}")
        if obj.payload.get("tools") and parsed.body.get("tools"):
            raise BillingError("a request naming a cached content with tools may not send tools")
        return obj

    def _metered(
        self,
        profile: str,
        layout: Layout,
        ends: list[int],
        pending: Pending | None = None,
        visible_at: Decimal | None = None,
        num_tokens: int = 0,
    ) -> MeteredRequest:
        blocks = tuple(
            Block(
                key,
                end,
                translate_mark(profile, block.mark, layout.default_tier),
                block.eligible,
            )
            for block, key, end in zip(layout.blocks, layout.keys, ends, strict=True)
        )
        start = pending.start if pending else Decimal(0)
        return MeteredRequest(
            request_id=pending.request_id if pending else "",
            tenant=pending.tenant if pending else "",
            model=(pending.price_model or pending.model) if pending else "",
            start=start,
            visible_at=visible_at if visible_at is not None else start,
            blocks=blocks,
            num_prompt_tokens=num_tokens,
            max_tokens=pending.max_tokens if pending else None,
            explicit_mode=layout.explicit_mode,
            auto_ttl=translate_mark(profile, layout.auto_ttl, layout.default_tier),
            cached_content=(
                pending.cached_content.object_id if pending and pending.cached_content else None
            ),
            scope=pending.scope if pending else "",
        )

    def routed(self, routed: Routed) -> None:
        """The director's routed hook: the request starts now, after routing and any fan-out
        hold (the rules' clock runs from a request's start; a held request starts at its
        release, when its leader's entry is already visible — docs/billing.md#held-requests)."""
        pending = getattr(routed.parsed, "billing", None)
        if isinstance(pending, Pending):
            pending.start = max(pending.start, self.clock.now())
            pending.queue_s = routed.queued_s

    # -- 2. first token ------------------------------------------------------------------------
    async def on_first_token(self, record: ExchangeRecord) -> None:
        pending = getattr(record.parsed, "billing", None)
        if not isinstance(pending, Pending) or id(record) in self._open:
            return  # not prepared by this meter, or already admitted (see on_usage)
        now = self.clock.now()
        confirmed = self._confirmed.pop(pending.request_id, None)
        bill = None if confirmed is None else await confirmed
        if bill is not None:  # a fan-out leader admitted at its BlockStored (`landed`)
            bill.first_token = now
            self._open[id(record)] = bill
        else:
            pending.admitted = True
            estimated = self._estimate_tokens(record.body, pending)
            bill = self._open[id(record)] = await self._admit(pending, now, estimated)
        if pending.op == "request" and not bill.opened:
            # what is known now, durable past a crash of this gateway: the record it gets if it
            # never ends (the next start, or `kvgate billing ship`, writes it then)
            try:
                await self.wal.open_entry(
                    pending.request_id, self._aborted(bill, _billed_replica(record))[0]
                )
            except WalUnavailable as exc:
                raise BillingUnavailable(str(exc)) from None
            bill.opened = True

    async def _admit(self, pending: Pending, visible_at: Decimal, estimated: int) -> OpenBill:
        """Admit a request to its profile's ledger, its entries visible from `visible_at`; with
        a billing store, joined with the shared entries first and written back after. Returns
        the bill (its plan) and the background write of the shared entries, if any."""
        request = self._metered(
            pending.profile,
            pending.layout,
            self._ends(pending, estimated),
            pending,
            visible_at,
            estimated,
        )
        ledger = None
        plan = Plan()
        written: asyncio.Task[None] | None = None
        if pending.price_model is not None and pending.op == "request":
            ledger = self.ledger(pending.profile)
            shared = self.shared if pending.profile in SHARED_PROFILES else None
            scope = ""
            if shared is not None:
                scope = scope_id(pending.profile, request.scope_key, request.model)
                keys = [b.key for b in request.blocks if isinstance(b.key, bytes)]
                stored = await shared.fetch(scope, keys)
                entries = ledger.scopes.setdefault((request.scope_key, request.model), {})
                for key, entry in (stored or {}).items():
                    mine = entries.get(key)
                    entries[key] = entry if mine is None else join(mine, entry)
                before = {k: _state(entries.get(k)) for k in keys}
            try:
                plan = ledger.admit(request)
            except BillingError as exc:  # e.g. the object expired since the start
                log.warning("billing: %s: %s; billed as uncached", pending.request_id, exc)
            if shared is not None:
                written = shared.store(
                    scope,
                    {
                        k: e
                        for k in keys
                        if (e := entries.get(k)) is not None and _state(e) != before[k]
                    },
                )
        elif pending.op != "request":
            ledger = self.ledger(pending.profile)
        return OpenBill(pending, request, plan, ledger, visible_at, estimated, written=written)

    async def landed(self, routed: Routed) -> None:
        """The director's landed hook: a fan-out leader's replica reported the leader's prefix
        stored (its KV events, precise mode) before its first token, and its siblings are about
        to be released. The events confirm the write, so the leader's entries are visible from
        now (docs/billing.md#common-model): it is admitted here, before the release, so every
        sibling (which starts at its release) reads them. With a billing store the entries are
        written there before this returns (within `billing_ledger_deadline_s`), so a sibling at
        another gateway, released by this landing, finds them. Its first token adopts the bill
        (`on_first_token`); a leader that never gets one is billed as aborted (`abandoned`)."""
        pending = getattr(routed.parsed, "billing", None)
        if not isinstance(pending, Pending) or pending.admitted or pending.op != "request":
            return  # not ours, or its first token came first (it lands on that, as before)
        pending.admitted = True
        future: asyncio.Future[OpenBill | None] = asyncio.get_running_loop().create_future()
        self._confirmed[pending.request_id] = future
        try:
            bill = await self._admit(
                pending, self.clock.now(), self._estimate_tokens(None, pending)
            )
        except BaseException:  # not admitted: its first token admits it, as without events
            self._confirmed.pop(pending.request_id, None)
            pending.admitted = False
            future.set_result(None)
            raise
        try:  # its would-be aborted record, as at a first token (before anyone may settle it)
            await self.wal.open_entry(
                pending.request_id, self._aborted(bill, routed.decision.replica)[0]
            )
            bill.opened = True
        except WalUnavailable as exc:  # its first token writes it again, or fails the request
            log.error("billing: %s: open entry at the landing: %s", pending.request_id, exc)
        future.set_result(bill)
        if bill.written is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(bill.written), self.settings.billing_ledger_deadline_s
                )

    def abandoned(self, routed: Routed) -> None:
        """The director's abandoned hook: a fan-out leader ended without a first token. If it
        was admitted at its BlockStored (`landed`), the engine did its prefill and its entries
        were read: it is billed as an aborted exchange (docs/billing.md#decisions), in the
        background (its open entry covers a crash meanwhile)."""
        pending = getattr(routed.parsed, "billing", None)
        if not isinstance(pending, Pending):
            return
        confirmed = self._confirmed.pop(pending.request_id, None)
        if confirmed is None:
            return
        task = asyncio.ensure_future(self._abandon(confirmed, routed.decision.replica))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abandon(self, confirmed: asyncio.Future[OpenBill | None], replica: str) -> None:
        bill = await confirmed
        if bill is None:  # never admitted: nothing to bill
            return
        await self._record_aborted(bill, replica)

    async def drain(self) -> None:
        """Wait for the aborted records of abandoned leaders (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- 3. usage ------------------------------------------------------------------------------
    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        bill = self._open.get(id(record))
        if bill is None:
            # a stream whose first network read held the usage too: its first token is now
            await self.on_first_token(record)
            bill = self._open.get(id(record))
        if bill is None or bill.billed:
            return
        pending = bill.pending
        fields = usage.fields
        n = usage.prompt_tokens if usage.prompt_tokens is not None else bill.estimated_tokens
        o = usage.completion_tokens or 0
        if pending.max_tokens == 0:  # a ping: reads and refreshes, generates nothing
            o = usage.completion_tokens = 0
            fields["completion_tokens"] = 0
            fields["total_tokens"] = n
        ends = self._ends(pending, n)
        if pending.op == "cache.create":
            entry, charge = self._create_content(bill, n)
        else:
            charge = None
            if bill.ledger is not None:
                charge = bill.ledger.bill(bill.request, bill.plan, ends, n, o)
            entry = self._record(
                bill, _billed_replica(record), charge, "ok" if charge else "unpriced", usage
            )
        # NOTE: the write is a task of its own and awaited shielded: a cancellation here (the
        # drain's grace) cannot take back a record already on its way to the disk, so the
        # finish waits for that write instead of writing a second, aborted record of the id
        bill.recording = asyncio.ensure_future(self.wal.append(entry))
        try:
            await asyncio.shield(bill.recording)
        except WalUnavailable as exc:  # the response is withheld: nothing unrecorded is served
            raise BillingUnavailable(str(exc)) from None
        self._billed(bill)
        self.spent(pending.tenant, charge, without_caching=pending.op == "request")
        if pending.op == "request":
            if charge is not None:
                merge_into_openai_usage(pending.profile, charge, fields)
                fields["cost"] = entry["cost"]
            fields["kvgate_billing"] = {
                "id": pending.request_id,
                "profile": pending.profile,
                "price_model": pending.price_model,
                "cost": entry["cost"],
            }

    def _record(
        self,
        bill: OpenBill,
        replica: str,
        charge: Charge | None,
        status: str,
        usage: EngineUsage | None,
    ) -> dict[str, Any]:
        pending = bill.pending
        from gateway.billing.pricing.usage import profile_usage

        return build_record(
            record_id=pending.request_id,
            kind="request",
            status=status,
            tenant=pending.tenant,
            profile=pending.profile,
            model=pending.model,
            price_model=pending.price_model,
            start=pending.start,
            first_token=bill.first_token or bill.visible_at,
            charge=charge,
            usage=profile_usage(pending.profile, charge) if charge else {},
            cached_content=(pending.cached_content.object_id if pending.cached_content else None),
            replica=replica,
            engine_cached_tokens=usage.cached_tokens if usage is not None else None,
            gateway=self.gateway_id,
            queue_s=pending.queue_s,
        )

    # -- 4. finish -----------------------------------------------------------------------------
    async def on_finish(self, record: ExchangeRecord) -> None:
        bill = self._open.pop(id(record), None)
        if bill is None or bill.billed:
            return
        if bill.recording is not None:  # cut while its record was written: that write decides
            with contextlib.suppress(WalUnavailable):
                await asyncio.shield(bill.recording)
                self._billed(bill)
                return
        if bill.pending.op != "request":
            return  # a failed creation creates nothing and costs nothing
        await self._record_aborted(bill, _billed_replica(record))

    async def _record_aborted(self, bill: OpenBill, replica: str) -> None:
        """Append an exchange's aborted record; a WAL that cannot take it leaves its open entry
        for the next start to record."""
        record, charge = self._aborted(bill, replica)
        try:
            await self.wal.append(record)
        except WalUnavailable as exc:
            log.error(
                "billing: %s: the aborted record waits for recovery: %s",
                bill.pending.request_id,
                exc,
            )
            return
        self.wal.settle(bill.pending.request_id)
        self.spent(bill.pending.tenant, charge)

    def _billed(self, bill: OpenBill) -> None:
        """The exchange's own record is durable: its open entry is done with."""
        self.wal.settle(bill.pending.request_id)
        bill.billed = True

    def _aborted(self, bill: OpenBill, replica: str) -> tuple[dict[str, Any], Charge | None]:
        """The record of an exchange that ends before its usage: the prompt as estimated at
        the first token, no output (docs/billing.md#decisions); and its charge."""
        charge = None
        if bill.ledger is not None:
            charge = bill.ledger.bill(bill.request, bill.plan, None, None, 0)
        status = "aborted" if charge else "unpriced"
        return self._record(bill, replica, charge, status, None), charge

    # -- explicit cached contents --------------------------------------------------------------
    def _create_content(self, bill: OpenBill, n: int) -> tuple[dict[str, Any], Charge]:
        pending = bill.pending
        spec = pending.create
        num_blocks = len(pending.layout.blocks)
        # the object ends before the generation prompt its prefill carried: a request using it
        # continues with its own messages there
        content_bytes = pending.layout.num_bytes - len(GENERATION_PROMPT.encode())
        if self.tokenizer is not None:
            tokens = max(n - self.tokenizer(GENERATION_PROMPT), 0)
        else:
            tokens = proportional_ends([content_bytes], pending.layout.num_bytes, n)[0]
        obj = CachedContent(
            object_id=spec["id"],
            tenant=pending.tenant,
            model=pending.price_model or pending.model,
            num_tokens=tokens,
            num_blocks=num_blocks,
            created=pending.start,
            expires=spec["expires"],
            payload={
                "model": pending.model,
                "messages": spec["messages"],
                "tools": spec.get("tools"),
            },
            scope=pending.scope,
        )
        assert bill.ledger is not None
        charge = bill.ledger.create_content(obj)
        pending.created = obj
        self.save_contents()
        record = self.op_record("cache.create", pending.request_id, obj, charge, pending.start)
        return record, charge

    def op_record(
        self, kind: str, record_id: str, obj: CachedContent, charge: Charge, t: Decimal
    ) -> dict[str, Any]:
        return build_record(
            record_id=record_id,
            kind=kind,
            status="ok",
            tenant=obj.tenant,
            profile="google_explicit",
            model=obj.model,
            price_model=obj.model,
            start=t,
            first_token=None,
            charge=charge,
            usage={"cached_content_tokens": obj.num_tokens},
            cached_content=obj.object_id,
            gateway=self.gateway_id,
        )

    @property
    def contents_path(self) -> Path:
        return self.wal.directory / CONTENTS_FILE

    def save_contents(self) -> None:
        """Snapshot the live explicit objects next to the WAL (see `contents`)."""
        ledger = self.ledgers.get("google_explicit")
        objects = list(ledger.objects.values()) if ledger else []
        save_snapshot(self.contents_path, objects, self.clock.now())

    def load_contents(self) -> int:
        """Restore the explicit objects a previous run kept (expired ones are dropped)."""
        ledger = self.ledger("google_explicit")
        for obj in load_snapshot(self.contents_path, self.clock.now()):
            ledger.objects[obj.object_id] = obj
        return len(ledger.objects)


def _billed_replica(record: ExchangeRecord) -> str:
    """The record's `replica`: the instance whose prefix cache its `engine_cached_tokens`
    describe. In a P/D exchange that is the prefill instance (the decode instance streamed the
    answer, and counts the blocks it pulled as cached: `gateway.pipeline.disagg`)."""
    return record.cached_on or record.replica
