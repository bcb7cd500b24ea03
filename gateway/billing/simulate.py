"""`kvgate billing simulate`: price a workload file under any profile, without engines.

The same `CacheLedger` as the live meter, fed from `events` in start order. Each request's
result carries its usage in the profile's own field names and its cost; the totals sum exact
decimals (displayed half-up to cents only at the end).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from gateway.billing.events import (
    Event,
    Segment,
    chain_keys,
    implicit_flags,
    parse_events,
    visible_after,
)
from gateway.billing.pricing.ledger import CacheLedger
from gateway.billing.pricing.model import BillingError, Block, CachedContent, Charge, MeteredRequest
from gateway.billing.pricing.money import ZERO, display, divide, iso, plain
from gateway.billing.pricing.prices import PriceTable
from gateway.billing.pricing.rules import DEFAULT_EXPLICIT_TTL_S, ProfileOptions, translate_mark
from gateway.billing.pricing.usage import flat_usage, profile_usage


@dataclass
class Row:
    """One priced line of the workload."""

    event: Event
    op: str
    charge: Charge | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the profile refused the line (the gateway would answer 400)."""
    skipped: str | None = None
    """Why the line does not apply under this profile (an explicit-cache op elsewhere)."""

    def as_json(self, start: Decimal) -> dict[str, Any]:
        out: dict[str, Any] = {
            "line": self.event.line,
            "t": plain(self.event.t),
            "start": iso(start + self.event.t),
            "tenant": self.event.tenant,
            "op": self.op,
        }
        if self.event.object_id:
            out["id"] = self.event.object_id
        if self.error is not None or self.skipped is not None:
            out["error" if self.error is not None else "skipped"] = self.error or self.skipped
            return out
        charge = self.charge
        assert charge is not None
        out["usage"] = self.usage
        out["iet"] = plain(charge.input_equivalent_tokens)
        out["cost"] = {
            "input": plain(charge.input_cost),
            "output": plain(charge.output_cost),
            "rent": plain(charge.rent),
            "total": plain(charge.cost),
        }
        if charge.peak_multiplier != 1:
            out["peak_multiplier"] = plain(charge.peak_multiplier)
        return out


RATIO_QUANTUM = Decimal("1e-12")
"""Ratios (multiplier, hit rate) are not money: 12 decimals, half-up."""


def ratio(numerator: Decimal, denominator: int) -> str | None:
    if not denominator:
        return None
    return plain(divide(numerator, Decimal(denominator)).quantize(RATIO_QUANTUM, ROUND_HALF_UP))


@dataclass
class Totals:
    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    read_tokens: int = 0
    written_tokens: int = 0
    output_tokens: int = 0
    iet: Decimal = ZERO
    input_cost: Decimal = ZERO
    output_cost: Decimal = ZERO
    rent: Decimal = ZERO

    @property
    def cost(self) -> Decimal:
        return self.input_cost + self.output_cost + self.rent

    def add(self, row: Row) -> None:
        if row.skipped is not None:
            return
        if row.error is not None:
            self.refused += 1
            return
        charge = row.charge
        assert charge is not None
        if row.op == "request":
            self.requests += 1
            self.prompt_tokens += charge.num_prompt_tokens
            self.uncached_tokens += charge.uncached
            self.read_tokens += charge.read
            self.written_tokens += charge.num_written
            self.output_tokens += charge.num_output_tokens
            self.iet += charge.input_equivalent_tokens
        self.input_cost += charge.input_cost
        self.output_cost += charge.output_cost
        self.rent += charge.rent

    def as_json(self) -> dict[str, Any]:
        n = self.prompt_tokens
        return {
            "requests": self.requests,
            "refused": self.refused,
            "prompt_tokens": n,
            "uncached_tokens": self.uncached_tokens,
            "read_tokens": self.read_tokens,
            "written_tokens": self.written_tokens,
            "output_tokens": self.output_tokens,
            "iet": plain(self.iet),
            "input_cost": plain(self.input_cost),
            "output_cost": plain(self.output_cost),
            "rent": plain(self.rent),
            "cost": plain(self.cost),
            "cost_display": display(self.cost),
            "effective_input_multiplier": ratio(self.iet, n),
            "hit_rate": ratio(Decimal(self.read_tokens), n),
        }


@dataclass
class Simulation:
    profile: str
    model: str
    start: Decimal
    rows: list[Row]
    totals: Totals

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "model": self.model,
            "start": iso(self.start),
            "requests": [row.as_json(self.start) for row in self.rows],
            "totals": self.totals.as_json(),
        }

    def render(self) -> str:
        lines = [
            f"profile {self.profile} · model {self.model} · start {iso(self.start)}",
            f"{'line':>5} {'t (s)':>12} {'tenant':<10} {'op':<13} {'cost $':>14}  usage",
        ]
        for row in self.rows:
            head = f"{row.event.line:>5} {plain(row.event.t):>12} {row.event.tenant:<10} "
            if row.error is not None or row.skipped is not None:
                status = "refused" if row.error is not None else "skipped"
                lines.append(head + f"{row.op:<13} {status:>14}  {row.error or row.skipped}")
                continue
            assert row.charge is not None
            fields = " ".join(f"{k}={v}" for k, v in flat_usage(row.usage).items())
            if row.op != "request":
                fields = f"id={row.event.object_id} rent={plain(row.charge.rent)} " + fields
            lines.append(head + f"{row.op:<13} {plain(row.charge.cost):>14}  {fields}")
        t = self.totals.as_json()
        lines += [
            "totals:",
            f"  requests {t['requests']} (refused {t['refused']}) · prompt {t['prompt_tokens']} · "
            f"uncached {t['uncached_tokens']} · read {t['read_tokens']} · "
            f"written {t['written_tokens']} · output {t['output_tokens']}",
            f"  input-equivalent tokens {t['iet']} · effective input multiplier "
            f"{t['effective_input_multiplier']} · hit rate {t['hit_rate']}",
            f"  input ${t['input_cost']} + output ${t['output_cost']} + rent ${t['rent']} "
            f"= ${t['cost']} (displayed ${t['cost_display']})",
        ]
        return "\n".join(lines)


class Simulator:
    """Feeds events to a ledger; keeps each explicit object's segments so a request naming one
    is priced on the object's blocks followed by its own."""

    def __init__(
        self,
        profile: str,
        model: str,
        prices: PriceTable,
        options: ProfileOptions | None = None,
        start: Decimal = ZERO,
    ) -> None:
        self.profile = profile
        self.model = model
        self.start = start
        self.ledger = CacheLedger(profile, prices, options)
        self.ledger.row(model)  # an unknown model fails before any event
        self._object_segments: dict[tuple[str, str], tuple[Segment, ...]] = {}

    def run(self, events: Iterable[Event]) -> Simulation:
        rows = [self.step(event) for event in events]
        totals = Totals()
        for row in rows:
            totals.add(row)
        return Simulation(self.profile, self.model, self.start, rows, totals)

    def step(self, event: Event) -> Row:
        try:
            if event.op == "request":
                return self._request(event)
            return self._op(event)
        except BillingError as exc:
            return Row(event, event.op, error=str(exc))

    def _op(self, event: Event) -> Row:
        assert event.object_id is not None
        t = self.start + event.t
        key = (event.tenant, event.object_id)
        if event.op == "cache.create":
            self._object_segments[key] = event.segments
        if self.profile != "google_explicit":
            # other profiles have no explicit objects: the content is priced where it is used
            return Row(event, event.op, skipped=f"no explicit caches under {self.profile}")
        if event.op == "cache.create":
            ttl = event.ttl_s if event.ttl_s is not None else DEFAULT_EXPLICIT_TTL_S
            obj = CachedContent(
                object_id=event.object_id,
                tenant=event.tenant,
                model=self.model,
                num_tokens=sum(s.tokens for s in event.segments),
                num_blocks=len(event.segments),
                created=t,
                expires=t + ttl,
            )
            charge = self.ledger.create_content(obj)
        elif event.op == "cache.update":
            assert event.ttl_s is not None
            charge = self.ledger.update_content(event.tenant, event.object_id, t, t + event.ttl_s)
        else:
            charge = self.ledger.delete_content(event.tenant, event.object_id, t)
        return Row(event, event.op, charge, profile_usage(self.profile, charge))

    def _request(self, event: Event) -> Row:
        segments = event.segments
        if event.cached_content is not None:
            prefix = self._object_segments.get((event.tenant, event.cached_content))
            if prefix is None:
                raise BillingError(f"no cached content {event.cached_content!r} for this tenant")
            segments = prefix + segments
        keys = chain_keys(s.id for s in segments)
        eligible = implicit_flags(segments)
        blocks: list[Block] = []
        total = 0
        for segment, key, flag in zip(segments, keys, eligible, strict=True):
            total += segment.tokens
            blocks.append(
                Block(key, total, translate_mark(self.profile, segment.ttl), eligible=flag)
            )
        t = self.start + event.t
        request = MeteredRequest(
            request_id=f"line-{event.line}",
            tenant=event.tenant,
            model=self.model,
            start=t,
            visible_at=t + visible_after(event),
            blocks=tuple(blocks),
            num_prompt_tokens=total,
            num_output_tokens=event.output_tokens,
            max_tokens=event.max_tokens,
            explicit_mode=event.explicit_mode,
            auto_ttl=translate_mark(self.profile, event.auto_ttl),
            cached_content=event.cached_content if self.profile == "google_explicit" else None,
        )
        charge = self.ledger.price(request)
        return Row(event, "request", charge, profile_usage(self.profile, charge))


def simulate(
    lines: Iterable[str],
    profile: str,
    model: str,
    prices: PriceTable | None = None,
    options: ProfileOptions | None = None,
    start: Decimal = ZERO,
) -> Simulation:
    """Parse and price a workload (raises EventError / ValueError with the line named)."""
    simulator = Simulator(profile, model, prices or PriceTable.default(), options, start)
    return simulator.run(parse_events(lines))
