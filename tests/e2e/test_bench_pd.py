"""A tiny `kvgate bench-pd` (issue 42, item 5): 1 prefill + 1 decode simulated engine behind
kvgate's P/D mode, short agent sessions: the table's shape, every request answered, the
transfer measured. (The peers' arms start a Rust or Python router each: the bench itself runs
them, `docs/benchmarks.md`; one arm keeps this test within ~20 s on a loaded machine.)"""

from __future__ import annotations

import pytest

from kvgate_cli import main

pytestmark = pytest.mark.e2e

COLUMNS = [
    "arm",
    "requests",
    "errors",
    "prefill hit ratio",
    "TTFT mean ms",
    "TTFT p99 ms",
    "TPOT p99 ms",
    "decode imbalance",
    "KV MB pulled/request",
]


def test_a_tiny_bench_pd_answers_every_request_and_prints_its_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arms = ["kvgate"]
    trace = "agent-sessions:sessions=3,concurrency=3,start=600,system=300,tool=100,interval=1"
    argv = ["bench-pd", "--trace", trace, "--requests", "12", "--prefill", "1", "--decode", "1"]
    argv += ["--time-scale", "20", "--max-output-tokens", "8"]
    argv += ["--arms", ",".join(arms)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1 prefill + 1 decode" in out and "load average" in out
    table = out[out.index("| arm |") :].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == COLUMNS
    rows = {
        cells[0]: dict(zip(COLUMNS, cells, strict=True))
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])
        if len(cells) == len(COLUMNS)
    }
    assert sorted(rows) == sorted(arms), out
    for arm, row in rows.items():
        assert row["requests"] == "12" and row["errors"] == "0", (arm, out)
        assert float(row["TTFT p99 ms"]) >= float(row["TTFT mean ms"]) > 0
        assert float(row["decode imbalance"]) == 1.0  # one decode instance
        assert float(row["KV MB pulled/request"]) > 0  # the decode instance pulled the prompt
        assert 0 <= float(row["prefill hit ratio"].rstrip("%")) <= 100
    assert "first error" not in out
