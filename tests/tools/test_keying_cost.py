"""`kvgate bench-keying` (`tools.keying_cost`) at a tiny size: every workload keyed both ways,
one row each, and the long message's continuations spliced onto the text-prefix cache."""

from __future__ import annotations

import argparse
import asyncio

from tools.keying_cost import add_bench_keying_arguments, bench


def test_bench_keying_measures_every_workload_both_ways() -> None:
    parser = argparse.ArgumentParser()
    add_bench_keying_arguments(parser)
    args = parser.parse_args(
        ["--conversations", "2", "--turns", "2", "--long", "2", "--mooncake", "2", "--novel", "1"]
    )
    lines: list[str] = []
    arms = asyncio.run(bench(args, lines.append))
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5, lines
    for arm in arms.values():
        assert len(arm.approximate) == len(arm.precise) == len(arm.tokens) > 0
    long = arms["long"].keys.tokens.stats
    assert long.text_prefix_hits == 2  # each continuation of the long message
    assert "load average before" in lines[0] and "load average after" in lines[-1]
