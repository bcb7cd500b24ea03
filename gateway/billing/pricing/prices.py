"""The price table: per profile, per model, in dollars per million tokens.

Every multiplier is relative to the model's base input price (docs/billing.md#common-model).
A row may state the read price directly (DeepSeek publishes hit prices: $0.022 on V4-Pro is
r = 1/30, which no finite decimal multiplier states exactly). Rent rates are time-versioned: a
list of (effective-from instant, $/M tokens/hour), integrated piecewise (`rent`).

The defaults below are docs/billing.md's (September 2026; a bracketed tag such as [P] names one
of its #sources). Figures marked "(assumption)" are not published: they are placeholders an
operator overrides with a YAML/JSON file of the same shape (`billing_prices_file`,
`kvgate billing simulate --prices`):

    anthropic:
      sonnet-5: {input: "2", output: "10", min_tokens: 1024}
    google_explicit:
      gemini-3.1-pro:
        input: "2.00"
        rent: [["1970-01-01", "4.50"], ["2027-01-01", "9.00"]]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from gateway.billing.pricing.money import (
    MILLION,
    RENT_QUANTUM,
    SECONDS_PER_HOUR,
    ZERO,
    dec,
    divide,
    parse_instant,
)
from gateway.request.tenant import BILLING_PROFILES

PROFILES = BILLING_PROFILES
"""The billing profiles (docs/billing.md#profiles), in the order the docs list them (defined
with the settings, which validate them and import nothing of billing)."""

NEW_YEAR_2027 = parse_instant("2027-01-01T00:00:00Z")
"""Gemini explicit-cache rent doubles on 2027-01-01 [P]."""


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """One model's prices under one profile. Invariant: every price ≥ 0; rent instants ascend."""

    input: Decimal
    """$ per million uncached input tokens (the base every multiplier refers to)."""
    output: Decimal
    read_multiplier: Decimal | None = None
    """r for this model; None: the profile's default."""
    read_price: Decimal | None = None
    """$ per million read tokens, when published directly (wins over the multiplier)."""
    min_tokens: int | None = None
    """Minimum cacheable prefix; None: the profile's default."""
    rent: tuple[tuple[Decimal, Decimal], ...] = field(default=())
    """(effective-from unix seconds, $ per million tokens per hour), ascending."""

    def __post_init__(self) -> None:
        for name in ("input", "output", "read_multiplier", "read_price"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"price field {name!r} must not be negative, got {value}")
        starts = [start for start, _ in self.rent]
        if starts != sorted(starts):
            raise ValueError("rent rates must be listed in ascending order of their start")

    def read(self, default_multiplier: Decimal) -> Decimal:
        """$ per million read tokens."""
        if self.read_price is not None:
            return self.read_price
        multiplier = (
            self.read_multiplier if self.read_multiplier is not None else default_multiplier
        )
        return self.input * multiplier

    def rent_between(self, tokens: int, start: Decimal, end: Decimal) -> Decimal:
        """Rent of `tokens` kept from `start` to `end` (unix seconds), integrated piecewise over
        the versioned rates; negative when end < start (a refund). Quantized to RENT_QUANTUM."""
        if end < start:
            return -self.rent_between(tokens, end, start)
        if not self.rent or end == start or tokens == 0:
            return ZERO
        total = ZERO
        for i, (rate_start, rate) in enumerate(self.rent):
            rate_end = self.rent[i + 1][0] if i + 1 < len(self.rent) else None
            lo = max(start, rate_start)
            hi = end if rate_end is None else min(end, rate_end)
            if hi > lo:
                total += dec(tokens) * rate * (hi - lo)
        return divide(total, MILLION * SECONDS_PER_HOUR).quantize(RENT_QUANTUM)


def _row(
    input: str,
    output: str,
    *,
    read: str | None = None,
    read_price: str | None = None,
    min_tokens: int | None = None,
    rent: tuple[tuple[str, str], ...] = (),
) -> ModelPrice:
    return ModelPrice(
        input=Decimal(input),
        output=Decimal(output),
        read_multiplier=Decimal(read) if read is not None else None,
        read_price=Decimal(read_price) if read_price is not None else None,
        min_tokens=min_tokens,
        rent=tuple((parse_instant(start), Decimal(rate)) for start, rate in rent),
    )


_GOOGLE: dict[str, ModelPrice] = {
    # input implied by [P]: rent is 2.25× (3.1 Pro) and 2/3× (3.8 Flash) the input price per hour
    "gemini-3.1-pro": _row(
        "2.00",
        "12",  # output (assumption)
        min_tokens=4096,
        rent=(("1970-01-01", "4.50"), ("2027-01-01", "9.00")),
    ),
    "gemini-3.8-flash": _row(
        "0.75",
        "3",  # output (assumption)
        min_tokens=4096,
        rent=(("1970-01-01", "0.50"), ("2027-01-01", "1.00")),
    ),
    # [V]: reads at 0.25 on Gemini 2.0; prices and rent (assumption)
    "gemini-2.0-flash": _row(
        "0.10", "0.40", read="0.25", min_tokens=1024, rent=(("1970-01-01", "1.00"),)
    ),
}

DEFAULT_PRICES: dict[str, dict[str, ModelPrice]] = {
    "anthropic": {
        "sonnet-5": _row("2", "10", min_tokens=1024),
        "opus-5.5": _row("4", "20", read="0.05", min_tokens=512),  # output, minimum (assumption)
        "fable-5.1": _row("3", "15", read="0.025", min_tokens=512),  # prices (assumption)
        "mythos-5.1": _row("15", "75", read="0.025", min_tokens=512),  # prices (assumption)
        "fable-5": _row("3", "15", min_tokens=512),  # prices (assumption)
        "opus-4.8": _row("5", "25", min_tokens=1024),  # prices (assumption)
        "opus-4.7": _row("5", "25", min_tokens=2048),  # prices (assumption)
        "opus-4.6": _row("5", "25", min_tokens=4096),  # prices (assumption)
        "haiku-4.5": _row("1", "5", min_tokens=4096),  # prices (assumption)
    },
    "openai": {
        "gpt-5.6": _row("1.25", "10"),  # prices (assumption)
        "gpt-6.1-sol": _row("2.50", "15", read="0.05"),  # prices (assumption)
    },
    "openai_legacy": {
        # historic read multipliers, not re-verified (docs/billing.md#openai-legacy)
        "gpt-4o": _row("2.50", "10", read="0.5"),
        "gpt-4.1": _row("2.00", "8", read="0.25"),
        "gpt-5": _row("1.25", "10", read="0.1"),
    },
    "google_implicit": _GOOGLE,
    "google_explicit": _GOOGLE,
    "deepseek": {
        "deepseek-v4.1-flash": _row("0.15", "0.60", read_price="0.003"),
        "deepseek-v4-pro": _row("0.66", "1.98", read_price="0.022"),
    },
}


class PriceTable:
    """Profile → model → `ModelPrice`; `lookup` names the valid models on a miss."""

    def __init__(self, table: Mapping[str, Mapping[str, ModelPrice]]) -> None:
        unknown = set(table) - set(PROFILES)
        if unknown:
            raise ValueError(
                f"unknown billing profile(s) {', '.join(sorted(unknown))} in the price table; "
                f"valid: {', '.join(PROFILES)}"
            )
        self._table = {profile: dict(models) for profile, models in table.items()}

    @classmethod
    def default(cls) -> PriceTable:
        return cls(DEFAULT_PRICES)

    def models(self, profile: str) -> list[str]:
        return sorted(self._table.get(profile, {}))

    def get(self, profile: str, model: str) -> ModelPrice | None:
        return self._table.get(profile, {}).get(model)

    def lookup(self, profile: str, model: str) -> ModelPrice:
        row = self.get(profile, model)
        if row is None:
            raise ValueError(
                f"no price for model {model!r} under profile {profile!r}; priced models: "
                f"{', '.join(self.models(profile)) or 'none'}"
            )
        return row

    def merged(self, overrides: Mapping[str, Mapping[str, Any]]) -> PriceTable:
        """A copy with rows added or fields replaced from a parsed YAML/JSON mapping."""
        table = {profile: dict(models) for profile, models in self._table.items()}
        for profile, models in overrides.items():
            if profile not in PROFILES:
                raise ValueError(
                    f"unknown billing profile {profile!r} in the prices file; valid: "
                    f"{', '.join(PROFILES)}"
                )
            if not isinstance(models, Mapping):
                raise ValueError(f"prices for {profile!r} must map model names to rows")
            rows = table.setdefault(profile, {})
            for model, fields in models.items():
                rows[str(model)] = _parse_row(profile, str(model), fields, rows.get(str(model)))
        return PriceTable(table)


_ROW_FIELDS = ("input", "output", "read_multiplier", "read_price", "min_tokens", "rent")


def _parse_row(profile: str, model: str, fields: Any, base: ModelPrice | None) -> ModelPrice:
    where = f"prices[{profile}][{model}]"
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where} must be a mapping of {', '.join(_ROW_FIELDS)}")
    unknown = set(fields) - set(_ROW_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; valid: "
            f"{', '.join(_ROW_FIELDS)}"
        )
    if base is None and not {"input", "output"} <= set(fields):
        raise ValueError(f"{where}: a new model needs 'input' and 'output' ($ per M tokens)")
    changes: dict[str, Any] = {}
    try:
        for name in ("input", "output", "read_multiplier", "read_price"):
            if name in fields:
                changes[name] = None if fields[name] is None else dec(fields[name])
        if "min_tokens" in fields:
            changes["min_tokens"] = (
                None if fields["min_tokens"] is None else int(fields["min_tokens"])
            )
        if "rent" in fields:
            changes["rent"] = tuple(
                (parse_instant(str(start)), dec(rate)) for start, rate in fields["rent"]
            )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if base is None:
        return ModelPrice(**changes)
    return replace(base, **changes)


def load_price_table(path: Path | None) -> PriceTable:
    """The defaults, overridden by a YAML or JSON file when given."""
    table = PriceTable.default()
    if path is None:
        return table
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the prices file {path}: {exc}") from None
    if data is None:
        return table
    if not isinstance(data, Mapping):
        raise ValueError(f"the prices file {path} must map profile names to models")
    return table.merged(data)


ZERO_PRICE = ModelPrice(input=ZERO, output=ZERO)
