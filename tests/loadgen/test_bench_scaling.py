"""The bench's replay is compressed in time (`--time-scale`); the gateway's periods that shape
routing between gateways are divided by it so they mean trace seconds (loadgen.bench.peers),
the load-share round excepted."""

from __future__ import annotations

import pytest

from gateway.settings import DEFAULT_LOAD_SHARE_INTERVAL_S, Settings
from loadgen.bench.peers import LOAD_SHARE_INTERVAL_S, scaled_gateway_env


def test_the_bench_knows_the_gateways_load_share_round() -> None:
    assert LOAD_SHARE_INTERVAL_S == DEFAULT_LOAD_SHARE_INTERVAL_S


def test_the_load_share_round_is_the_gateways_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round is not scaled to trace seconds (placements reach the peers in the lookups'
    round trip: `scaled_gateway_env`'s docstring has the numbers); a precise placement's
    speculative ttl is, as its settings read the environment the bench starts it with."""
    monkeypatch.delenv("KVGATE_LOAD_SHARE_INTERVAL_S", raising=False)
    monkeypatch.delenv("KVGATE_SPECULATIVE_TTL_S", raising=False)
    for scale in (1.0, 4.0, 50.0):
        assert "KVGATE_LOAD_SHARE_INTERVAL_S" not in scaled_gateway_env(scale)
    for name, value in scaled_gateway_env(4.0).items():
        monkeypatch.setenv(name, value)
    assert Settings().load_share_interval_s == LOAD_SHARE_INTERVAL_S
    assert Settings().speculative_ttl_s == Settings.model_fields["speculative_ttl_s"].default / 4


def test_a_period_set_in_the_benchs_environment_is_left_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_SPECULATIVE_TTL_S", "2")
    assert scaled_gateway_env(4.0) == {}
