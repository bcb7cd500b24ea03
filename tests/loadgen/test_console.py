"""Tables keep their columns outside a terminal (a pipe, a CI log): rich's 80 columns would cut
the demo's headers."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from loadgen.console import LOG_WIDTH, report_console
from loadgen.demo import demo_table

HEADERS = (
    "policy",
    "requests",
    "errors",
    "hit ratio",
    "imbalance",
    "TTFT mean s",
    "TTFT p50 s",
    "TTFT p99 s",
)


def rendered(console: Console, table: Table) -> str:
    console.print(table)
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def filled() -> Table:
    table = demo_table()
    table.add_row("consistent_hash", "31", "0", "88.8%", "3.00", "0.123", "0.456", "0.789")
    table.add_row("[dim]one unlimited cache[/]", "31", "0", "91.0%", "", "", "", "")
    return table


def test_the_demo_table_keeps_every_column_in_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = rendered(report_console(io.StringIO()), filled())
    assert "…" not in out
    for header in (*HEADERS, "consistent_hash", "one unlimited cache"):
        assert header in out
    assert rendered(Console(file=io.StringIO()), filled()).count("…") > 0  # what rich does alone


def test_columns_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert report_console(io.StringIO()).width == 100
    monkeypatch.delenv("COLUMNS")
    assert report_console(io.StringIO()).width == LOG_WIDTH
