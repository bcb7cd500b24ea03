"""A small `kvgate bench`: every arm on fresh engines, one table, peers when installed."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from kvgate_cli import main
from loadgen.bench.peers import Arm, parse_arms, peer_missing, prioritise
from loadgen.harness.redis_servers import redis_server
from loadgen.traces import CONVERSATION_TRACE
from router.registry import POLICIES

pytestmark = pytest.mark.e2e


def test_arms_are_parsed_and_unknown_ones_named() -> None:
    assert [a.name for a in parse_arms("kvgate:cache_aware, client:round_robin")] == [
        "kvgate:cache_aware",
        "client:round_robin",
    ]
    everything = {a.name for a in parse_arms("all")}
    assert {f"kvgate:{p}" for p in POLICIES} <= everything
    assert {"sglang:cache_aware", "vllm:cache_aware", "vllm:round_robin"} <= everything
    with pytest.raises(ValueError, match="unknown arm 'haproxy:roundrobin'; choose from"):
        parse_arms("haproxy:roundrobin")
    assert peer_missing(Arm("kvgate", "cache_aware")) is None
    pair = parse_arms("workers1:cache_aware,workers2:cache_aware")  # --workers 1 vs 2 on Redis
    assert [a.kind for a in pair] == ["workers1", "workers2"]
    assert parse_arms("precise2:cache_pressure") == [Arm("precise2", "cache_pressure")]
    assert parse_arms("noflow:cache_aware") == [Arm("noflow", "cache_aware")]  # flow control off
    assert parse_arms("kvgate:cache_aware,kvgate:cache_aware@2") == [
        Arm("kvgate", "cache_aware"),
        Arm("kvgate", "cache_aware", 2),
    ]
    assert [a.name for a in parse_arms("kvgate:cache_aware,client:round_robin", 3)] == [
        "kvgate:cache_aware@3",
        "client:round_robin",
    ]
    with pytest.raises(ValueError, match="only kvgate, noflow, precise arms take @N"):
        parse_arms("vllm:cache_aware@2")
    # issue 39: precise gateways on one Redis, and any many-gateway arm on a 3-master Cluster
    assert parse_arms("precise:cache_aware@2,kvgate:cache_aware@2c,precise:cache_aware@4c") == [
        Arm("precise", "cache_aware", 2),
        Arm("kvgate", "cache_aware", 2, cluster=True),
        Arm("precise", "cache_aware", 4, cluster=True),
    ]
    assert [a.name for a in parse_arms("kvgate:cache_aware@2c,kvgate:cache_aware@1c")] == [
        "kvgate:cache_aware@2c",
        "kvgate:cache_aware@1c",  # one gateway, but on the Cluster (not in-process)
    ]
    assert [a.name for a in parse_arms("precise:cache_aware", 2)] == ["precise:cache_aware@2"]
    for bad in ("kvgate:cache_aware@c", "kvgate:cache_aware@2x", "kvgate:cache_aware@0c"):
        with pytest.raises(ValueError, match="take @N or @Nc"):
            parse_arms(bad)
    with pytest.raises(ValueError, match="--gateways must be at least 1"):
        parse_arms("kvgate:cache_aware", 0)
    # a hog beside an arm: what another arm's extra CPU costs this one (issue 39's TTFT goal)
    assert parse_arms("kvgate:cache_aware~12,kvgate:cache_aware@4c~5") == [
        Arm("kvgate", "cache_aware", hog_percent=12),
        Arm("kvgate", "cache_aware", 4, cluster=True, hog_percent=5),
    ]
    assert parse_arms("sglang:cache_aware~30")[0].name == "sglang:cache_aware~30"
    for bad in ("kvgate:cache_aware~0", "kvgate:cache_aware~101", "kvgate:cache_aware~x"):
        with pytest.raises(ValueError, match="~P takes a whole percent of one core"):
            parse_arms(bad)


def test_a_small_bench_runs_every_arm_and_writes_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.md"
    arms = (
        "kvgate:cache_aware,epp:cache_aware,epp-headers:cache_aware,sglang:cache_aware,"
        "vllm:cache_aware,client:round_robin"
    )
    argv = [
        "bench",
        "--trace",
        str(CONVERSATION_TRACE),
        "--start",
        "4000",
        "--requests",
        "40",
        "--engines",
        "2",
        "--arms",
        arms,
        "--time-scale",
        "50",
        "--rate-steps",
        "0",  # the max-rate ramp has its own test below
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "kvgate bench --trace" in printed  # the command line is printed with the results
    table = out.read_text()
    payload = orjson.loads(out.with_suffix(".json").read_bytes())
    rows = {r["arm"]: r for r in payload["results"]}
    assert list(rows) == arms.split(",")
    for name, row in rows.items():
        missing = peer_missing(Arm(*name.split(":")))
        if missing:  # the peers are an optional extra: said plainly, the rest still ran
            assert row["summary"] is None and "pip install -e '.[bench]'" in row["note"]
            continue
        assert row["summary"] is not None, f"{name} did not run: {row['note']}"
        assert row["summary"]["requests"] == 40 and row["summary"]["errors"] == 0, row["note"]
        assert f"| {name} | 1 | 40 | 0 |" in table
        # the engines' own counters: the busiest of the two did at least the mean, at most all
        assert 1.0 <= row["imbalance"] <= 2.0, row
        assert f"| {row['imbalance']:.2f} |" in table
        if name != "client:round_robin":
            assert row["router_cpu_ms_per_request"] > 0
            assert row["hop_ms"] is not None
        if name.startswith("epp"):  # Envoy carried the bytes, kvgate picked
            assert row["envoy_cpu_ms_per_request"] > 0
            assert row["decisions"], row
            assert row["summary"]["hit_ratio"] > 0
    assert payload["lru_reference_hit_ratio"] > 0
    assert 0 <= payload["background_busy_share"] <= 1
    assert all(row["rate"] is None for row in rows.values())


def test_every_arm_reports_its_max_rate_in_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Router CPU ms/request and max sustainable requests/s side by side: two short steps per
    arm against instant stand-ins, low enough (and a p99 bound loose enough) that every router
    holds them on a loaded machine. (One Rust peer: sglang-router's and vllm-router's arms
    share the ramp's code; the small bench above starts each.)"""
    out = tmp_path / "bench.md"
    arms = "kvgate:cache_aware,sglang:cache_aware,client:round_robin"
    argv = ["bench", "--start", "4000", "--requests", "10", "--engines", "2"]
    argv += ["--time-scale", "50", "--arms", arms, "--out", str(out)]
    argv += ["--rate-steps", "2", "--rate-start", "8", "--rate-step-s", "0.5"]
    argv += ["--rate-p99-ttft-ms", "3000"]  # the plumbing, not this shared machine's hiccups
    assert main(argv) == 0
    capsys.readouterr()
    table = out.read_text()
    assert "max req/s: open-loop steps from 8/s × 1.5" in table
    rows = {r["arm"]: r for r in orjson.loads(out.with_suffix(".json").read_bytes())["results"]}
    for name, row in rows.items():
        if peer_missing(Arm(*name.split(":"))):
            assert row["rate"] is None
            continue
        rate = row["rate"]
        assert [s["offered_rps"] for s in rate["steps"]] == [8.0, 12.0], name
        assert rate["max_sustained_rps"] == 12.0 and rate["reached_last_step"], rate
        assert all(s["errors"] == 0 and s["ok"] == s["sent"] for s in rate["steps"]), rate
        assert f"{name} (run 1) rate steps: 8/s ✓" in table
        (line,) = [line for line in table.splitlines() if line.startswith(f"| {name} | 1 | 10 ")]
        assert line.endswith("| ≥ 12 |"), line
        if name.startswith("kvgate"):  # CPU is counted in 10-ms ticks: over the steps (a
            # Rust peer's ten requests can fit in less than one: 0 in a quiet run, with the
            # peers installed by `.[bench]`)
            assert sum(s["router_cpu_ms_per_request"] for s in rate["steps"]) > 0, rate


def test_bad_bench_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--arms", "kvgate:fastest"]) == 2
    assert "unknown arm" in capsys.readouterr().out
    assert main(["bench", "--utilization", "1.5"]) == 2
    assert "--utilization must be between 0 and 1" in capsys.readouterr().out
    assert main(["bench", "--arms", "kvgate:cache_aware@2", "--restart-gateway-at", "1.5"]) == 2
    assert "--restart-gateway-at must be between 0 and 1" in capsys.readouterr().out
    assert main(["bench", "--arms", "kvgate:cache_aware", "--restart-gateway-at", "0.5"]) == 2
    assert "needs an arm of two gateways or more" in capsys.readouterr().out
    argv = ["bench", "--arms", "kvgate:cache_aware@2", "--restart-window-s", "0"]
    assert main(argv) == 2
    assert "--restart-window-s must be positive" in capsys.readouterr().out


def test_the_shared_arms_redis_server_runs_at_the_niceness_asked() -> None:
    """`--redis-nice`: the shared arms' redis-server at the niceness asked (`REDIS_NICE`); 0
    leaves it as any other process. (A positive niceness: allowed without privileges, so this
    holds on any machine.)"""
    with redis_server(port=0) as redis:
        assert redis.proc is not None
        before = os.getpriority(os.PRIO_PROCESS, redis.proc.pid)
        prioritise(redis, 0)
        assert os.getpriority(os.PRIO_PROCESS, redis.proc.pid) == before
        prioritise(redis, before + 3)
        assert os.getpriority(os.PRIO_PROCESS, redis.proc.pid) == before + 3
