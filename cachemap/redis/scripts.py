"""The Lua scripts of the Redis directory: one server-side call per operation.

Every chain script reads its keys through `CHAIN` (see `schema.chain_call`); the lookup stops at
the first block no live replica holds, because the prefix chain breaks there.
"""

from __future__ import annotations

# The chain scripts declare the chain's first key (it routes the call to the slot every key of
# the chain shares) and take the blocks as one blob of 10-byte suffixes: packing one argument
# instead of one key per block halved the client's CPU per lookup (see docs/design/directory.md).
CHAIN = """
-- ARGV[1]: the chain's key prefix "kvg:{TAG}:", ARGV[2]: the blocks' 10-byte suffixes, joined
local prefix, blob = ARGV[1], ARGV[2]
local KEYS = {}
for i = 1, #blob / 10 do KEYS[i] = prefix .. string.sub(blob, i * 10 - 9, i * 10) end
"""

# The same chain, its keys built as a script reaches them (`key(i)`, `n` blocks): a lookup
# walks only as far as some replica holds the chain (on bench point 1 a tenth of it), and
# building every block's key name first cost Redis ~0.4 µs a block it never read.
LAZY_CHAIN = """
-- ARGV[1]: the chain's key prefix "kvg:{TAG}:", ARGV[2]: the blocks' 10-byte suffixes, joined
local prefix, blob = ARGV[1], ARGV[2]
local n = #blob / 10
local function key(i) return prefix .. string.sub(blob, i * 10 - 9, i * 10) end
"""

# ARGV (after the chain): now ms, ttl ms, rate window ms (0: do not count), find writers (0/1),
# the replicas' "rid,oldest live gen,floor ms;" entries in one string, the young rate's
# minimum span ms (`cachemap.rates`: the rate is the same formula in process), and how many
# blocks back from the end to look for the conversation's home (`HOME`; 0: not asked).
# Returns {{rid, depth, last use}*, {depth, rate, k} | {}, {shared depth, writer} | {},
# {depth, home replica} | {}, {rid, held depth, its oldest generation, its oldest use}*}: the
# last, each replica's entries alone from the first block (no flight) and the oldest value
# among them (what a record may leave as it is: `RedisDirectory.record_many`).
LOOKUP = (
    LAZY_CHAIN
    + """
-- How many of a flight's blocks, listed in `v` after its newline at `sep` (10-byte suffixes),
-- this chain shares from block s + 1 on: blocks are chained hashes, so agreeing at a block means
-- agreeing at every one before it (a bisection, bounded to the flight's whole blocks).
local function shared(v, sep, s)
  local lo, hi = 0, math.min(math.floor((#v - sep) / 10), n - s)
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local at, o = sep + mid * 10, (s + mid) * 10
    if string.sub(v, at - 9, at) == string.sub(blob, o - 9, o) then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end
local now = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local window_ms = tonumber(ARGV[5])
local mingen = {}
local floor = {}
for rid, gen, fl in string.gmatch(ARGV[7], '([^,;]+),([^,;]+),([^,;]+);') do
  mingen[rid] = tonumber(gen)
  floor[rid] = tonumber(fl)
end
local depth = {}
local last = {}
local placed = {}
local held, held_last = {}, {}  -- the same, entries alone (no placement in flight)
local held_gen, held_used = {}, {}  -- the oldest generation and use among a replica's held
local deepest = 0
-- one record call writes the same "<generation>:<last use>" to every block of its chain, so a
-- value is parsed once per lookup (Lua interns strings: the memo is a pointer lookup)
local gens, useds = {}, {}
for i = 1, n do
  local fields = redis.call('HGETALL', key(i))
  local advanced = false
  for j = 1, #fields, 2 do
    local rid = fields[j]
    -- "<rid>+": a placement in flight (PLACE), "<generation>:<expiry>": it extends the replica's
    -- match like an entry; an entry at the same block wins (its last use is what reconciliation
    -- may expire; a placement's is 0, nothing to expire)
    local pending = string.byte(rid, -1) == 43
    if pending then rid = string.sub(rid, 1, -2) end
    local d = depth[rid] or 0
    if d == i - 1 or (not pending and d == i and placed[rid] == i) then
      local value = fields[j + 1]
      local gen, used = gens[value], useds[value]
      if not gen then
        local sep = string.find(value, ':', 1, true)
        gen = tonumber(string.sub(value, 1, sep - 1))
        used = tonumber(string.sub(value, sep + 1))
        gens[value], useds[value] = gen, used
      end
      if gen >= (mingen[rid] or 0) then
        if pending then
          if used > now then
            depth[rid], last[rid], placed[rid] = i, 0, i
            advanced = true
          end
        elseif now - used < ttl and used > (floor[rid] or -1) then
          depth[rid], last[rid], placed[rid] = i, used, nil
          if (held[rid] or 0) == i - 1 then
            held[rid], held_last[rid] = i, used
            if i == 1 or gen < held_gen[rid] then held_gen[rid] = gen end
            if i == 1 or used < held_used[rid] then held_used[rid] = used end
          end
          advanced = true
        end
      end
    end
  end
  if not advanced then break end
end
-- placements in flight (PLACE): one hash per flight's first block, its key + ":p", rid ->
-- "<generation>:<expiry>", a newline, the flight's block suffixes. A replica's match goes on
-- through a live flight of its own that starts where its match ends, as far as the flight's
-- blocks are this chain's (blocks are chained hashes: agreeing at a block means agreeing at
-- every one before it, a bisection), and on through a flight starting there in turn. A flight
-- the record has covered starts inside the replica's entries: it is never read again.
-- (the replicas this gateway routes to: only theirs are reported; where each one's match ends)
local flights = {}
local starts, starting = {}, {}
for rid in pairs(mingen) do
  local d = depth[rid] or 0
  if not starting[d] then starting[d] = true; starts[#starts + 1] = d end
end
local next_start = 1
while next_start <= #starts do
  local s = starts[next_start]
  next_start = next_start + 1
  if s < n then
    local fields = flights[s]
    if not fields then
      fields = redis.call('HGETALL', key(s + 1) .. ':p')
      flights[s] = fields
    end
    for j = 1, #fields, 2 do
      local rid, v = fields[j], fields[j + 1]
      local sep = string.find(v, '\\n', 1, true)
      if sep and mingen[rid] and (depth[rid] or 0) == s then
        local colon = string.find(v, ':', 1, true)
        local gen = tonumber(string.sub(v, 1, colon - 1))
        local expiry = tonumber(string.sub(v, colon + 1, sep - 1))
        if gen >= mingen[rid] and expiry > now then
          local lo = shared(v, sep, s)
          if lo > 0 then
            depth[rid], last[rid], placed[rid] = s + lo, 0, s + lo
            starts[#starts + 1] = s + lo
          end
        end
      end
    end
  end
end
for _, d in pairs(depth) do
  if d > deepest then deepest = d end
end
local out = {}
for rid, d in pairs(depth) do
  out[#out + 1] = rid
  out[#out + 1] = d
  out[#out + 1] = last[rid]
end
local hot = {}
if window_ms > 0 and deepest > 0 then
  local rate_key = key(deepest) .. ':r'
  local v = redis.call('HMGET', rate_key, 'w', 'c', 'p', 'k', 'f')
  local window = math.floor(now / window_ms)
  local w, c, p = tonumber(v[1]) or window, tonumber(v[2]) or 0, tonumber(v[3]) or 0
  local k = tonumber(v[4]) or 1
  local first = tonumber(v[5]) or now
  if w ~= window then
    if w == window - 1 then p = c else p, first = 0, now end
    c = 0
  end
  c = c + 1
  redis.call('HSET', rate_key, 'w', window, 'c', c, 'p', p, 'f', first)
  redis.call('PEXPIRE', rate_key, 2 * window_ms)
  local rate = (p * math.max(0, 1 - (now / window_ms - window)) + c) * 60000 / window_ms
  if first >= (window - 1) * window_ms then  -- young: over the span observed
    local young = (c + p - 1) * 60000 / math.max(now - first, tonumber(ARGV[8]))
    if young > rate then rate = young end
  end
  hot = {deepest, tostring(rate), k}
end
local writer = {}
if ARGV[6] == '1' then
  -- a leader's flight starts where its replica's cache ended: at no block, or at a depth some
  -- replica holds now (`LEAD`); its one marker key is its first block's, and holds the marker
  -- and the flight's block suffixes; how far this chain shares the flight: `shared`.
  -- (from the entries alone: a leader's flight is a placement in flight, and when one is found
  -- its marker decides, so the depths reported are the entries')
  local starts, seen = {0}, {[0] = true}
  local best = 0
  for _, d in pairs(held) do
    if not seen[d] then seen[d] = true; starts[#starts + 1] = d end
    if d > best then best = d end
  end
  for _, s in ipairs(starts) do
    if s < n then
      local v = redis.call('GET', key(s + 1) .. ':w')
      local sep = v and string.find(v, '\\n', 1, true)
      if sep then
        local lo = shared(v, sep, s)
        if s + lo > best then
          best = s + lo
          writer = {best, string.sub(v, 1, sep - 1), s + 1}
        end
      end
    end
  end
  if #writer > 0 then
    out = {}
    for rid, d in pairs(held) do
      out[#out + 1] = rid
      out[#out + 1] = d
      out[#out + 1] = held_last[rid]
    end
  end
end
-- the conversation's home (`HOME`, the same walk) in the same round trip
local home = {}
local walk = tonumber(ARGV[9] or '0')
if walk > 0 then
  for i = n, math.max(n - walk, 0) + 1, -1 do
    local replica = redis.call('GET', key(i) .. ':h')
    if replica then home = {i, replica}; break end
  end
end
local kept = {}
for rid, d in pairs(held) do
  if mingen[rid] then
    kept[#kept + 1] = rid
    kept[#kept + 1] = d
    kept[#kept + 1] = held_gen[rid]
    kept[#kept + 1] = held_used[rid]
  end
end
return {out, hot, writer, home, kept}
"""
)

# KEYS: a prefix's rate key. Takes back one request of the current count (never its first: the
# young rate's clock starts there): a later sibling of a fan-out flight is not a new arrival.
UNCOUNT = """
local c = tonumber(redis.call('HGET', KEYS[1], 'c'))
if c and c > 1 then redis.call('HINCRBY', KEYS[1], 'c', -1) end
return 1
"""

# KEYS: a prefix's rate key. ARGV: k.
SET_K = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'k', ARGV[1]) end
return 1
"""

# ARGV (after the chain, which is not expanded): the leader's marker, ttl ms. One key per
# flight, its first block's + ":w": the marker, a newline, the flight's block suffixes (what a
# sibling's lookup compares its own chain with). The first writer wins.
LEAD = """
if redis.call('SET', KEYS[1] .. ':w', ARGV[3] .. '\\n' .. ARGV[2], 'NX', 'PX', ARGV[4]) then
  return 1
end
return 0
"""

# ARGV (after the chain, not expanded): the leader's marker, ttl ms, then `PLACE`'s rid,
# generation, expiry ms, ttl ms. `LEAD` and the same flight's placement in flight in one call
# (`MarkerStore.lead`'s `place`): at routing time a leader's marker and its placement start at
# the same block, and the placement no longer waits for the write-behind's own round trip.
LEAD_PLACE = """
local placed = KEYS[1] .. ':p'
local ttl = tonumber(ARGV[8])
redis.call('HSET', placed, ARGV[5], ARGV[6] .. ':' .. ARGV[7] .. '\\n' .. ARGV[2])
if redis.call('PTTL', placed) < ttl then redis.call('PEXPIRE', placed, ttl) end
if redis.call('SET', KEYS[1] .. ':w', ARGV[3] .. '\\n' .. ARGV[2], 'NX', 'PX', ARGV[4]) then
  return 1
end
return 0
"""

# ARGV (after the chain, not expanded): the leader's pending marker, its landed marker, ttl ms,
# channel. A flight with no marker gets the landed one too: the leader's own marker call may
# still be on its way (it missed its deadline, Redis runs it later) and must then find the key
# taken (set if absent), not leave a pending marker no landing will ever clear. Another
# leader's marker on the key is left alone.
LAND = """
local key = KEYS[1] .. ':w'
local current = redis.call('GET', key)
if not current or string.sub(current, 1, #ARGV[3] + 1) == ARGV[3] .. '\\n' then
  redis.call('SET', key, ARGV[4] .. '\\n' .. ARGV[2], 'PX', ARGV[5])
end
redis.call('PUBLISH', ARGV[6], ARGV[4])
return 1
"""

# ARGV (after the chain): rid, generation, last use ms, ttl ms. A field already at this
# generation keeps the later of the two uses (write-behind batches may arrive out of order).
# Counts how many blocks are new to the generation (`new`: capacity counts distinct entries, an
# LRU that is touched again does not grow, so a chain recorded by every request counts once) and,
# of those, how many it moved from each other generation (`moved`: generation -> blocks), which
# the replica's live-generation counts take off there (`_LIVE`).
# A key's expiry is set with each write of a field: a field left as it is already has its key
# living a TTL past its last use (which is later than this record's), so a PEXPIRE there would
# only cost a command. Placements are not read: this code's are one field per flight (`PLACE`),
# and a layout-2 gateway's (a field "<rid>+" on each block, no longer written) is outranked by
# the entry at the same block in the lookup and stops matching at its own expiry
# (`PLACEMENT_TTL_S`). The read is HGET: HMGET's array reply cost ~0.5 µs a block more, with
# one field as with two (a record of 300 new blocks: 1,010-1,026 against 864 µs of Redis).
_RECORD_BODY = """
local gen, used = tonumber(ARGV[4]), tonumber(ARGV[5])
local value = ARGV[4] .. ':' .. ARGV[5]
local new, moved = 0, {}
for i = 1, #KEYS do
  local old = redis.call('HGET', KEYS[i], ARGV[3])
  local write = true
  if old then
    local sep = string.find(old, ':', 1, true)
    local was = tonumber(string.sub(old, 1, sep - 1))
    if was == gen then
      write = tonumber(string.sub(old, sep + 1)) < used
    else
      new = new + 1
      moved[was] = (moved[was] or 0) + 1
    end
  else
    new = new + 1
  end
  if write then
    redis.call('HSET', KEYS[i], ARGV[3], value)
    redis.call('PEXPIRE', KEYS[i], ARGV[6])
  end
end
"""

# Returns {new blocks, {generation, blocks moved from it}*} (a Cluster counts them in the meta
# slot afterwards: `COUNT`).
RECORD = (
    CHAIN
    + _RECORD_BODY
    + """
local flat = {}
for g, n in pairs(moved) do flat[#flat + 1] = g; flat[#flat + 1] = n end
return {new, flat}
"""
)

# ARGV (after the chain, not expanded): rid, generation, the placement's expiry ms, its ttl ms.
# A request placed on the replica, before its engine wrote the KV (`RedisDirectory.place`): ONE
# hash field per flight, on its first block's key + ":p", rid -> "<generation>:<expiry>\n" and
# the flight's block suffixes (the lookup walks a replica's match on through it, as far as the
# looked-up chain agrees with it, until it expires; a record at the request's first token
# covers its blocks, and the lookup never reads a flight that starts inside the replica's
# entries). It was a field "<rid>+" on every block (HSET, PTTL, PEXPIRE each, and an HDEL by
# the record): the tier's largest per-block cost at a low hit ratio. The hash holds a field
# per replica whose flight starts at that block (a later flight of the same replica from the
# same block replaces it). A key is never given a shorter life.
PLACE = """
local key = KEYS[1] .. ':p'
local ttl = tonumber(ARGV[6])
redis.call('HSET', key, ARGV[3], ARGV[4] .. ':' .. ARGV[5] .. '\\n' .. ARGV[2])
if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
return #ARGV[2] / 10
"""


# ARGV (after the chain): rid, generation, now ms, ttl ms, the blocks' last uses (ms, each
# followed by ','). Writes back entries a gateway kept while Redis lost them: a field is written
# only where Redis has none of this replica's or an older use; not counted against capacity
# (the gateway's own index already held at most that many).
RESTORE = (
    CHAIN
    + """
local gen, now, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local i, written = 0, 0
for used in string.gmatch(ARGV[7], '([^,]+),') do
  i = i + 1
  local key = KEYS[i]
  local old = redis.call('HGET', key, ARGV[3])
  local older = true
  if old then
    local sep = string.find(old, ':', 1, true)
    older = tonumber(string.sub(old, sep + 1)) < tonumber(used)
  end
  local left = ttl - (now - tonumber(used))
  if older and left > 0 then
    redis.call('HSET', key, ARGV[3], gen .. ':' .. used)
    if redis.call('PTTL', key) < left then redis.call('PEXPIRE', key, math.floor(left)) end
    written = written + 1
  end
end
return written
"""
)

# ARGV (after the chain): rid. (A flight placed from a block before the dropped ones still
# matches through them until it expires: drops are not on the request path.)
DROP = (
    CHAIN
    + """
for i = 1, #KEYS do
  redis.call('HDEL', KEYS[i], ARGV[3], ARGV[3] .. '+')
  redis.call('HDEL', KEYS[i] .. ':p', ARGV[3])  -- a flight starting here (PLACE)
end
return #KEYS
"""
)

# The meta slot `kvg:{kvg-meta}` (`schema`): every script below touches only its keys.
# A replica's generation is its field in `gen`, else the generation base (the highest generation
# of any replica pruned so far: generations never go back, even for a pruned replica), and never
# below the caller's own view (`known`): after Redis lost its state, the gateways' memories
# carry the generations on.
_GEN = """
local function current_gen(gen_key, base_key, rid, known)
  local stored = redis.call('HGET', gen_key, rid)
  local gen = tonumber(stored or redis.call('GET', base_key) or '0')
  if tonumber(known) > gen then gen = tonumber(known) end
  if (not stored) or tonumber(stored) < gen then redis.call('HSET', gen_key, rid, gen) end
  return gen
end
"""

# A replica's live generations (`live`, field rid -> "<generation>,<oldest live>;" and
# "<generation>:<entries at it>;" per live generation): the lookup matches entries from the
# oldest live generation on. The state is trusted only at the generation it was written at: a
# generation another script moved (a gateway of the commit before counting, or restarting, by
# its own rules) leaves the two generations' rule, the oldest live one the generation before,
# with the counts known from there on.
_LIVE = """
local function live_load(live_key, rid, gen)
  local v = redis.call('HGET', live_key, rid)
  local cur, oldest, at = nil, gen - 1, {}
  if v then
    local c, o, rest = string.match(v, '^(%-?%d+),(%-?%d+);(.*)$')
    cur, oldest = tonumber(c), tonumber(o)
    for g, n in string.gmatch(rest, '(%-?%d+):(%d+);') do at[tonumber(g)] = tonumber(n) end
  end
  if cur ~= gen then
    oldest = gen - 1
    at = {[gen - 1] = at[gen - 1], [gen] = at[gen]}
  end
  return oldest, at
end
local function live_save(live_key, rid, gen, oldest, at)
  local parts = {gen .. ',' .. oldest .. ';'}
  for g, n in pairs(at) do
    if g >= oldest and n > 0 then parts[#parts + 1] = g .. ':' .. n .. ';' end
  end
  redis.call('HSET', live_key, rid, table.concat(parts))
end
"""

# The count's one rule, for `COUNT` and `RECORD_COUNTED` alike: a record's `new` blocks, written
# at generation `written`, join the entries at it and leave the generations they were `moved`
# from (generation -> blocks). With `per_gen` > 0: once `per_gen` entries are at the current
# generation it advances (once, announced "rid:gen"), and the oldest live generation is dropped
# while the entries left without it are nearer `capacity` than with it, so the live entries
# stay within half a generation of the capacity (an LRU's). A change of either is announced
# "rid:live:<oldest>:<generation>" (a gateway of the commit before ignores that message).
# M: the meta keys {gen, count, live}.
_COUNTED = (
    _LIVE
    + """
local function counted(M, rid, gen, written, new, moved, per_gen, capacity, channel)
  local oldest, at = live_load(M[3], rid, gen)
  local was_oldest, was_gen = oldest, gen
  for g, n in pairs(moved) do
    if g >= oldest and at[g] then at[g] = math.max(at[g] - n, 0) end
  end
  if new > 0 and written >= oldest then at[written] = (at[written] or 0) + new end
  if per_gen > 0 then
    if (at[gen] or 0) >= per_gen then
      gen = gen + 1
      redis.call('HSET', M[1], rid, gen)
      redis.call('HSET', M[2], rid, 0)
      redis.call('PUBLISH', channel, rid .. ':' .. gen)
    end
    local live = 0
    for _, n in pairs(at) do live = live + n end
    while oldest < gen and live - (at[oldest] or 0) / 2 > capacity do
      live = live - (at[oldest] or 0)
      at[oldest] = nil
      oldest = oldest + 1
    end
  end
  live_save(M[3], rid, gen, oldest, at)
  if oldest ~= was_oldest or gen ~= was_gen then
    redis.call('PUBLISH', channel, rid .. ':live:' .. oldest .. ':' .. gen)
  end
  return {gen, oldest}
end
"""
)

# KEYS: gen, count, seen, base, live. ARGV: rid, new blocks recorded, blocks per generation,
# channel, known generation, now ms, the generation they were written at, the blocks moved
# ("<generation>,<blocks>;"*), the replica's capacity. Returns the replica's {generation, oldest
# live generation} now.
COUNT = (
    _GEN
    + _COUNTED
    + """
local gen = current_gen(KEYS[1], KEYS[4], ARGV[1], ARGV[5])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[6])
local moved = {}
for g, n in string.gmatch(ARGV[8], '([^,;]+),([^,;]+);') do moved[tonumber(g)] = tonumber(n) end
return counted({KEYS[1], KEYS[2], KEYS[5]}, ARGV[1], gen, tonumber(ARGV[7]),
  tonumber(ARGV[2]), moved, tonumber(ARGV[3]), tonumber(ARGV[9]), ARGV[4])
"""
)

# A record and its count in one call, on a single Redis (a Cluster keeps the meta slot apart:
# `RECORD`, then `COUNT` per replica). KEYS: the chain's first key, then gen, count, seen, base,
# live. ARGV: `RECORD`'s (after the chain: rid, generation, last use ms, ttl ms), then blocks
# per generation (0: add the new blocks to the counts only), channel, now ms, the replica's
# capacity. The blocks are written at the caller's generation, as `RECORD` writes them (a
# restart epoch the caller has not seen keeps its record from matching), and counted as `COUNT`
# counts them: a batch's calls of one replica all add to the counts, its last one (blocks per
# generation > 0) advances the generation past the threshold, once, as one COUNT of the
# batch's sum did (a long chain's record is many calls: advancing in each would leave its first
# blocks generations back). Returns {new blocks, the replica's generation, its oldest live
# one}. The count was a call of its own after every record batch: a round trip of the
# gateway's and a script call of Redis's per request (docs/design/directory.md, "The tier's
# CPU per request").
RECORD_COUNTED = (
    "local META = {KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}\n"
    + CHAIN
    + _GEN
    + _COUNTED
    + _RECORD_BODY
    + """
local current = current_gen(META[1], META[4], ARGV[3], ARGV[4])
local per_gen = tonumber(ARGV[7])
if per_gen > 0 then redis.call('HSET', META[3], ARGV[3], ARGV[9]) end
local M = {META[1], META[2], META[5]}
local now = counted(M, ARGV[3], current, gen, new, moved, per_gen, tonumber(ARGV[10]), ARGV[8])
return {new, now[1], now[2]}
"""
)

# KEYS: floor. ARGV: rid, ms, channel. Floors only rise.
EXPIRE = """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > old then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PUBLISH', ARGV[3], ARGV[1] .. ':floor:' .. ARGV[2])
  return tonumber(ARGV[2])
end
return old
"""

# KEYS: gen, count, start, seen, base, live. ARGV: rid, start marker ('' = unconditional), channel,
# known generation, the marker the caller saw before ('' = none), now ms.
# A restart is a stored marker that differs — or, when Redis has no marker (it lost its
# state), a marker that differs from the one the caller saw before: a replica's identity
# survives the store losing its markers as long as one gateway remembers it.
BUMP = (
    _GEN
    + """
local gen = current_gen(KEYS[1], KEYS[5], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[6])
if ARGV[2] ~= '' then
  local old = redis.call('HGET', KEYS[3], ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  if old == ARGV[2] then return {gen, 0} end
  if (not old) and (ARGV[5] == '' or ARGV[5] == ARGV[2]) then return {gen, 0} end
end
gen = gen + 2
redis.call('HSET', KEYS[1], ARGV[1], gen)
redis.call('HSET', KEYS[2], ARGV[1], 0)
redis.call('HSET', KEYS[6], ARGV[1], gen .. ',' .. gen .. ';')  -- nothing older is live
redis.call('PUBLISH', ARGV[3], ARGV[1] .. ':' .. gen)
redis.call('PUBLISH', ARGV[3], ARGV[1] .. ':live:' .. gen .. ':' .. gen)
return {gen, 1}
"""
)

# KEYS: layout, gen, floor, base, live. Everything a gateway keeps in memory, in one call (the
# live generations: each replica's "<generation>,<oldest live>").
META = """
local live = {}
local fields = redis.call('HGETALL', KEYS[5])
for i = 1, #fields, 2 do
  live[#live + 1] = fields[i]
  live[#live + 1] = string.match(fields[i + 1], '^([^;]*);')
end
return {
  redis.call('HMGET', KEYS[1], 'version', 'incarnation'),
  redis.call('HGETALL', KEYS[2]),
  redis.call('HGETALL', KEYS[3]),
  redis.call('GET', KEYS[4]) or '0',
  live,
}
"""

# KEYS: layout, gen, floor, base, start. ARGV: layout version, a new incarnation, base,
# "rid,gen;"*, "rid,floor ms;"*, "rid,start marker;"*. Writes back what one gateway knows:
# values only rise, markers are set where absent; a missing layout is created with the new
# incarnation. Returns the layout (version, incarnation) now stored.
RESEED = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'version', ARGV[1], 'incarnation', ARGV[2])
end
if tonumber(ARGV[3]) > tonumber(redis.call('GET', KEYS[4]) or '0') then
  redis.call('SET', KEYS[4], ARGV[3])
end
for k, arg in ipairs({{KEYS[2], ARGV[4]}, {KEYS[3], ARGV[5]}}) do
  for rid, v in string.gmatch(arg[2], '([^,;]+),([^,;]+);') do
    if tonumber(v) > tonumber(redis.call('HGET', arg[1], rid) or '-1') then
      redis.call('HSET', arg[1], rid, v)
    end
  end
end
for rid, marker in string.gmatch(ARGV[6], '([^,;]+),([^,;]+);') do
  redis.call('HSETNX', KEYS[5], rid, marker)
end
return redis.call('HMGET', KEYS[1], 'version', 'incarnation')
"""

# KEYS: gen, count, start, floor, seen, base, live. ARGV: now ms, horizon ms. A replica neither
# recorded nor restarted for the horizon (longer than the TTL: none of its entries can match)
# leaves every meta hash; the base keeps its generation, so a return continues above it.
# Replicas without a `seen` field (written by a gateway before layout 2) start their clock now.
# Floors older than the horizon hide nothing the TTL does not. Returns {pruned, base}.
PRUNE = """
local now, horizon = tonumber(ARGV[1]), tonumber(ARGV[2])
local base = tonumber(redis.call('GET', KEYS[6]) or '0')
local old_base = base
local seen = redis.call('HGETALL', KEYS[5])
local timed = {}
local pruned = 0
for i = 1, #seen, 2 do
  local rid = seen[i]
  timed[rid] = true
  if tonumber(seen[i + 1]) < now - horizon then
    local g = tonumber(redis.call('HGET', KEYS[1], rid) or '0')
    if g > base then base = g end
    for k = 1, 5 do redis.call('HDEL', KEYS[k], rid) end
    redis.call('HDEL', KEYS[7], rid)
    pruned = pruned + 1
  end
end
for k = 1, 4 do
  local fields = redis.call('HKEYS', KEYS[k])
  for i = 1, #fields do
    if not timed[fields[i]] then
      timed[fields[i]] = true
      redis.call('HSET', KEYS[5], fields[i], ARGV[1])
    end
  end
end
local floors = redis.call('HGETALL', KEYS[4])
for i = 1, #floors, 2 do
  if tonumber(floors[i + 1]) < now - horizon then redis.call('HDEL', KEYS[4], floors[i]) end
end
if base > old_base then redis.call('SET', KEYS[6], base) end
return {pruned, base}
"""


# ARGV (after the chain, not expanded): how many blocks back from the end to walk. Returns
# {depth, replica} of the deepest block holding a conversation's home (its key + ":h"), or {}
# (`cachemap.affinity`: a conversation's last replica, kept after its KV is evicted).
HOME = (
    CHAIN
    + """
local stop = #KEYS - tonumber(ARGV[3])
if stop < 0 then stop = 0 end
for i = #KEYS, stop + 1, -1 do
  local replica = redis.call('GET', KEYS[i] .. ':h')
  if replica then return {i, replica} end
end
return {}
"""
)

# KEYS: the new home's key, then the key of the home it supersedes (optional, the same chain:
# the same slot). ARGV: the replica, the TTL in ms.
SET_HOME = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[2] and KEYS[2] ~= KEYS[1] then redis.call('DEL', KEYS[2]) end
return 1
"""
