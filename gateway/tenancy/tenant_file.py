"""The tenants file: tenants, their policies and their keys' hashes, edited by `kvgate tenants`
and watched by the gateway, which reloads it when it changes.

Format (YAML; a file named *.json is read and written as JSON, same structure)::

    version: 1
    tenants:
      acme:
        scope: tenant              # or "user": each end user gets its own cache salt
        billing_profile: anthropic
        models: [kvgate-sim-8b]    # absent or empty: every model the fleet serves
        requests_per_min: 600      # absent: no limit
        tokens_per_min: 2000000
        max_prompt_tokens: 100000
        max_inflight: 64           # absent: the gateway's tenant_max_inflight
        trusted_tracing: false     # true: its traceparent's sampled flag decides tracing
        weight: 2                  # its share of a saturated fleet (docs/flow-control.md)
        priority: 0                # its band (lower first); a request may ask within
        priority_range: [0, 2]     #   this range with `priority` (absent: only `priority`)
        route_receipts: false      # true: answers carry x-kvgate-route (why this replica)
        keys:
          - sha256: 9f86d081884c7d65...   # SHA-256 hex of the key; the key itself is never kept
            created: "2026-11-30T10:00:00Z"
            label: ci

Invariants: a key appears only as its hash; a hash belongs to one tenant; writes are atomic
(a temporary file renamed over the old one, under an exclusive lock on the directory), so a
reader sees the old file or the new one, never half of one.

Reloading: the watcher polls `os.stat` through the path, which follows symlinks. A Kubernetes
Secret mounted as a volume updates by swapping the `..data` symlink to a new directory; the
path then resolves to a new inode, so a changed (device, inode, mtime, size, resolved path)
triggers a reload. A file that fails to parse is logged and ignored: the last good content
stays in force (a typo must not lock every tenant out).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.request.tenant import (
    BILLING_PROFILES,
    MAX_PRIORITY,
    MAX_WEIGHT,
    TenantPolicy,
    check_tenant_name,
    hash_key,
)
from gateway.tasks import BackgroundTasks
from gateway.tenancy.registry import TenantRegistry, TenantSpec

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-kvg-"
KEY_RANDOM_BYTES = 32
"""256 random bits per key: a plain SHA-256 of it cannot be brute-forced, no KDF needed."""
KEY_ID_CHARS = 12
"""A key's public id is the first 12 hex characters of its hash (48 bits: unique in practice,
and no help to anyone guessing a 256-bit key)."""
MIN_KEY_ID_CHARS = 6
"""`revoke` accepts an id prefix this long or longer, if it names exactly one key."""
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

PositiveInt = Annotated[int, Field(gt=0, strict=True)]


class TenantFileError(Exception):
    """The tenants file is missing, unreadable or invalid; the message says where and why."""


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str
    created: str | None = None
    label: str | None = None

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        if not _SHA256_HEX.fullmatch(value):
            raise ValueError("must be the 64-character lowercase SHA-256 hex digest of the key")
        return value

    @property
    def id(self) -> str:
        return self.sha256[:KEY_ID_CHARS]


class TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: Literal["tenant", "user"] = "tenant"
    billing_profile: str | None = None
    models: list[str] = Field(default_factory=list)
    requests_per_min: PositiveInt | None = None
    tokens_per_min: PositiveInt | None = None
    max_prompt_tokens: PositiveInt | None = None
    max_inflight: PositiveInt | None = None
    trusted_tracing: bool = False
    weight: Annotated[float, Field(gt=0, le=MAX_WEIGHT)] = 1.0
    priority: Annotated[int, Field(strict=True, ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    priority_range: tuple[int, int] | None = None
    route_receipts: bool = False
    keys: list[KeyEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _priority_in_range(self) -> TenantEntry:
        if self.priority_range is not None:
            low, high = self.priority_range
            if not -MAX_PRIORITY <= low <= high <= MAX_PRIORITY:
                raise ValueError(
                    f"priority_range must be [low, high] with {-MAX_PRIORITY} <= low <= high "
                    f"<= {MAX_PRIORITY}, got [{low}, {high}]"
                )
            if not low <= self.priority <= high:
                raise ValueError(
                    f"priority {self.priority} is outside priority_range [{low}, {high}]"
                )
        return self

    @field_validator("billing_profile")
    @classmethod
    def _known_profile(cls, value: str | None) -> str | None:
        if value is not None and value not in BILLING_PROFILES:
            raise ValueError(
                f"unknown billing profile {value!r}; choose one of {', '.join(BILLING_PROFILES)}"
            )
        return value

    def policy(self) -> TenantPolicy:
        return TenantPolicy(
            scope=self.scope,
            billing_profile=self.billing_profile,
            models=frozenset(self.models),
            requests_per_min=self.requests_per_min,
            tokens_per_min=self.tokens_per_min,
            max_prompt_tokens=self.max_prompt_tokens,
            max_inflight=self.max_inflight,
            trusted_tracing=self.trusted_tracing,
            weight=self.weight,
            priority=self.priority,
            priority_range=self.priority_range,
            route_receipts=self.route_receipts,
        )


class TenantFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    tenants: dict[str, TenantEntry] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _names_and_unique_keys(cls, value: dict[str, TenantEntry]) -> dict[str, TenantEntry]:
        owners: dict[str, str] = {}
        for name, entry in value.items():
            check_tenant_name(name)
            for key in entry.keys:
                other = owners.setdefault(key.sha256, name)
                if other != name:
                    raise ValueError(f"key {key.id} belongs to both {other!r} and {name!r}")
        return value

    def specs(self) -> list[TenantSpec]:
        return [
            TenantSpec(name, tuple(k.sha256 for k in entry.keys), entry.policy())
            for name, entry in self.tenants.items()
        ]


# -- reading and writing ----------------------------------------------------------------------
def _is_json(path: Path) -> bool:
    return path.suffix.lower() == ".json"


def parse(text: str, path: Path) -> TenantFile:
    """The file's content, validated; TenantFileError names the file and the problem."""
    try:
        raw: Any = json.loads(text) if _is_json(path) else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if _is_json(path) else "YAML"
        raise TenantFileError(f"{path}: not valid {kind}: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise TenantFileError(f"{path}: the top level must be a mapping with 'tenants'")
    tenants = raw.get("tenants")
    for name, entry in tenants.items() if isinstance(tenants, dict) else ():
        keys = entry.get("keys") if isinstance(entry, dict) else None
        if isinstance(keys, list) and any(
            isinstance(k, dict) and ("key" in k or "api_key" in k) for k in keys
        ):
            raise TenantFileError(
                f"{path}: tenant {name!r} lists a key in plain text; keys are stored only as "
                "'sha256: <hex digest>' (kvgate tenants add writes them)"
            )
    try:
        return TenantFile.model_validate(raw)
    except ValidationError as exc:
        raise TenantFileError(f"{path}: {exc}") from None


def load(path: Path) -> TenantFile:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TenantFileError(
            f"tenants file {path} does not exist; create it with "
            f"'kvgate tenants add --file {path} NAME'"
        ) from None
    except OSError as exc:
        raise TenantFileError(f"tenants file {path}: {exc}") from None
    return parse(text, path)


def render(content: TenantFile, path: Path) -> str:
    data = content.model_dump(exclude_none=True)
    if _is_json(path):
        return json.dumps(data, indent=2) + "\n"
    header = "# kvgate tenants: keys are kept only as SHA-256 hashes (docs/tenants.md)\n"
    return header + str(yaml.safe_dump(data, sort_keys=False))


def save(content: TenantFile, path: Path) -> None:
    """Atomically replace the file (write a sibling, fsync, rename): readers never see half of
    it, and the new inode is what the gateway's watcher notices. Keeps the file's mode (0600
    for a new file)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(render(content, path))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def editing(path: Path) -> Iterator[TenantFile]:
    """Load, let the caller change the content, save: under an exclusive lock on the file's
    directory, so two `kvgate tenants` commands never lose each other's edits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        content = load(path) if path.exists() else TenantFile()
        yield content
        TenantFile.model_validate(content.model_dump())  # the edit kept the invariants
        save(content, path)
    finally:
        os.close(dir_fd)  # releases the lock


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def add_key(
    path: Path, name: str, label: str | None = None, **policy: Any
) -> tuple[str, KeyEntry, bool]:
    """Create the tenant (or update the policy fields given) and add a new key to it.

    Returns (the key, its entry, whether the tenant was created). The key is returned once and
    never stored: only its hash goes to the file.
    """
    check_tenant_name(name)
    key = new_key()
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    entry = KeyEntry(sha256=hash_key(key), created=now.isoformat().replace("+00:00", "Z"))
    if label:
        entry = entry.model_copy(update={"label": label})
    with editing(path) as content:
        created = name not in content.tenants
        tenant = content.tenants.setdefault(name, TenantEntry())
        updates = {k: v for k, v in policy.items() if v is not None}
        try:
            updated = TenantEntry.model_validate({**tenant.model_dump(), **updates})
        except ValidationError as exc:
            raise TenantFileError(f"tenant {name!r}: {exc}") from None
        updated.keys.append(entry)
        content.tenants[name] = updated
    return key, entry, created


def revoke(path: Path, key_or_id: str | None = None, tenant: str | None = None) -> list[str]:
    """Remove one key (by its id, an id prefix of at least 6 characters, or the key itself) or
    a whole tenant. A revoked key is simply absent from the file. Returns what was removed."""
    if (key_or_id is None) == (tenant is None):
        raise TenantFileError("revoke either one key (KEY_ID or KEY) or a whole --tenant NAME")
    with editing(path) as content:
        if tenant is not None:
            if tenant not in content.tenants:
                raise TenantFileError(
                    f"no tenant {tenant!r} in {path}; tenants: "
                    + (", ".join(sorted(content.tenants)) or "none")
                )
            num_keys = len(content.tenants.pop(tenant).keys)
            return [f"tenant {tenant} ({num_keys} keys)"]
        assert key_or_id is not None
        wanted = key_or_id.lower()
        digest = hash_key(key_or_id)
        matches = [
            (name, key)
            for name, entry in content.tenants.items()
            for key in entry.keys
            if key.sha256 == digest
            or (len(wanted) >= MIN_KEY_ID_CHARS and key.sha256.startswith(wanted))
        ]
        if not matches:
            raise TenantFileError(
                f"no key matches {key_or_id[:KEY_ID_CHARS]!r} in {path} "
                "(give a key id from 'kvgate tenants list', at least "
                f"{MIN_KEY_ID_CHARS} characters, or the key itself)"
            )
        if len(matches) > 1:
            ids = ", ".join(key.id for _, key in matches)
            raise TenantFileError(f"{key_or_id!r} matches several keys ({ids}); give more of it")
        name, key = matches[0]
        content.tenants[name].keys.remove(key)
        return [f"key {key.id} of tenant {name}"]


# -- watching ----------------------------------------------------------------------------------
Fingerprint = tuple[str, int, int, int, int]


def fingerprint(path: Path) -> Fingerprint | None:
    """What changes when the file does: resolved path, device, inode, mtime, size (through
    symlinks, so a Secret's `..data` swap counts). None when the file is absent."""
    try:
        st = os.stat(path)
        resolved = os.path.realpath(path)
    except OSError:
        return None
    return (resolved, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class TenantFileWatcher:
    """Keeps a registry in step with a tenants file: loads it at start (failing loudly), then
    polls its fingerprint every `interval_s` and reloads on a change (logging, and keeping the
    last good content, when the new one is invalid)."""

    def __init__(self, path: Path, registry: TenantRegistry, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("the tenants file reload interval must be positive")
        self.path = path
        self.registry = registry
        self.interval_s = interval_s
        self.num_reloads = 0
        self.num_failures = 0
        self.last_error: str | None = None
        self._fingerprint: Fingerprint | None = None
        self._tasks = BackgroundTasks("tenants file")

    def load_now(self) -> None:
        """Load the file into the registry; raises TenantFileError (startup must fail)."""
        seen = fingerprint(self.path)
        self._apply(load(self.path))
        self._fingerprint = seen

    def _apply(self, content: TenantFile) -> None:
        try:
            self.registry.replace_file_tenants(content.specs())
        except ValueError as exc:
            raise TenantFileError(f"{self.path}: {exc}") from None

    async def maybe_reload(self) -> bool:
        """Reload if the file changed since the last look; True when new content took effect."""
        seen = fingerprint(self.path)
        if seen == self._fingerprint:
            return False
        self._fingerprint = seen  # taken before reading: a write during the read shows next time
        if seen is None:
            self._fail(f"tenants file {self.path} disappeared; keeping the last good content")
            return False
        try:
            content = await asyncio.to_thread(load, self.path)
            self._apply(content)
        except TenantFileError as exc:
            self._fail(f"{exc}; keeping the last good content")
            return False
        self.num_reloads += 1
        self.last_error = None
        log.info(
            "tenants file %s reloaded: %d tenants, %d keys",
            self.path,
            len(content.tenants),
            sum(len(t.keys) for t in content.tenants.values()),
        )
        return True

    def _fail(self, message: str) -> None:
        self.num_failures += 1
        self.last_error = message
        log.error("%s", message)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.maybe_reload()
            except Exception:  # never let the watcher die: log and keep polling
                log.exception("tenants file watcher")

    def start(self) -> None:
        self._tasks.spawn(self._run(), name="tenants-file-watcher")

    async def stop(self) -> None:
        await self._tasks.close()
