"""`kvgate bench-report`: docs/benchmarks.md's headline table is the JSON's rows, and a drift
between the two fails (so a figure is updated in one place)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadgen.bench.report import DOC, FIGURES, load_rows, render, run_bench_report


def args(tmp_path: Path, check: bool) -> argparse.Namespace:
    return argparse.Namespace(check=check, figures=tmp_path / "rows.json", doc=tmp_path / "doc.md")


def test_the_committed_table_is_the_committed_rows() -> None:
    doc = DOC.read_text()
    assert render(doc, load_rows(FIGURES)) == doc, "run `kvgate bench-report`"
    assert doc.index("| figure |") < doc.index("## How to read them")


def test_a_changed_row_is_drift_until_the_report_rewrites_the_table(tmp_path: Path) -> None:
    rows = load_rows(FIGURES)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "doc.md").write_text(DOC.read_text())
    assert run_bench_report(args(tmp_path, check=True)) == 0
    rows[0]["value"] = "0.999"
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert run_bench_report(args(tmp_path, check=True)) == 1
    assert run_bench_report(args(tmp_path, check=False)) == 0
    assert "**0.999**" in (tmp_path / "doc.md").read_text()
    assert run_bench_report(args(tmp_path, check=True)) == 0


def test_a_row_without_its_command_is_refused(tmp_path: Path) -> None:
    row = dict(load_rows(FIGURES)[0])
    del row["command"]
    (tmp_path / "rows.json").write_text(json.dumps([row]))
    with pytest.raises(ValueError, match="missing \\['command'\\]"):
        load_rows(tmp_path / "rows.json")
