"""Exact money: `decimal.Decimal` everywhere, half-up rounding only for display.

Prices are dollars per million tokens, so a token charge `tokens × price / 1e6` is exact in
decimal (a finite decimal times an integer, divided by a power of ten). The only inexact
quantities are rent (seconds / 3600 hours) and ratios for display (IET with r = 1/30, hit
rates); those are computed in a 50-digit context and rent is quantized to `RENT_QUANTUM`.
"""

from __future__ import annotations

import datetime as dt
import functools
from decimal import ROUND_HALF_UP, Context, Decimal, InvalidOperation, localcontext
from typing import Any

MILLION = Decimal(1_000_000)
SECONDS_PER_HOUR = Decimal(3600)
CENT = Decimal("0.01")
RENT_QUANTUM = Decimal("1e-12")
"""Rent is tokens × $/M/h × seconds / 3600 / 1e6: quantized to a picodollar, far below any
displayed digit, so sums of rent stay exact decimals."""
WIDE = Context(prec=50)
"""A context for the few divisions (hours, ratios): 50 digits, then quantized or displayed."""
ZERO = Decimal(0)
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def dec(value: Any) -> Decimal:
    """A Decimal from an int, a str or a Decimal (never from a float's binary expansion: floats
    go through their shortest repr, so 0.1 is 0.1)."""
    if isinstance(value, Decimal):
        return value
    if isinstance(value, bool):
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, str):
        try:
            result = Decimal(value.strip())
        except InvalidOperation:
            raise ValueError(f"not a decimal number: {value!r}") from None
        if not result.is_finite():
            raise ValueError(f"not a finite number: {value!r}")
        return result
    raise ValueError(f"not a number: {value!r}")


def divide(a: Decimal, b: Decimal) -> Decimal:
    with localcontext(WIDE):
        return a / b


def display(amount: Decimal, quantum: Decimal = CENT) -> str:
    """Half-up rounding for display only: $5.075 → "5.08" (binary floats print 5.07)."""
    return str(amount.quantize(quantum, rounding=ROUND_HALF_UP))


def plain(amount: Decimal) -> str:
    """The exact value as a plain decimal string without exponent or trailing zeros."""
    if amount == 0:
        return "0"
    text = format(amount.normalize(), "f")
    return text


def to_datetime(unix_s: Decimal) -> dt.datetime:
    """A UTC datetime (microsecond resolution) from unix seconds."""
    micros = int((unix_s * 1_000_000).to_integral_value(rounding=ROUND_HALF_UP))
    return EPOCH + dt.timedelta(microseconds=micros)


def iso(unix_s: Decimal) -> str:
    """ISO-8601 UTC with a `Z`, e.g. 2026-09-01T12:00:00.250000Z (microseconds only if any)."""
    micros = int((unix_s * 1_000_000).to_integral_value(rounding=ROUND_HALF_UP))
    seconds, fraction = divmod(micros, 1_000_000)
    text = _iso_seconds(seconds)
    return f"{text}.{fraction:06d}Z" if fraction else text + "Z"


@functools.lru_cache(maxsize=1024)
def _iso_seconds(seconds: int) -> str:
    """The whole-second part (cached: a busy gateway formats the same second many times)."""
    return (EPOCH + dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S")


def parse_instant(text: str) -> Decimal:
    """Unix seconds from ISO-8601 (a `Z` or an offset; naive means UTC) or plain unix seconds."""
    value = text.strip()
    try:
        return dec(value)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"not an instant: {text!r}; give ISO-8601 (2026-09-01T00:00:00Z) or unix seconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    delta = moment - EPOCH
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / MILLION
