"""`kvgate billing simulate | export | summary` as a user runs them."""

from __future__ import annotations

import io
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

import kvgate_cli
from gateway.billing.export import from_csv, from_jsonl, from_parquet, to_csv, to_parquet
from gateway.billing.records import build_record
from gateway.billing.simulate import simulate

HERE = Path(__file__).parent


@pytest.mark.parametrize(
    ("scenario", "exact", "shown"),
    [
        ("uncached", "5.075", "5.08"),
        ("warm_5m", "0.88415", "0.88"),
        ("expiries", "1.87775", "1.88"),
        ("1h", "1.0124", "1.01"),
        ("pings", "0.97055", "0.97"),
    ],
)
def test_kvgate_billing_simulate_prices_the_50_step_session(
    scenario: str, exact: str, shown: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    events = str(HERE / f"session_{scenario}.jsonl")
    code = kvgate_cli.main(
        [
            "billing",
            "simulate",
            events,
            "--profile",
            "anthropic",
            "--model",
            "sonnet-5",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    totals = orjson.loads(out.read_bytes())["totals"]
    assert totals["cost"] == exact and totals["cost_display"] == shown
    printed = capsys.readouterr().out
    assert f"= ${exact} (displayed ${shown})" in printed
    assert "cache_read_input_tokens=" in printed  # each request, in the profile's own names


def test_the_console_script_writes_json_to_stdout_and_names_bad_input() -> None:
    kvgate = Path(sys.executable).parent / "kvgate"
    ok = subprocess.run(
        [
            str(kvgate),
            "billing",
            "simulate",
            str(HERE / "v08_openai.jsonl"),
            "--profile",
            "openai",
            "--model",
            "gpt-5.6",
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = orjson.loads(ok.stdout)
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in result["requests"]] == [
        0,
        10_000,
        12_000,
        0,
    ]
    assert result["requests"][0]["start"] == "1970-01-01T00:00:00Z"
    bad = subprocess.run(
        [str(kvgate), "billing", "simulate", "-", "--profile", "openai", "--model", "gpt-9"],
        input="",
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "priced models: gpt-5.6, gpt-6.1-sol" in bad.stderr


def test_start_makes_t_relative_and_dates_the_rent() -> None:
    lines = (HERE / "v12_google_explicit.jsonl").read_text().splitlines()
    before = simulate(lines, "google_explicit", "gemini-3.1-pro")
    after = simulate(
        lines, "google_explicit", "gemini-3.1-pro", start=Decimal(1_798_761_600)
    )  # 2027
    assert after.totals.rent == 2 * before.totals.rent
    assert after.as_json()["requests"][0]["start"] == "2027-01-01T00:00:00Z"


def _wal(tmp_path: Path) -> Path:
    wal = tmp_path / "wal"
    wal.mkdir()
    rows = []
    sim = simulate((HERE / "v08_openai.jsonl").read_text().splitlines(), "openai", "gpt-5.6")
    for i, row in enumerate(sim.rows):
        assert row.charge is not None
        for tenant in ("acme", "globex"):
            rows.append(
                build_record(
                    record_id=f"{tenant}-{i}",
                    kind="request",
                    status="ok",
                    tenant=tenant,
                    profile="openai",
                    model="m",
                    price_model="gpt-5.6",
                    start=Decimal(1_800_000_000) + row.event.t,
                    first_token=None,
                    charge=row.charge,
                    usage=row.usage,
                    queue_s=0.25 * i if i else None,
                )
            )
            if i == 0:  # a record written before `queue_ms` was a column: it has no such key
                del rows[-1]["queue_ms"]
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows + rows[:3])  # with replayed duplicates
    (wal / "wal-00000001.jsonl").write_bytes(data)
    return wal


def test_export_and_summary_from_local_wals_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wal = _wal(tmp_path)
    window = ["--from", "2027-01-15T08:00:00Z", "--to", "2027-01-15T10:00:00Z"]
    for fmt, decode in (
        ("jsonl", from_jsonl),
        ("csv", lambda b: from_csv(b.decode())),
        ("parquet", from_parquet),
    ):
        out = tmp_path / f"acme.{fmt}"
        code = kvgate_cli.main(
            [
                "billing",
                "export",
                "--wal-dir",
                str(wal),
                "--tenant",
                "acme",
                *window,
                "--format",
                fmt,
                "--output",
                str(out),
            ]
        )
        assert code == 0
        rows = decode(out.read_bytes())  # type: ignore[operator]
        assert [r["id"] for r in rows] == ["acme-0", "acme-1", "acme-2", "acme-3"]
        assert [r.get("queue_ms") for r in rows] == [None, 250, 500, 750], fmt
        assert sum(Decimal(str(r["cost"])) for r in rows) == Decimal("0.04025")
    capsys.readouterr()
    assert kvgate_cli.main(["billing", "summary", "--wal-dir", str(wal), "--json"]) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["acme"]["cost"] == summary["globex"]["cost"] == "0.04025"
    assert summary["acme"]["input_tokens"] == 46_000 and summary["acme"]["read_tokens"] == 22_000
    assert summary["acme"]["effective_input_multiplier"] == "0.7"  # 32,200 / 46,000
    assert kvgate_cli.main(["billing", "export", "--tenant", "acme", *window]) == 2  # no ledger
    assert "no ledger" in capsys.readouterr().err


async def test_inspect_shows_a_wal_as_it_is_duplicates_and_unsettled_entries_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `kvgate chaos` judges a drain by: an id written twice stays twice (an export
    deduplicates it), and an open entry no record settles is listed."""
    from gateway.billing.wal import WriteAheadLog

    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    one = {"id": "req-1", "status": "ok", "tenant": "acme", "start_unix": "1"}
    await wal.append(one)
    await wal.append({**one, "status": "aborted"})
    await wal.open_entry("req-2", {"id": "req-2", "status": "aborted", "tenant": "acme"})
    await wal.aclose()
    assert kvgate_cli.main(["billing", "inspect", "--wal-dir", str(tmp_path / "wal")]) == 0
    found = orjson.loads(capsys.readouterr().out)
    assert found == {"records": [["req-1", "ok"], ["req-1", "aborted"]], "unsettled": ["req-2"]}
    assert kvgate_cli.main(["billing", "inspect", "--wal-dir", str(tmp_path / "none")]) == 2


def test_an_export_written_before_the_queue_column_reads_back(tmp_path: Path) -> None:
    """A CSV or Parquet export made before `queue_ms` was a column reads as records whose
    `queue_ms` is empty (a reconciliation may read last month's files)."""
    records = from_jsonl((_wal(tmp_path) / "wal-00000001.jsonl").read_bytes())[:2]
    lines = to_csv(records).splitlines()
    header = lines[0].split(",")
    cut = header.index("queue_ms")
    old = "\n".join([",".join(header[:cut]), *(line.rsplit(",", 1)[0] for line in lines[1:])])
    rows = from_csv(old + "\n")
    assert [r["queue_ms"] for r in rows] == [None, None]
    assert [r["id"] for r in rows] == ["acme-0", "globex-0"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(to_parquet(records))).drop_columns(["queue_ms"])
    sink = io.BytesIO()
    pq.write_table(pa.table(table), sink)
    rows = from_parquet(sink.getvalue())
    assert [r["queue_ms"] for r in rows] == [None, None]
    assert [r["cost"] for r in rows] == [records[0]["cost"], records[1]["cost"]]
