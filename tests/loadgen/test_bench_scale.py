"""`kvgate bench-scale` at the suite's size: one redis-server, a few requests, a row whose
figures come from Redis's own CPU counters."""

from __future__ import annotations

import argparse
import re

import pytest

from loadgen.bench.scale import add_bench_scale_arguments, run_bench_scale

pytestmark = pytest.mark.redis


def test_the_scale_bench_prints_redis_cpu_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_bench_scale_arguments(parser)
    args = parser.parse_args(
        ["--requests", "40", "--blocks", "8", "--conversations", "4", "--skip-cluster"]
    )
    assert run_bench_scale(args) == 0
    out = capsys.readouterr().out
    row = re.search(r"^one redis-server +8 +(\d+) +(\d+) +(\d+) +\d+$", out, re.MULTILINE)
    assert row is not None, out
    cpu_us, ceiling, knee = (int(g) for g in row.groups())
    assert cpu_us > 0 and knee < ceiling
    with pytest.raises(SystemExit, match="at least 1"):
        run_bench_scale(parser.parse_args(["--requests", "0"]))


def test_the_scale_bench_counts_redis_commands_per_request_of_a_mostly_new_mix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--new-blocks`: each request's last blocks are its own (placed and recorded for the first
    time), and the row says what Redis ran per request, the scripts' own commands counted."""
    parser = argparse.ArgumentParser()
    add_bench_scale_arguments(parser)
    args = parser.parse_args(
        [
            *("--requests", "20", "--blocks", "8", "--conversations", "4"),
            "--new-blocks",
            "6",
            "--skip-cluster",
        ]
    )
    assert run_bench_scale(args) == 0
    out = capsys.readouterr().out
    line = re.search(r"^  commands per request: (\d+) inside the scripts \((.*)\)$", out, re.M)
    assert line is not None, out
    calls = dict(item.rsplit(" ", 1) for item in line.group(2).split(", "))
    assert float(calls["EVALSHA"]) >= 3  # lookup, record, placement (the home's may be one)
    assert float(calls["HSET"]) >= 6  # at least the 6 new blocks' entries
