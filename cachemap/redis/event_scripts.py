"""The event index's Redis keys and Lua scripts (`cachemap.redis.events` has the schema and the
invariants): one call per flush or per chain slot, its blocks packed into one argument."""

from __future__ import annotations

from cachemap.events import EngineHash
from cachemap.keys import TAG_BYTES, BlockHash

DOMAINS_KEY = b"kvg:{kvg-ev}:domains"
OWNERS_KEY = b"kvg:{kvg-ev}:owners"
"""domain id -> the token of its current owner, set at each adoption (`EventWriter.adopt`):
every write script of the domain checks it (fencing, `cachemap.redis.events`)."""
GATEWAYS_KEY = b"kvg:{kvg-ev}:gateways"
"""Live gateways of the shared index: id -> "<expiry, Redis ms>:<domains owned>" (`GATEWAYS`)."""
RECORD_BYTES = 2 * TAG_BYTES + (16 - TAG_BYTES) + 1
"""One block in a blob: its tag in hex, suffix, mask digit (23 bytes; what `CLEAN` reads)."""
WRITE_BYTES = RECORD_BYTES + 7
"""One block write in `WRITE`'s blob: a record and its prefix mark (`prefix_mark`: 30 bytes)."""
NO_PREFIX = b"-------"
PREFIX_DIGITS = 7

# ARGV: domain id, epoch, blob of WRITE_BYTES records. A field is "<epoch>:<mask>" or, when the
# owner knows the block's whole prefix (the chain up to and including it) is held in the domain,
# "<epoch>:<mask>:<blocks of that prefix on no GPU, 7 digits>": LOOKUP finds the deepest such
# block by bisection instead of reading the chain block by block (`cachemap.redis.events`,
# "Prefix marks"). A mask digit 0 deletes the field, and with it the domain's speculative entry
# of the block (`:s`): the block is gone, nothing may claim it until the entry's ttl. A stored
# block's entry is left to its ttl: LOOKUP reads `:s` only for a block without an event of the
# domain, so the `:e` field is what matches from now (an HDEL per stored block too cost the
# redis-server 1.28x its CPU on the ingest benchmark).
# With a second key (the owners hash; one Redis, where it is reachable) and a fourth argument
# (the writer's owner token), nothing is written unless the token is the domain's current owner's
# (returns -1): a stalled owner's late writes are refused. No token at all (Redis lost its
# state) refuses nothing: the owner writes its domain back (`EventWriter.retake`).
WRITE = """
local rid, value, blob = ARGV[1], ARGV[2] .. ':', ARGV[3]
local owner = KEYS[2] and redis.call('HGET', KEYS[2], rid)
if owner and owner ~= ARGV[4] then return -1 end
for o = 1, #blob, 30 do
  local base = 'kvg:{' .. string.sub(blob, o, o + 11) .. '}:' .. string.sub(blob, o + 12, o + 21)
  local m = string.sub(blob, o + 22, o + 22)
  if m == '0' then
    redis.call('HDEL', base .. ':e', rid)
    redis.call('HDEL', base .. ':s', rid)
  elseif string.byte(blob, o + 23) == 45 then -- '-': not all of its prefix is held
    redis.call('HSET', base .. ':e', rid, value .. m)
  else
    redis.call('HSET', base .. ':e', rid, value .. m .. ':' .. string.sub(blob, o + 23, o + 29))
  end
end
return 1
"""

# ARGV: domain id, current epoch, blob of records (mask ignored), owner token: fields of older
# epochs go. Fenced as `WRITE` is (a second key: the owners hash).
CLEAN = """
local rid, epoch, blob = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local owner = KEYS[2] and redis.call('HGET', KEYS[2], rid)
if owner and owner ~= ARGV[4] then return -1 end
local n = 0
for o = 1, #blob, 23 do
  local key = 'kvg:{' .. string.sub(blob, o, o + 11) .. '}:'
    .. string.sub(blob, o + 12, o + 21) .. ':e'
  local v = redis.call('HGET', key, rid)
  if v and tonumber(string.sub(v, 1, string.find(v, ':', 1, true) - 1)) < epoch then
    redis.call('HDEL', key, rid)
    n = n + 1
  end
end
return n
"""

# ARGV: the chain's prefix, its 10-byte suffixes joined, "rid,epoch;"*. A domain's depth is its
# leading run of blocks held at its epoch (`:e`) or claimed by a live speculative entry of that
# epoch (`:s`, written by SPECULATE; counted as a GPU block, as in process). Only the domains
# holding or claiming block 1 are looked at. For each, the deepest block whose field carries a
# prefix mark (its whole prefix held: `WRITE`) is found by bisection, log2(n) reads, and the
# count of its prefix's blocks on no GPU taken from the mark; from there the chain is read block
# by block (`:e`, then `:s` for a block without an event) until neither holds: the blocks past
# the marks are a turn's new ones (speculative), or follow a hole. A block with a mark has every
# block before it held, so the result is the block-by-block walk's (a field without a mark,
# e.g. one written before marks existed, only makes the walk longer). Returns
# {changed, domains, {rid, depth, blocks held on no GPU, blocks only a speculative entry
# claims}*}. With a second key (the domains hash; one Redis, not a cluster, where it sits in
# another slot) the epochs are read here, in the same call as the chain: when they differ from
# those the caller passed (a wipe, a new domain, a Redis that lost its state) `changed` is 1 and
# `domains` that hash's HGETALL, for the caller to update its view. Without it the caller's
# epochs are used and `changed` is 0 (the caller reads the hash in the same pipeline).
LOOKUP = """
local prefix, blob = ARGV[1], ARGV[2]
local n = #blob / 10
local want = {}
for rid, e in string.gmatch(ARGV[3], '([^,;]+),([^,;]+);') do want[rid] = e .. ':' end
local changed, domains = 0, {}
if KEYS[2] then
  local all = redis.call('HGETALL', KEYS[2])
  local now, same, count = {}, true, 0
  for j = 1, #all, 2 do
    local e = string.match(all[j + 1], '^([^|]*)') .. ':'
    now[all[j]] = e
    count = count + 1
    if want[all[j]] ~= e then same = false end
  end
  for _ in pairs(want) do count = count - 1 end
  if not same or count ~= 0 then changed, domains = 1, all end
  want = now
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function key(i) return prefix .. string.sub(blob, i * 10 - 9, i * 10) end
local function held(v, e) return v and string.sub(v, 1, #e) == e end
local function claimed(v, e)
  return v and string.sub(v, 1, #e) == e and tonumber(string.sub(v, #e + 1)) > now
end
local first = {}
for _, suffix in ipairs({':e', ':s'}) do
  local fields = redis.call('HGETALL', key(1) .. suffix)
  for j = 1, #fields, 2 do
    if want[fields[j]] then first[fields[j]] = want[fields[j]] end
  end
end
local out = {}
for rid, e in pairs(first) do
  local lo, hi, off, spec = 0, n, 0, 0
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local v = redis.call('HGET', key(mid) .. ':e', rid)
    if held(v, e) and #v > #e + 2 then
      lo = mid
      off = tonumber(string.sub(v, #e + 3))
    else
      hi = mid - 1
    end
  end
  local depth = lo
  for i = lo + 1, n do
    local base = key(i)
    local v = redis.call('HGET', base .. ':e', rid)
    if held(v, e) then
      if tonumber(string.sub(v, #e + 1, #e + 1)) % 2 == 0 then off = off + 1 end
    elseif claimed(redis.call('HGET', base .. ':s', rid), e) then
      spec = spec + 1
    else
      break
    end
    depth = i
  end
  if depth > 0 then
    out[#out + 1] = rid
    out[#out + 1] = depth
    out[#out + 1] = off
    out[#out + 1] = spec
  end
end
return {changed, domains, out}
"""

# KEYS: the chain's first block (the slot). ARGV: the chain's prefix, the 10-byte suffixes of the
# blocks placed, domain id, its epoch, ttl ms. Each block's `:s` hash gets rid -> "epoch:expiry
# ms" (Redis's clock, the one LOOKUP compares with); the key expires with its last entry, so an
# unconfirmed entry costs memory for one ttl only. A block the domain already holds at that
# epoch (its event was written after the placement's lookup, before this call) gets no entry:
# the event confirmed it already, and an entry written now would outlive the block's eviction.
SPECULATE = """
local prefix, blob, rid, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5])
local epoch = ARGV[4] .. ':'
local t = redis.call('TIME')
local value = epoch .. (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl)
for i = 1, #blob / 10 do
  local base = prefix .. string.sub(blob, i * 10 - 9, i * 10)
  local held = redis.call('HGET', base .. ':e', rid)
  if not (held and string.sub(held, 1, #epoch) == epoch) then
    local key = base .. ':s'
    redis.call('HSET', key, rid, value)
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end
return 1
"""

# KEYS: the gateways hash. ARGV: this gateway's id, the lease ms, the domains it owns. Marks it
# live for one lease (Redis's clock), drops the gateways whose mark ran out; returns the owned
# counts of every live gateway (this one's first).
GATEWAYS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], (now + tonumber(ARGV[2])) .. ':' .. ARGV[3])
local out = {tonumber(ARGV[3])}
local all = redis.call('HGETALL', KEYS[1])
for j = 1, #all, 2 do
  local v = all[j + 1]
  local c = string.find(v, ':', 1, true)
  if tonumber(string.sub(v, 1, c - 1)) < now then
    redis.call('HDEL', KEYS[1], all[j])
  elseif all[j] ~= ARGV[1] then
    out[#out + 1] = tonumber(string.sub(v, c + 1))
  end
end
return out
"""

# KEYS: a lease. ARGV: the gateway's id, the lease ms. Renew if held by this gateway.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: a lease. ARGV: the gateway's id. Give it up if held by this gateway.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# KEYS: a domain's map, its feed hash. ARGV: a blob of (field length byte, field, value length
# byte, value) records; a value of length 0 deletes the field. One argument for the whole batch:
# redis-py packs each argument in Python (~1.5 µs apiece), and a flush of an eviction storm sets
# or deletes thousands of fields (py-spy: `pack_command` was the owner's largest cost). Applied
# in slices of `unpack`'s safe size. ARGV[2]: the writer's owner token; -1, and nothing written,
# unless the feed hash names it (fencing).
MAP = """
local blob, key = ARGV[1], KEYS[1]
local owner = redis.call('HGET', KEYS[2], 'owner')
if owner and owner ~= ARGV[2] then return -1 end
local sets, dels = {}, {}
local o, n = 1, #blob
while o <= n do
  local fl = string.byte(blob, o)
  local vl = string.byte(blob, o + fl + 1)
  if vl == 0 then
    dels[#dels + 1] = string.sub(blob, o + 1, o + fl)
  else
    sets[#sets + 1] = string.sub(blob, o + 1, o + fl)
    sets[#sets + 1] = string.sub(blob, o + fl + 2, o + fl + 1 + vl)
  end
  o = o + fl + 2 + vl
end
for i = 1, #sets, 1000 do redis.call('HSET', key, unpack(sets, i, math.min(i + 999, #sets))) end
for i = 1, #dels, 500 do redis.call('HDEL', key, unpack(dels, i, math.min(i + 499, #dels))) end
return #sets / 2 + #dels
"""


# KEYS: a domain's feed hash, its map. ARGV: the writer's owner token, "1" to drop the map and the
# sliding groups first (a wipe), then field, value pairs for the feed hash. -1, and nothing
# written, unless the feed hash names the token (fencing; `FEED_OWNER`).
FEED = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return -1 end
if ARGV[2] == '1' then
  redis.call('UNLINK', KEYS[2])
  redis.call('HDEL', KEYS[1], 'sliding')
end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
return 1
"""

# KEYS: the domains hash, the owners hash. ARGV: domain id, owner token, "<epoch>|<name>". Sets the
# domain's entry only if the token is its current owner's and the epoch does not go back: 1, or -1
# (refused). A stalled owner resumed after another adopted and wiped the domain wrote the older
# epoch back, and readers counted the wiped blocks again (issue 45, item 10).
DOMAIN = """
local owner = redis.call('HGET', KEYS[2], ARGV[1])
if owner and owner ~= ARGV[2] then return -1 end
local current = redis.call('HGET', KEYS[1], ARGV[1])
local epoch = tonumber(string.match(ARGV[3], '^(%d+)'))
if current and tonumber(string.match(current, '^(%d+)')) > epoch then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

FEED_OWNER = b"owner"
"""The feed hash's copy of the owner token (the map and feed writes are in that hash's slot)."""


def map_record(engine_hash: EngineHash, value: bytes | None) -> bytes:
    """One field of `MAP`'s blob: the engine hash's field and its value (None: delete).
    ValueError for a field or value of 256 bytes or more (the decoder bounds engine hashes)."""
    field_ = engine_field(engine_hash)
    value = value or b""
    if len(field_) >= 256 or len(value) >= 256:
        raise ValueError(f"a map field or value of {len(field_)}/{len(value)} bytes (max 255)")
    return b"%c%b%c%b" % (len(field_), field_, len(value), value)


def map_key(rid: str) -> bytes:
    return b"kvg:{kvg-ev:" + rid.encode() + b"}:map"


def feed_key(rid: str) -> bytes:
    return b"kvg:{kvg-ev:" + rid.encode() + b"}:feed"


def lease_key(rid: str) -> bytes:
    return b"kvg:{kvg-ev}:lease:" + rid.encode()


def engine_field(engine_hash: EngineHash) -> bytes:
    """An engine hash as a map field: `i` + decimal for an int (vLLM unsigned, SGLang signed),
    `b` + the bytes otherwise; `engine_hash_of` reads it back exactly."""
    if isinstance(engine_hash, int):
        return b"i%d" % engine_hash
    return b"b" + engine_hash


def engine_hash_of(field_: bytes) -> EngineHash:
    return int(field_[1:]) if field_[:1] == b"i" else bytes(field_[1:])


def digit(mask: int) -> bytes:
    """A tier mask (0-7) as the one ASCII digit the scripts read."""
    return b"01234567"[mask : mask + 1]


def record(key: BlockHash, mask: int) -> bytes:
    """One block in a script's blob (`RECORD_BYTES`): its chain's tag in hex, the rest of its
    key, the mask digit (0: delete)."""
    return key[:TAG_BYTES].hex().encode() + key[TAG_BYTES:] + digit(mask)


def write_record(key: BlockHash, mask: int, mark: int | None) -> bytes:
    """One block write in `WRITE`'s blob (`WRITE_BYTES`): its record and its prefix mark, the
    blocks of its prefix on no GPU (`PREFIX_DIGITS` digits), or `NO_PREFIX` when not all of its
    prefix is held (None)."""
    return b"%b%b%d%b" % (
        key[:TAG_BYTES].hex().encode(),
        key[TAG_BYTES:],
        mask,
        NO_PREFIX if mark is None else b"%07d" % mark,
    )
