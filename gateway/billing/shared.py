"""The contract's cache entries shared by every gateway, in the billing store's Redis.

Without it each gateway keeps its own `CacheLedger`: a conversation whose turns land on two
gateways would pay a write on each. With `billing_redis_url` set, the meter reads the entries
a request can touch (its blocks' keys, in its scope) before admitting it, and writes back the
ones the admission created or refreshed; the local ledger stays the working copy.

    {kvgate-billing}:e:<scope>:<block key>   STRING "<visible_at>|<last_use>|<ttl_s>"
                                             PEXPIRE ttl_s + 1 h (garbage only; liveness is
                                             judged on the stored times, by the rules)
    {kvgate-billing}:o:<object id>           STRING an explicit cached content (JSON), kept
                                             until its end + 1 h; written before the API
                                             answers, read by a gateway before each use

`<scope>` is the hex of a 64-bit MurmurHash3 of (profile, isolation scope, model): entries are
never shared across tenants, nor between the end users of a `user`-scoped tenant (its scope
holds the end user's salt, `Tenant.scope`), nor across profiles (a tenant moved to another
profile starts afresh).
Every key carries the billing store's hash tag, so a read is one `MGET` and a write one script
call, in a Cluster too.

Concurrent writers join instead of overwriting, with `rules.upsert`'s rule: two entries whose
lifetimes overlap become one (the earlier visibility, the later use, the longer TTL); otherwise
the later-used one wins. Times are kept as the exact decimal strings the meter wrote, so the
join picks strings and never rounds. A Redis that is slow or down costs nothing but sharing:
the read has a deadline, the write is in the background, and the local ledger decides alone
meanwhile (logged once per state change).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import mmh3
import orjson
from redis.exceptions import RedisError

from gateway.billing.contents import from_json, to_json
from gateway.billing.pricing.model import CachedContent, Entry
from gateway.billing.store import PREFIX

log = logging.getLogger(__name__)

KEY_SLACK_S = 3600
"""A key outlives its entry by an hour of wall time: meters on a test clock still find it."""

# KEYS: the entries' keys. ARGV: for each key "<visible_at>|<last_use>|<ttl_s>", then its
# PEXPIRE in ms. Joins each with what is stored (see the module docstring).
_JOIN = """
local function parse(value)
  local v, u, t = string.match(value, '^([^|]+)|([^|]+)|([^|]+)$')
  return v, u, t
end
local n = #KEYS
for i = 1, n do
  local new = ARGV[i]
  local old = redis.call('GET', KEYS[i])
  if old and old ~= new then
    local ov, ou, ot = parse(old)
    local nv, nu, nt = parse(new)
    local oend = tonumber(ou) + tonumber(ot)
    local nend = tonumber(nu) + tonumber(nt)
    if tonumber(nu) < oend and tonumber(ou) < nend then  -- the lifetimes overlap: one entry
      local v = (tonumber(ov) <= tonumber(nv)) and ov or nv
      local u = (tonumber(ou) >= tonumber(nu)) and ou or nu
      local t = (tonumber(ot) >= tonumber(nt)) and ot or nt
      new = v .. '|' .. u .. '|' .. t
    elseif tonumber(ou) > tonumber(nu) then
      new = old
    end
  end
  redis.call('SET', KEYS[i], new, 'PX', ARGV[n + i])
end
return n
"""


def scope_id(profile: str, scope: str, model: str) -> str:
    """`scope`: `Tenant.scope` (a tenant-wide scope is the tenant's name, as before)."""
    raw = "\x00".join((profile, scope, model)).encode()
    return format(mmh3.hash64(raw, signed=False)[0], "016x")


def encode(entry: Entry) -> bytes:
    return f"{entry.visible_at}|{entry.last_use}|{entry.ttl_s}".encode()


def decode(value: bytes | str) -> Entry:
    text = value.decode() if isinstance(value, bytes) else value
    visible, last, ttl = text.split("|")
    return Entry(Decimal(visible), Decimal(last), Decimal(ttl))


def join(a: Entry, b: Entry) -> Entry:
    """The one entry two writers' views of a key make (the script's rule, in Python)."""
    if b.last_use < a.last_use + a.ttl_s and a.last_use < b.last_use + b.ttl_s:
        return Entry(
            min(a.visible_at, b.visible_at), max(a.last_use, b.last_use), max(a.ttl_s, b.ttl_s)
        )
    return a if a.last_use > b.last_use else b


class SharedEntries:
    """Reads and joins one scope's entries in Redis; never raises to the meter."""

    def __init__(self, client: Any, read_deadline_s: float) -> None:
        self.client = client
        self.read_deadline_s = read_deadline_s
        self._join = client.register_script(_JOIN)
        self._writes: set[asyncio.Task[None]] = set()
        self.available = True
        self.failures = 0

    @staticmethod
    def _key(scope: str, block: bytes) -> bytes:
        return f"{PREFIX}:e:{scope}:".encode() + block.hex().encode()

    async def fetch(self, scope: str, blocks: Sequence[bytes]) -> dict[bytes, Entry] | None:
        """The stored entries of `blocks` (absent ones left out); None when Redis did not
        answer within the deadline."""
        if not blocks:
            return {}
        try:
            values = await asyncio.wait_for(
                self.client.mget([self._key(scope, b) for b in blocks]), self.read_deadline_s
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self._trouble(exc)
            return None
        self._recovered()
        return {b: decode(v) for b, v in zip(blocks, values, strict=True) if v is not None}

    def store(self, scope: str, entries: Mapping[bytes, Entry]) -> asyncio.Task[None] | None:
        """Join `entries` into Redis in the background (the next request needs them, this one
        does not); the write's task, for a caller that must know it landed (a fan-out leader's
        landing, `BillingMeter.landed`), None when there is nothing to write."""
        if not entries:
            return None
        task = asyncio.create_task(self._store(scope, list(entries.items())))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    async def _store(self, scope: str, items: Iterable[tuple[bytes, Entry]]) -> None:
        pairs = list(items)
        keys = [self._key(scope, block) for block, _ in pairs]
        values = [encode(entry) for _, entry in pairs]
        expiries = [int((entry.ttl_s + KEY_SLACK_S) * 1000) for _, entry in pairs]
        try:
            await self._join(keys=keys, args=[*values, *expiries])
        except (RedisError, OSError, TimeoutError) as exc:
            self._trouble(exc)

    # -- explicit cached contents (google_explicit) --------------------------------------------
    @staticmethod
    def _object_key(object_id: str) -> bytes:
        return f"{PREFIX}:o:{object_id}".encode()

    async def get_object(self, object_id: str) -> CachedContent | None:
        """The stored object; None when the store has none or did not answer in time."""
        try:
            value = await asyncio.wait_for(
                self.client.get(self._object_key(object_id)), self.read_deadline_s
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self._trouble(exc)
            return None
        self._recovered()
        return None if value is None else from_json(orjson.loads(value))

    async def put_object(self, obj: CachedContent) -> None:
        """Store an object as this gateway now sees it (created, extended or deleted), before
        the API answers: any gateway then serves requests naming it. Kept until its end."""
        end = obj.expires if obj.deleted is None else min(obj.expires, obj.deleted)
        try:
            await self.client.set(
                self._object_key(obj.object_id),
                orjson.dumps(to_json(obj)),
                px=int((max(end - obj.created, Decimal(0)) + KEY_SLACK_S) * 1000),
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self._trouble(exc)

    async def drain(self) -> None:
        """Wait for the background writes (tests, shutdown)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def _trouble(self, exc: BaseException) -> None:
        self.failures += 1
        if self.available:
            self.available = False
            log.warning("billing: shared cache entries unavailable (%s); billing locally", exc)

    def _recovered(self) -> None:
        if not self.available:
            self.available = True
            log.warning("billing: shared cache entries available again")
