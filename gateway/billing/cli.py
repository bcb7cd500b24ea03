"""`kvgate billing`: simulate (what-if pricing), export and summary (the ledger).

    kvgate billing simulate EVENTS.jsonl --profile P --model M [--start ISO] [--json PATH|-]
    kvgate billing export --tenant T --from ISO --to ISO --format csv|jsonl|parquet [--output PATH]
    kvgate billing summary [--from ISO] [--to ISO] [--tenant T]
    kvgate billing ship --wal-dir DIR [--wal-dir DIR ...] --redis-url URL [--allow-unsafe-fsync]
    kvgate billing inspect --wal-dir DIR [--wal-dir DIR ...]

export and summary read the shared ledger store (`--redis-url`, or `billing_redis_url` from
`--config`) or, without one, the local write-ahead logs (`--wal-dir`, repeatable). ship takes
over the WAL directories of gateways that are gone (a pod that did not come back) and ships
them to the store; a directory a live gateway holds is refused. inspect prints what WAL
directories hold as they are, one JSON object: every record's id and status in write order,
duplicates included (an export deduplicates by id, so it cannot show one), and the ids of the
open entries no record settles (what the next start over the directory bills as aborted); it
only reads (no lock is taken), so it also reads the directory of a live gateway.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway.billing.pricing.prices import PROFILES
from gateway.billing.wal import WalLocked


def add_billing_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="billing_command", required=True, metavar="COMMAND")

    sim = commands.add_parser("simulate", help="price a workload file under a profile (no engines)")
    sim.add_argument("events", help="the workload: one JSON object per line ('-' for stdin)")
    sim.add_argument(
        "--profile", required=True, choices=PROFILES, help="billing profile to price under"
    )
    sim.add_argument("--model", required=True, help="a model of the profile's price table")
    sim.add_argument(
        "--start", default="1970-01-01T00:00:00Z", help="ISO-8601 instant that t counts from"
    )
    sim.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    sim.add_argument("--prices", type=Path, help="a YAML/JSON prices file over the defaults")
    sim.add_argument("--lookback", type=int, help="anthropic lookback in blocks (default 20)")
    sim.add_argument("--openai-ttl-s", help="openai lifetime in seconds (default 1800)")
    sim.add_argument(
        "--deepseek-unit",
        choices=("64", "request_boundaries"),
        help="DeepSeek cache unit: 64-token blocks or request boundaries",
    )
    sim.add_argument(
        "--holiday", action="append", default=[], metavar="DATE", help="a DeepSeek off-peak date"
    )

    bench = commands.add_parser("bench", help="the pricing engine's speed, in-process")
    bench.add_argument("--steps", type=int, default=50, help="agent session length")
    bench.add_argument("--sessions", type=int, default=40, help="sessions priced")

    ship = commands.add_parser(
        "ship", help="ship the WALs of gateways that are gone to the ledger store"
    )
    ship.add_argument("--wal-dir", action="append", type=Path, required=True, help="repeatable")
    ship.add_argument("--redis-url", required=True, help="the shared ledger store (an AOF Redis)")
    ship.add_argument(
        "--allow-unsafe-fsync",
        action="store_true",
        help="ship to a store without appendfsync always (a store crash may lose records)",
    )

    inspect = commands.add_parser(
        "inspect", help="the records and unsettled open entries of WAL directories, as JSON"
    )
    inspect.add_argument("--wal-dir", action="append", type=Path, required=True, help="repeatable")

    for name, text in (("export", "one tenant's ledger records"), ("summary", "totals per tenant")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config", type=Path, help="a YAML file of gateway settings")
        sub.add_argument("--redis-url", help="the shared ledger store (an AOF Redis)")
        sub.add_argument(
            "--wal-dir", action="append", type=Path, default=[], help="read local WALs instead"
        )
        required = name == "export"
        sub.add_argument("--from", dest="start", required=required, help="ISO-8601, inclusive")
        sub.add_argument("--to", dest="end", required=required, help="ISO-8601, exclusive")
        sub.add_argument("--tenant", required=name == "export", help="the tenant whose records")
        if name == "export":
            sub.add_argument(
                "--format",
                choices=("csv", "jsonl", "parquet"),
                default="jsonl",
                help="output format",
            )
            sub.add_argument("--output", type=Path, help="a file (required for parquet)")
        else:
            sub.add_argument("--json", action="store_true", help="JSON instead of a table")


def run_billing(args: argparse.Namespace) -> int:
    try:
        if args.billing_command == "simulate":
            return _simulate(args)
        if args.billing_command == "export":
            return _export(args)
        if args.billing_command == "bench":
            return _bench(args)
        if args.billing_command == "ship":
            return _ship(args)
        if args.billing_command == "inspect":
            return _inspect(args)
        return _summary(args)
    except (ValueError, OverflowError, WalLocked, RedisError, OSError) as exc:
        print(f"kvgate billing {args.billing_command}: {exc}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    from decimal import Decimal

    from gateway.billing.pricing.money import dec, parse_instant
    from gateway.billing.pricing.prices import load_price_table
    from gateway.billing.pricing.rules import ProfileOptions
    from gateway.billing.simulate import simulate

    options: dict[str, Any] = {}
    if args.lookback is not None:
        options["lookback_blocks"] = args.lookback
    if args.openai_ttl_s is not None:
        options["openai_ttl_s"] = dec(args.openai_ttl_s)
    if args.deepseek_unit is not None:
        options["deepseek_unit"] = args.deepseek_unit
    if args.holiday:
        try:
            options["deepseek_holidays"] = frozenset(dt.date.fromisoformat(d) for d in args.holiday)
        except ValueError as exc:
            raise ValueError(f"--holiday takes YYYY-MM-DD: {exc}") from None
    start: Decimal = parse_instant(args.start)
    if args.events == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(args.events).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read {args.events}: {exc}") from None
    result = simulate(
        lines,
        args.profile,
        args.model,
        prices=load_price_table(args.prices),
        options=ProfileOptions(**options),
        start=start,
    )
    if args.json == "-":
        sys.stdout.write(orjson.dumps(result.as_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(result.render())
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result.as_json(), option=orjson.OPT_INDENT_2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from gateway.billing.export import export_command

    return export_command(args)


def _ship(args: argparse.Namespace) -> int:
    import asyncio

    from gateway.billing.store import ship_directories

    shipped = asyncio.run(
        ship_directories(args.wal_dir, args.redis_url, allow_unsafe=args.allow_unsafe_fsync)
    )
    for path, n in shipped.items():
        print(f"{path}: {n} records shipped")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from gateway.billing.wal import read_directory, unsettled

    for path in args.wal_dir:
        if not path.is_dir():
            raise ValueError(f"{path} is not a directory")
    found = {
        "records": [
            [str(r.get("id")), str(r.get("status"))]
            for path in args.wal_dir
            for r in read_directory(path)
        ],
        "unsettled": [str(r.get("id")) for path in args.wal_dir for r in unsettled(path)],
    }
    sys.stdout.write(orjson.dumps(found).decode() + "\n")
    return 0


def _summary(args: argparse.Namespace) -> int:
    from gateway.billing.export import summary_command

    return summary_command(args)


def session_lines(steps: int, tenant: str) -> list[str]:
    """The agent session of docs/billing.md#agent-session (warm, 60 s apart) as workload lines."""
    lines = []
    for step in range(1, steps + 1):
        segments: list[dict[str, object]] = [{"id": "task", "tokens": 12_000}]
        for j in range(1, step):
            segments += [{"id": f"o{j}", "tokens": 400}, {"id": f"t{j}", "tokens": 1100}]
        segments[-1]["cache_control"] = {"ttl": "5m"}
        line = {"t": 60 * step, "tenant": tenant, "segments": segments, "output_tokens": 400}
        lines.append(orjson.dumps(line).decode())
    return lines


def _bench(args: argparse.Namespace) -> int:
    """Parse and price `--sessions` agent sessions; microseconds per request for each."""
    import time

    from gateway.billing.events import parse_events
    from gateway.billing.pricing.prices import PriceTable
    from gateway.billing.simulate import Simulator

    lines = [line for s in range(args.sessions) for line in session_lines(args.steps, f"t{s}")]
    t0 = time.perf_counter()
    events = parse_events(lines)
    t1 = time.perf_counter()
    result = Simulator("anthropic", "sonnet-5", PriceTable.default()).run(events)
    t2 = time.perf_counter()
    assert result.totals.requests == len(lines)
    print(
        f"{args.sessions} sessions of {args.steps} steps (anthropic, up to {2 * args.steps - 1} "
        f"blocks): parse {(t1 - t0) / len(lines) * 1e6:.1f} µs + price "
        f"{(t2 - t1) / len(lines) * 1e6:.1f} µs per request"
    )
    return 0
