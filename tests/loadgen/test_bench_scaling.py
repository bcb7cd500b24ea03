"""The bench's replay is compressed in time (`--time-scale`); the gateway's periods that shape
routing between gateways are divided by it so they mean trace seconds (loadgen.bench.peers)."""

from __future__ import annotations

import pytest

from gateway.settings import DEFAULT_LOAD_SHARE_INTERVAL_S, Settings
from loadgen.bench.peers import LOAD_SHARE_INTERVAL_S, scaled_gateway_env


def test_the_bench_knows_the_gateways_load_share_round() -> None:
    assert LOAD_SHARE_INTERVAL_S == DEFAULT_LOAD_SHARE_INTERVAL_S


def test_the_load_share_round_means_trace_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """At time scale 4 a gateway's round is a quarter of its default, as its settings read
    the environment the bench starts it with."""
    monkeypatch.delenv("KVGATE_LOAD_SHARE_INTERVAL_S", raising=False)
    monkeypatch.delenv("KVGATE_SPECULATIVE_TTL_S", raising=False)
    assert scaled_gateway_env(1.0)["KVGATE_LOAD_SHARE_INTERVAL_S"] == "0.1"
    assert scaled_gateway_env(50.0)["KVGATE_LOAD_SHARE_INTERVAL_S"] == "0.01"  # the floor
    for name, value in scaled_gateway_env(4.0).items():
        monkeypatch.setenv(name, value)
    assert Settings().load_share_interval_s == 0.025
    assert Settings().speculative_ttl_s == Settings.model_fields["speculative_ttl_s"].default / 4


def test_a_round_set_in_the_benchs_environment_is_left_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_LOAD_SHARE_INTERVAL_S", "0.1")
    monkeypatch.setenv("KVGATE_SPECULATIVE_TTL_S", "2")
    assert scaled_gateway_env(4.0) == {}
