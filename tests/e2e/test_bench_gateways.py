"""`kvgate bench`'s many-gateway arms (`@N`, `@Nc`, `precise2`) and a gateway restarted
mid-run: N gateways on one Redis (or a Cluster) of the arm's own, requests spread round robin.
(Apart from test_bench.py so the suite's two workers run the two halves side by side.)"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvgate_cli import main
from loadgen.traces import CONVERSATION_TRACE

pytestmark = pytest.mark.e2e


@pytest.mark.redis
def test_a_precise2_arm_routes_through_two_gateways_sharing_the_event_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two precise gateways over one redis-server of the arm's own, requests alternating: no
    errors, both gateways' CPU counted, and the engines' cache hit (the conversations' later
    turns find their prefixes wherever the other gateway placed the earlier ones)."""
    out = tmp_path / "bench.md"
    argv = ["bench", "--trace", str(CONVERSATION_TRACE), "--start", "4000", "--requests", "30"]
    argv += ["--engines", "2", "--arms", "precise2:cache_pressure", "--time-scale", "50"]
    argv += ["--rate-steps", "0", "--redis-nice", "5", "--out", str(out)]
    assert main(argv) == 0
    assert "redis-server at nice 5" in capsys.readouterr().out
    (row,) = orjson.loads(out.with_suffix(".json").read_bytes())["results"]
    assert row["summary"] is not None, row["note"]
    assert row["summary"]["requests"] == 30 and row["summary"]["errors"] == 0, row["note"]
    assert row["router_cpu_ms_per_request"] > 0
    assert row["summary"]["hit_ratio"] > 0
    assert 0 < sum(row["decisions"].values()) < 30  # one gateway's decisions: not all of them


@pytest.mark.redis
def test_a_many_gateway_arm_spreads_the_replay_over_gateways_on_one_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: `kvgate:<policy>@2` (or `--gateways 2`) runs two gateways over one
    redis-server of the arm's own, requests round robin: no errors, the tier's CPU counted,
    and both gateways' directory lookups reported (how many Redis answered)."""
    out = tmp_path / "bench.md"
    argv = ["bench", "--trace", str(CONVERSATION_TRACE), "--start", "4000", "--requests", "30"]
    argv += ["--engines", "2", "--arms", "kvgate:cache_aware", "--gateways", "2"]
    argv += ["--time-scale", "50", "--rate-steps", "0", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "kvgate:cache_aware@2 (run 1) directory lookups: 30, answered by Redis" in printed
    (row,) = orjson.loads(out.with_suffix(".json").read_bytes())["results"]
    assert row["arm"] == "kvgate:cache_aware@2"
    recorded = row["directory"]["record_written"] + row["directory"].get("record_kept", 0)
    assert recorded > 0 and f"record blocks {recorded:,}, written" in printed
    assert row["summary"]["requests"] == 30 and row["summary"]["errors"] == 0, row["note"]
    assert row["router_cpu_ms_per_request"] > 0
    directory = row["directory"]
    assert directory["shared"] + directory["local"] == 30  # both gateways' lookups
    assert directory["shared"] > 0
    assert 0 < sum(row["decisions"].values()) < 30  # one gateway's decisions: not all of them


@pytest.mark.redis
def test_a_many_gateway_arm_runs_on_a_three_master_redis_cluster(tmp_path: Path) -> None:
    """Issue 39: `kvgate:<policy>@2c` runs two gateways over a 3-master Redis Cluster of the
    arm's own: no errors, every lookup counted (the Cluster answered some), the tier's CPU
    (gateways and the three nodes) counted."""
    out = tmp_path / "bench.md"
    argv = ["bench", "--trace", str(CONVERSATION_TRACE), "--start", "4000", "--requests", "30"]
    argv += ["--engines", "2", "--arms", "kvgate:cache_aware@2c", "--time-scale", "50"]
    argv += ["--rate-steps", "0", "--out", str(out)]
    assert main(argv) == 0
    (row,) = orjson.loads(out.with_suffix(".json").read_bytes())["results"]
    assert row["arm"] == "kvgate:cache_aware@2c"
    assert row["summary"]["requests"] == 30 and row["summary"]["errors"] == 0, row["note"]
    assert row["router_cpu_ms_per_request"] > 0
    assert row["directory"]["shared"] + row["directory"]["local"] == 30
    assert row["directory"]["shared"] > 0
    assert "kvgate:cache_aware@2c (run 1) directory lookups: 30, answered by Redis" in (
        out.read_text()
    )
    # the machine is shared: the load average around the arm is in the row and the table
    before, after = row["load_average"]
    assert before >= 0 and after >= 0
    assert f"kvgate:cache_aware@2c (run 1) {before:.1f} → {after:.1f}" in out.read_text()


@pytest.mark.redis
def test_precise_gateways_on_one_redis_replay_the_agent_sessions(tmp_path: Path) -> None:
    """Issue 39: `precise:<policy>@2` runs two precise gateways sharing the event index in a
    redis-server of the arm's own, here on the agent-session workload: no errors, the engines'
    cache hit, and both gateways' lookups of the shared event index reported."""
    out = tmp_path / "bench.md"
    argv = ["bench", "--trace", "agent-sessions:sessions=4,concurrency=4,steps=6,interval=2"]
    argv += ["--start", "0", "--requests", "24", "--engines", "2", "--time-scale", "10"]
    argv += ["--arms", "precise:cache_aware@2", "--rate-steps", "0", "--out", str(out)]
    assert main(argv) == 0
    (row,) = orjson.loads(out.with_suffix(".json").read_bytes())["results"]
    assert row["arm"] == "precise:cache_aware@2"
    assert row["summary"]["requests"] == 24 and row["summary"]["errors"] == 0, row["note"]
    assert row["summary"]["hit_ratio"] > 0
    assert row["router_cpu_ms_per_request"] > 0
    events = row["directory"]["events_ok"] + row["directory"]["events_failed"]
    assert events == 24  # both gateways' lookups of the shared event index
    assert "shared event-index lookups 24, answered" in out.read_text()


@pytest.mark.redis
def test_a_gateway_restarted_mid_run_rejoins_and_its_window_is_reported(
    tmp_path: Path,
) -> None:
    """Issue 39: `--restart-gateway-at` takes the last of two gateways out of rotation, stops
    it once its requests are done, restarts it on the same ports and puts it back: no request
    fails, the restarted gateway serves again, and the hit ratio of the window after the
    restart is reported against the run's and, the same window's baseline, the restarted
    gateway's against the other's."""
    out = tmp_path / "bench.md"
    argv = ["bench", "--trace", str(CONVERSATION_TRACE), "--start", "4000", "--requests", "40"]
    argv += ["--engines", "2", "--arms", "kvgate:cache_aware@2", "--time-scale", "0.5"]
    argv += ["--prefill-tokens-per-s", "400000", "--max-output-tokens", "8"]
    argv += ["--restart-gateway-at", "0.1", "--restart-window-s", "10"]
    argv += ["--rate-steps", "0", "--out", str(out)]
    assert main(argv) == 0
    (row,) = orjson.loads(out.with_suffix(".json").read_bytes())["results"]
    assert row["summary"]["requests"] == 40 and row["summary"]["errors"] == 0, row["note"]
    restart = row["restart"]
    assert 0 < restart["down_trace_s"] <= restart["stopped_trace_s"] < restart["up_trace_s"]
    assert restart["window_trace_s"] == 10
    assert restart["window_requests"] > 0 and restart["window_errors"] == 0, restart
    assert restart["restarted_requests"] > 0  # back in rotation, serving
    assert restart["points"] == pytest.approx(
        (restart["window_hit_ratio"] - restart["run_hit_ratio"]) * 100
    )
    assert restart["run_hit_ratio"] == pytest.approx(row["summary"]["hit_ratio"])
    # the same window's baseline: the other gateway's requests in it, which had no restart
    assert restart["others_requests"] + restart["restarted_requests"] == restart["window_requests"]
    assert restart["restarted_points"] == pytest.approx(
        (restart["restarted_hit_ratio"] - restart["others_hit_ratio"]) * 100
    )
    # the restarted gateway's lookups before and after count: every request looked up once
    assert row["directory"]["shared"] + row["directory"]["local"] == 40
    assert "kvgate:cache_aware@2 (run 1) restart: the last gateway out of rotation" in (
        out.read_text()
    )
