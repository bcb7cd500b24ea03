"""Tenants, their API keys, and the salt that isolates their caches.

A key is kept only as its SHA-256 hex digest. The salt of a scope is
HMAC-SHA256(server secret, "tenant:" + name): the gateway derives it, never the client, and
sends it upstream as `cache_salt` while seeding the directory's hash chains with it, so two
tenants never share a cache entry anywhere. Rotating the server secret changes every salt, which
resets all sharing (every prefix is written again once).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.errors import TenantError


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    salt: bytes
    cache_salt: str = ""
    """The salt as sent to the engine: its hex form (derived once, not per request)."""

    def __post_init__(self) -> None:
        if not self.cache_salt:
            object.__setattr__(self, "cache_salt", self.salt.hex())


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def derive_salt(secret: bytes, scope: str) -> bytes:
    return hmac.new(secret, scope.encode(), hashlib.sha256).digest()


class TenantRegistry:
    """API key hash -> tenant. Unknown and revoked keys fail the same way: they are absent."""

    def __init__(self, secret: bytes, keys: dict[str, str]) -> None:
        """`keys`: key hash -> tenant name."""
        self._secret = secret
        self._by_key_hash = {
            key_hash: Tenant(name, derive_salt(secret, "tenant:" + name))
            for key_hash, name in keys.items()
        }

    @classmethod
    def from_pairs(cls, secret: bytes, pairs: Iterable[str]) -> TenantRegistry:
        keys: dict[str, str] = {}
        for pair in pairs:
            name, _, key = pair.partition(":")
            keys[hash_key(key)] = name
        return cls(secret, keys)

    def __len__(self) -> int:
        return len(self._by_key_hash)

    def authenticate(self, key: str | None) -> Tenant:
        if not self._by_key_hash:
            raise TenantError(
                "this gateway has no tenants configured; start it with --tenant NAME:KEY"
            )
        if not key:
            raise TenantError(
                "missing API key: send it as 'Authorization: Bearer KEY'", code="missing_api_key"
            )
        tenant = self._by_key_hash.get(hash_key(key))
        if tenant is None:
            raise TenantError("invalid API key", code="invalid_api_key")
        return tenant


def bearer_key(authorization: str | None) -> str | None:
    """The key from an `Authorization: Bearer KEY` header (None when absent or malformed)."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None
