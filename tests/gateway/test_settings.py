"""Settings: flags over environment over the YAML file over defaults; clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.errors import TenantError
from gateway.settings import DEFAULT_PORT, load_settings
from gateway.tenancy.registry import TenantRegistry, bearer_key, derive_salt


def test_precedence_flags_env_file_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text(
        "port: 9001\npolicy: round_robin\nengines: ['http://a:1']\nblock_bytes: 128\n"
    )
    monkeypatch.setenv("KVGATE_POLICY", "least_load")
    monkeypatch.setenv("KVGATE_ENGINES", '["http://b:2/"]')
    settings = load_settings(config, port=9002)
    assert settings.port == 9002  # flag
    assert settings.policy == "least_load"  # env beats the file
    assert settings.engines == ["http://b:2"]  # env, trailing slash dropped
    assert settings.block_bytes == 128  # file
    assert load_settings().port == DEFAULT_PORT


def test_bad_settings_name_the_problem() -> None:
    with pytest.raises(
        ValidationError, match="unknown policy 'fastest'; choose one of cache_aware"
    ):
        load_settings(policy="fastest")
    with pytest.raises(ValidationError, match="must start with http"):
        load_settings(engines=["localhost:8000"])
    with pytest.raises(ValidationError, match="NAME:KEY"):
        load_settings(tenants=["nokey"])


def test_keys_are_kept_hashed_and_salts_are_per_tenant() -> None:
    registry = TenantRegistry.from_pairs(b"secret", ["acme:sk-1", "globex:sk-2"])
    assert "sk-1" not in repr(registry.__dict__)
    acme = registry.authenticate("sk-1")
    assert acme.name == "acme" and acme.salt == derive_salt(b"secret", "tenant:acme")
    assert registry.authenticate("sk-2").salt != acme.salt
    assert (
        TenantRegistry.from_pairs(b"rotated", ["acme:sk-1"]).authenticate("sk-1").salt != acme.salt
    )
    with pytest.raises(TenantError, match="invalid API key"):
        registry.authenticate("sk-3")
    with pytest.raises(TenantError, match="no tenants configured"):
        TenantRegistry.from_pairs(b"s", []).authenticate("sk-1")
    assert bearer_key("Bearer abc") == "abc"
    assert bearer_key("Basic abc") is None
    assert bearer_key(None) is None


def test_precise_settings_are_checked(tmp_path: Path) -> None:
    from gateway.settings import describe_errors

    for bad, complaint in (
        ({"tokenizer_dir": tmp_path}, "has no tokenizer.json or tokenizer_config.json"),
        ({"engine_block_size": 0}, "engine_block_size: Value error, must be at least 1"),
        ({"offload_cost": 1.5}, "offload_cost: Value error, must be a ratio"),
        ({"speculative_ttl_s": 0}, "speculative_ttl_s: Value error, must be a positive"),
    ):
        with pytest.raises(ValidationError) as caught:
            load_settings(**bad)
        assert complaint in describe_errors(caught.value)


def test_a_worker_gets_its_own_wal_directory(tmp_path: Path) -> None:
    from gateway.server.workers import worker_settings

    pod = load_settings(
        workers=2, redis_url="redis://r:6379", metrics_port=9090, billing_wal_dir=tmp_path
    )
    worker = worker_settings(pod.model_copy(update={"worker_index": 1}))
    assert worker.billing_wal_dir == tmp_path / "worker-1"


def test_workers_need_a_shared_directory() -> None:
    with pytest.raises(ValidationError, match="workers: 3 needs redis_url"):
        load_settings(workers=3)
    assert load_settings(workers=3, redis_url="unix:///run/redis.sock").workers == 3


def test_a_decode_pool_needs_standalone_mode_and_its_own_engines() -> None:
    pd = load_settings(engines=["http://p:1"], decode_engines=["http://d:1"])
    assert pd.decode_engines == ["http://d:1"]
    with pytest.raises(ValidationError, match="decode_engines needs mode: standalone"):
        load_settings(engines=["http://p:1"], decode_engines=["http://d:1"], mode="epp")
    with pytest.raises(ValidationError, match=r"engines \(prefill\) and decode_engines at once"):
        load_settings(engines=["http://p:1"], decode_engines=["http://p:1"])


def test_flow_lower_band_room_share_is_a_share_of_the_room_bound() -> None:
    from gateway.settings import describe_errors

    assert load_settings().flow_lower_band_room_share == 0.5
    assert load_settings(flow_lower_band_room_share=1).flow_lower_band_room_share == 1.0
    for bad in (0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValidationError) as caught:
            load_settings(flow_lower_band_room_share=bad)
        assert (
            "flow_lower_band_room_share: Value error, must be above 0 and at most 1"
            in describe_errors(caught.value)
        )
