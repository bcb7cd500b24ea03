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
