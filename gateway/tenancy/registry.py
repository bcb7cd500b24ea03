"""Tenants, their API keys, and the salt that isolates their caches.

A key is kept only as its SHA-256 hex digest (keys are 256-bit random strings, so a fast hash is
enough: there is nothing to brute-force). The salt of a scope is HMAC-SHA256(server secret,
scope), where the scope is `"tenant:" + name`, or `"tenant:" + name + "/user:" + end_user` for a
tenant isolated per end user. Tenant names cannot contain "/", so no two scopes share a string.
The gateway derives the salt, never the client, sends it upstream as `cache_salt` and seeds the
directory's hash chains with it, so two scopes never share a cache entry anywhere. Rotating the
server secret changes every salt, which resets all sharing (every prefix is written again once).

Unknown and revoked keys fail through one code path: a revoked key is simply absent from the
registry, so `authenticate` cannot tell the two apart and neither can the client.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gateway.errors import TenantError
from gateway.request.tenant import DEFAULT_POLICY, Tenant, TenantPolicy, check_tenant_name, hash_key

log = logging.getLogger(__name__)


def derive_salt(secret: bytes, scope: str) -> bytes:
    return hmac.new(secret, scope.encode(), hashlib.sha256).digest()


def tenant_scope(name: str) -> str:
    return "tenant:" + name


def user_scope(name: str, end_user: str) -> str:
    return f"tenant:{name}/user:{end_user}"


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant as a source (a `--tenant` flag, the tenants file) declares it."""

    name: str
    key_hashes: tuple[str, ...]
    policy: TenantPolicy = DEFAULT_POLICY


@dataclass(slots=True)
class _Snapshot:
    by_key_hash: dict[str, Tenant] = field(default_factory=dict)
    names: frozenset[str] = frozenset()


class TenantRegistry:
    """API key hash -> tenant. Unknown and revoked keys fail the same way: they are absent.

    Two sources feed it: the quick-start pairs (`--tenant NAME:KEY`, fixed for the process) and
    the tenants file (`replace_file_tenants`, on every reload). A name may appear in only one
    source, and a key hash may belong to only one tenant. A reload swaps one dict reference, so
    a request sees either the old set of keys or the new one, never a mix.
    """

    def __init__(
        self,
        secret: bytes,
        keys: Mapping[str, str] | None = None,
        specs: Iterable[TenantSpec] = (),
    ) -> None:
        """`keys`: key hash -> tenant name (default policy); `specs`: tenants with policies."""
        self._secret = secret
        by_name: dict[str, list[str]] = {}
        for key_hash, name in (keys or {}).items():
            by_name.setdefault(check_tenant_name(name), []).append(key_hash)
        self._fixed = [TenantSpec(n, tuple(h)) for n, h in by_name.items()] + list(specs)
        self._file: list[TenantSpec] = []
        self._snapshot = self._build(self._fixed, [])

    @classmethod
    def from_pairs(cls, secret: bytes, pairs: Iterable[str]) -> TenantRegistry:
        keys: dict[str, str] = {}
        for pair in pairs:
            name, _, key = pair.partition(":")
            keys[hash_key(key)] = name
        return cls(secret, keys)

    def _build(self, fixed: list[TenantSpec], from_file: list[TenantSpec]) -> _Snapshot:
        fixed_names = {s.name for s in fixed}
        by_key_hash: dict[str, Tenant] = {}
        sources = [(spec, False) for spec in fixed] + [(spec, True) for spec in from_file]
        for spec, in_file in sources:
            if in_file and spec.name in fixed_names:
                raise ValueError(
                    f"tenant {spec.name!r} is defined both by --tenant and in the tenants file; "
                    "keep it in one place"
                )
            tenant = Tenant(
                spec.name, derive_salt(self._secret, tenant_scope(spec.name)), policy=spec.policy
            )
            for key_hash in spec.key_hashes:
                owner = by_key_hash.get(key_hash)
                if owner is not None and owner.name != spec.name:
                    raise ValueError(
                        f"one key belongs to both tenant {owner.name!r} and {spec.name!r}"
                    )
                by_key_hash[key_hash] = tenant
        names = frozenset(fixed_names | {s.name for s in from_file})
        return _Snapshot(by_key_hash, names)

    def replace_file_tenants(self, specs: Iterable[TenantSpec]) -> None:
        """Swap in the tenants file's current content (all of it: what is absent is revoked).
        Raises ValueError, leaving the registry as it was, when it conflicts with `--tenant`."""
        from_file = list(specs)
        snapshot = self._build(self._fixed, from_file)
        self._file = from_file
        self._snapshot = snapshot

    def __len__(self) -> int:
        return len(self._snapshot.by_key_hash)

    @property
    def tenant_names(self) -> frozenset[str]:
        return self._snapshot.names

    def authenticate(self, key: str | None) -> Tenant:
        snapshot = self._snapshot
        if not snapshot.by_key_hash:
            raise TenantError(
                "this gateway has no tenants configured; start it with --tenant NAME:KEY or "
                "--tenants-file PATH (kvgate tenants add)"
            )
        if not key:
            raise TenantError(
                "missing API key: send it as 'Authorization: Bearer KEY'", code="missing_api_key"
            )
        key_hash = hash_key(key)
        tenant = snapshot.by_key_hash.get(key_hash)
        if tenant is None:
            # the hash's first 12 hex digits tell an operator which key a client sends (and
            # match `kvgate tenants list`), never the key
            log.warning("authentication failed: unknown API key sha256:%s", key_hash[:12])
            raise TenantError("invalid API key", code="invalid_api_key")
        return tenant

    def for_end_user(self, tenant: Tenant, end_user: str) -> Tenant:
        """The per-request copy of a `user`-scoped tenant: its salt is the end user's own."""
        salt = derive_salt(self._secret, user_scope(tenant.name, end_user))
        return replace(tenant, salt=salt, cache_salt=salt.hex(), end_user=end_user)


def bearer_key(authorization: str | None) -> str | None:
    """The key from an `Authorization: Bearer KEY` header (None when absent or malformed)."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None
