"""The tenant registry: salts per scope, one failure path for unknown and revoked keys."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.errors import TenantError
from gateway.request.tenant import SCOPE_USER, TenantPolicy, hash_key
from gateway.settings import load_settings
from gateway.tenancy.registry import TenantRegistry, TenantSpec, derive_salt

SECRET = b"server-secret"


def test_salts_are_hmacs_of_the_server_secret_and_the_scope() -> None:
    registry = TenantRegistry(
        SECRET,
        specs=[TenantSpec("acme", (hash_key("sk-a"),), TenantPolicy(scope=SCOPE_USER))],
    )
    acme = registry.authenticate("sk-a")
    assert acme.salt == derive_salt(SECRET, "tenant:acme")
    alice = registry.for_end_user(acme, "alice")
    assert alice.salt == derive_salt(SECRET, "tenant:acme/user:alice")
    assert alice.cache_salt == alice.salt.hex() and alice.end_user == "alice"
    assert alice.policy is acme.policy and alice.name == "acme"
    salts = {
        acme.salt,
        alice.salt,
        registry.for_end_user(acme, "bob").salt,
        registry.for_end_user(acme, "").salt,
    }
    assert len(salts) == 4
    # another secret: every salt changes (rotation resets all sharing)
    rotated = TenantRegistry(b"rotated", {hash_key("sk-a"): "acme"}).authenticate("sk-a")
    assert rotated.salt != acme.salt


def test_unknown_and_revoked_keys_fail_identically() -> None:
    registry = TenantRegistry(SECRET, {hash_key("sk-fixed"): "fixed"})
    registry.replace_file_tenants([TenantSpec("acme", (hash_key("sk-1"), hash_key("sk-2")))])
    assert registry.authenticate("sk-1").name == "acme"
    registry.replace_file_tenants([TenantSpec("acme", (hash_key("sk-2"),))])  # sk-1 revoked
    errors = []
    for key in ("sk-1", "sk-never"):
        with pytest.raises(TenantError) as info:
            registry.authenticate(key)
        errors.append((info.value.status, info.value.message, info.value.code))
    assert errors[0] == errors[1] == (401, "invalid API key", "invalid_api_key")
    assert registry.authenticate("sk-2").name == "acme"
    assert registry.tenant_names == {"fixed", "acme"}


def test_a_conflicting_reload_leaves_the_registry_as_it_was() -> None:
    registry = TenantRegistry(SECRET, {hash_key("sk-fixed"): "fixed"})
    registry.replace_file_tenants([TenantSpec("acme", (hash_key("sk-1"),))])
    with pytest.raises(ValueError, match="defined both by --tenant and in the tenants file"):
        registry.replace_file_tenants([TenantSpec("fixed", (hash_key("sk-9"),))])
    with pytest.raises(ValueError, match="one key belongs to both tenant 'fixed' and 'evil'"):
        registry.replace_file_tenants([TenantSpec("evil", (hash_key("sk-fixed"),))])
    assert registry.authenticate("sk-1").name == "acme"
    assert registry.authenticate("sk-fixed").name == "fixed"


def test_policies_and_names_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown isolation scope 'org'; choose one of"):
        TenantPolicy(scope="org")
    with pytest.raises(ValueError, match="requests_per_min must be positive"):
        TenantPolicy(requests_per_min=0)
    with pytest.raises(ValidationError, match="tenant name 'a/b' must be"):
        load_settings(tenants=["a/b:sk-1"])
    with pytest.raises(ValueError, match="tenant name"):
        TenantRegistry(SECRET, {hash_key("k"): "has space"})
