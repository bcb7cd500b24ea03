"""Billing's settings: profiles by name, clear errors, keys never kept in clear, one function
that decides a tenant's profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.billing.pending import profile_for
from gateway.billing.pricing.prices import PROFILES
from gateway.billing.service import admin_key_hashes
from gateway.request.tenant import Tenant, TenantPolicy, hash_key
from gateway.settings import BILLING_PROFILES, load_settings


def test_the_settings_list_of_profiles_is_the_engines() -> None:
    assert BILLING_PROFILES == PROFILES


def test_profile_for_reads_the_tenant_then_the_map_then_the_default() -> None:
    settings = load_settings(billing_profiles={"acme": "anthropic"}, billing_profile="deepseek")

    def tenant(name: str, own: str | None = None) -> Tenant:
        return Tenant(name, b"salt", policy=TenantPolicy(billing_profile=own))

    assert profile_for(settings, tenant("acme")) == "anthropic"
    assert profile_for(settings, tenant("globex")) == "deepseek"
    assert profile_for(settings, tenant("acme", own="google_implicit")) == "google_implicit"
    assert profile_for(load_settings(), tenant("anyone")) == "openai"


def test_unknown_profiles_and_units_name_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="unknown billing profile 'aws'; choose one of"):
        load_settings(billing_profile="aws")
    with pytest.raises(ValidationError, match="tenant 'acme': unknown billing profile"):
        load_settings(billing_profiles={"acme": "azure"})
    with pytest.raises(ValidationError, match="'64' or 'request_boundaries'"):
        load_settings(billing_deepseek_unit="32")
    config = tmp_path / "kvgate.yaml"
    config.write_text(
        "billing_wal_dir: /var/lib/kvgate/wal\nbilling_deepseek_holidays: [2026-10-01]\n"
    )
    settings = load_settings(config)
    assert settings.billing_wal_dir == Path("/var/lib/kvgate/wal")
    assert str(settings.billing_deepseek_holidays[0]) == "2026-10-01"


def test_admin_keys_are_hashed_on_load() -> None:
    hashes = admin_key_hashes(["sk-admin", "sha256:" + "ab" * 32])
    assert hashes == {hash_key("sk-admin"), "ab" * 32}
    assert "sk-admin" not in hashes
