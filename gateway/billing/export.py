"""Exports (CSV, JSON lines, Parquet) and per-tenant summaries of ledger records.

Exactly once: a window [from, to) holds each record whose start lies in it, once (the store and
`LocalLedger` deduplicate by id), ordered by (start, id); adjacent windows partition the records,
so daily exports never drop or double a record at midnight. Money stays exact: decimal strings
in CSV and JSON lines, decimal128(38, 12) in Parquet.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from gateway.billing.pricing.money import ZERO, display, divide, parse_instant, plain
from gateway.billing.records import COLUMNS, INT_COLUMNS, JSON_COLUMNS, MONEY_COLUMNS, money
from gateway.billing.store import LedgerStore, LocalLedger, RedisLedgerStore, check_layout

FORMATS = ("csv", "jsonl", "parquet")
MEDIA_TYPES = {
    "csv": "text/csv; charset=utf-8",
    "jsonl": "application/x-ndjson",
    "parquet": "application/vnd.apache.parquet",
}
PARQUET_MONEY = (38, 12)
"""decimal128 precision and scale: costs are exact to the picodollar, rent is quantized there."""


def _cell(record: dict[str, Any], column: str) -> Any:
    value = record.get(column)
    if column in JSON_COLUMNS:
        return orjson.dumps(value or {}).decode()
    return "" if value is None else value


def to_csv(records: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for record in records:
        writer.writerow([_cell(record, c) for c in COLUMNS])
    return out.getvalue()


def from_csv(text: str) -> list[dict[str, Any]]:
    """The inverse of `to_csv` (for round trips and reconciliation)."""
    rows = []
    for raw in csv.DictReader(io.StringIO(text)):
        record: dict[str, Any] = {}
        for column in COLUMNS:
            value = raw.get(column) or ""  # a column added since the file was written: empty
            if column in JSON_COLUMNS:
                record[column] = orjson.loads(value) if value else {}
            elif column in INT_COLUMNS:
                record[column] = int(value) if value != "" else None
            else:
                record[column] = value if value != "" else None
        rows.append(record)
    return rows


def to_jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def from_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


class FormatUnavailable(ValueError):
    """The format needs a package this installation lacks (the client may ask for another)."""


PARQUET_EXTRA = "pip install 'kvgate[parquet]'"
"""What installs pyarrow (the image does: its Dockerfile installs the extra)."""


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise FormatUnavailable(
            f"parquet export needs pyarrow, which this gateway lacks ({PARQUET_EXTRA}); "
            "csv and jsonl are available"
        ) from None
    return pa, pq


def to_parquet(records: list[dict[str, Any]]) -> bytes:
    pa, pq = _pyarrow()

    money_type = pa.decimal128(*PARQUET_MONEY)
    columns: dict[str, Any] = {}
    for column in COLUMNS:
        values = [record.get(column) for record in records]
        if column in MONEY_COLUMNS:
            columns[column] = pa.array([money(r, column) for r in records], type=money_type)
        elif column in INT_COLUMNS:
            columns[column] = pa.array(values, type=pa.int64())
        elif column in JSON_COLUMNS:
            columns[column] = pa.array([orjson.dumps(v or {}).decode() for v in values])
        else:
            columns[column] = pa.array(
                [None if v is None else str(v) for v in values], type=pa.string()
            )
    table = pa.table(columns)
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def from_parquet(data: bytes) -> list[dict[str, Any]]:
    _, pq = _pyarrow()

    table = pq.read_table(io.BytesIO(data))
    rows = table.to_pylist()
    for row in rows:
        for column in COLUMNS:
            row.setdefault(column, None)  # a column added since the file was written
        for column in MONEY_COLUMNS:
            row[column] = plain(row[column]) if row[column] is not None else None
        for column in JSON_COLUMNS:
            row[column] = orjson.loads(row[column]) if row[column] else {}
    return rows  # type: ignore[no-any-return]


def encode(records: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "csv":
        return to_csv(records).encode()
    if fmt == "jsonl":
        return to_jsonl(records)
    if fmt == "parquet":
        return to_parquet(records)
    raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


# -- summaries -------------------------------------------------------------------------------------
def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tenant: requests, input (N), written, read and uncached tokens, output, rent, cost,
    the effective input multiplier (IET / N) and the hit rate (R / N)."""
    sums: dict[str, dict[str, Any]] = {}
    for r in records:
        s = sums.setdefault(
            r["tenant"],
            {
                "requests": 0,
                "input_tokens": 0,
                "written_tokens": 0,
                "read_tokens": 0,
                "uncached_tokens": 0,
                "output_tokens": 0,
                "iet": ZERO,
                "rent": ZERO,
                "cost": ZERO,
            },
        )
        if r["kind"] == "request":
            s["requests"] += 1
            s["input_tokens"] += int(r["prompt_tokens"] or 0)
            s["written_tokens"] += int(r["written_tokens"] or 0)
            s["read_tokens"] += int(r["read_tokens"] or 0)
            s["uncached_tokens"] += int(r["uncached_tokens"] or 0)
            s["output_tokens"] += int(r["output_tokens"] or 0)
            s["iet"] += Decimal(str(r["iet"]))
        s["rent"] += money(r, "rent")
        s["cost"] += money(r, "cost")
    out: dict[str, dict[str, Any]] = {}
    for tenant in sorted(sums):
        s = sums[tenant]
        n = s["input_tokens"]
        out[tenant] = {
            **{k: v for k, v in s.items() if k not in ("iet", "rent", "cost")},
            "rent": plain(s["rent"]),
            "cost": plain(s["cost"]),
            "cost_display": display(s["cost"]),
            "effective_input_multiplier": _ratio(s["iet"], n),
            "hit_rate": _ratio(Decimal(s["read_tokens"]), n),
        }
    return out


def _ratio(numerator: Decimal, n: int) -> str | None:
    from decimal import ROUND_HALF_UP

    if not n:
        return None
    return plain(divide(numerator, Decimal(n)).quantize(Decimal("1e-6"), ROUND_HALF_UP))


def render_summary(summary: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'tenant':<16} {'requests':>8} {'input':>12} {'written':>10} {'read':>12} "
        f"{'uncached':>10} {'rent $':>10} {'cost $':>12} {'multiplier':>10} {'hit rate':>8}"
    )
    lines = [header]
    for tenant, s in summary.items():
        lines.append(
            f"{tenant:<16} {s['requests']:>8} {s['input_tokens']:>12} {s['written_tokens']:>10} "
            f"{s['read_tokens']:>12} {s['uncached_tokens']:>10} {s['rent']:>10} {s['cost']:>12} "
            f"{s['effective_input_multiplier'] or '-':>10} {s['hit_rate'] or '-':>8}"
        )
    return "\n".join(lines)


# -- the CLI ---------------------------------------------------------------------------------------
def _window(args: argparse.Namespace) -> tuple[Decimal | None, Decimal | None]:
    start = parse_instant(args.start) if args.start else None
    end = parse_instant(args.end) if args.end else None
    if start is not None and end is not None and end <= start:
        raise ValueError("--to must be after --from")
    return start, end


async def _query(args: argparse.Namespace, tenant: str | None) -> list[dict[str, Any]]:
    start, end = _window(args)
    redis_url = args.redis_url
    directories: list[Path] = list(args.wal_dir)
    if args.config is not None and not redis_url and not directories:
        from pydantic import ValidationError

        from gateway.settings import describe_errors, load_settings

        try:
            settings = load_settings(args.config)
        except ValidationError as exc:
            raise ValueError(
                f"invalid settings in {args.config}:\n{describe_errors(exc)}"
            ) from None
        redis_url = settings.billing_redis_url
        if settings.billing_wal_dir is not None:
            directories = [settings.billing_wal_dir]
    if redis_url:
        from cachemap.redis.client import open_redis

        client = await open_redis(redis_url, cluster=False)
        try:
            await check_layout(client, claim=False)
            store: LedgerStore = RedisLedgerStore(client)
            return await store.query(tenant, start, end)
        finally:
            await client.aclose()
    if not directories:
        raise ValueError("no ledger: give --redis-url, --wal-dir or --config")
    return LocalLedger(directories).query_sync(tenant, start, end)


def export_command(args: argparse.Namespace) -> int:
    records = asyncio.run(_query(args, args.tenant))
    if args.format == "parquet" and args.output is None:
        raise ValueError("parquet needs --output PATH")
    data = encode(records, args.format)
    if args.output is None:
        sys.stdout.buffer.write(data)
    else:
        args.output.write_bytes(data)
        print(f"{len(records)} records → {args.output}", file=sys.stderr)
    return 0


def summary_command(args: argparse.Namespace) -> int:
    summary = summarize(asyncio.run(_query(args, args.tenant)))
    if args.json:
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(render_summary(summary))
    return 0
