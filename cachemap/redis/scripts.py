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

# ARGV (after the chain): now ms, ttl ms, rate window ms (0: do not count), find writers (0/1),
# and the replicas' "rid,oldest live gen,floor ms;" entries in one string.
# Returns {{rid, depth, last use}*, {depth, rate, k} | {}, {shared depth, writer} | {}}.
LOOKUP = (
    CHAIN
    + """
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
local deepest = 0
-- one record call writes the same "<generation>:<last use>" to every block of its chain, so a
-- value is parsed once per lookup (Lua interns strings: the memo is a pointer lookup)
local gens, useds = {}, {}
for i = 1, #KEYS do
  local fields = redis.call('HGETALL', KEYS[i])
  local advanced = false
  for j = 1, #fields, 2 do
    local rid = fields[j]
    if (depth[rid] or 0) == i - 1 then
      local value = fields[j + 1]
      local gen, used = gens[value], useds[value]
      if not gen then
        local sep = string.find(value, ':', 1, true)
        gen = tonumber(string.sub(value, 1, sep - 1))
        used = tonumber(string.sub(value, sep + 1))
        gens[value], useds[value] = gen, used
      end
      if gen >= (mingen[rid] or 0) and now - used < ttl and used > (floor[rid] or -1) then
        depth[rid] = i
        last[rid] = used
        advanced = true
      end
    end
  end
  if not advanced then break end
  deepest = i
end
local out = {}
for rid, d in pairs(depth) do
  out[#out + 1] = rid
  out[#out + 1] = d
  out[#out + 1] = last[rid]
end
local hot = {}
if window_ms > 0 and deepest > 0 then
  local key = KEYS[deepest] .. ':r'
  local v = redis.call('HMGET', key, 'w', 'c', 'p', 'k')
  local window = math.floor(now / window_ms)
  local w, c, p = tonumber(v[1]) or window, tonumber(v[2]) or 0, tonumber(v[3]) or 0
  local k = tonumber(v[4]) or 1
  if w ~= window then
    if w == window - 1 then p = c else p = 0 end
    c = 0
  end
  c = c + 1
  redis.call('HSET', key, 'w', window, 'c', c, 'p', p)
  redis.call('PEXPIRE', key, 2 * window_ms)
  local rate = (p * math.max(0, 1 - (now / window_ms - window)) + c) * 60000 / window_ms
  hot = {deepest, tostring(rate), k}
end
local writer = {}
if ARGV[6] == '1' then
  for i = deepest + 1, #KEYS do
    local w = redis.call('GET', KEYS[i] .. ':w')
    if not w then break end
    writer = {i, w}
  end
end
return {out, hot, writer}
"""
)

# KEYS: a prefix's rate key. ARGV: k.
SET_K = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'k', ARGV[1]) end
return 1
"""

# ARGV (after the chain): the leader's marker, ttl ms. A block's marker is its key + ":w";
# the first writer wins.
LEAD = (
    CHAIN
    + """
local n = 0
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i] .. ':w', ARGV[3], 'NX', 'PX', ARGV[4]) then n = n + 1 end
end
return n
"""
)

# ARGV (after the chain): the leader's pending marker, its landed marker, ttl ms, channel.
LAND = (
    CHAIN
    + """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i] .. ':w') == ARGV[3] then
    redis.call('SET', KEYS[i] .. ':w', ARGV[4], 'PX', ARGV[5])
  end
end
redis.call('PUBLISH', ARGV[6], ARGV[4])
return 1
"""
)

# ARGV (after the chain): rid, generation, now ms, ttl ms.
RECORD = (
    CHAIN
    + """
local value = ARGV[4] .. ':' .. ARGV[5]
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[3], value)
  redis.call('PEXPIRE', KEYS[i], ARGV[6])
end
return #KEYS
"""
)

# ARGV (after the chain): rid.
DROP = (
    CHAIN
    + """
for i = 1, #KEYS do redis.call('HDEL', KEYS[i], ARGV[3]) end
return #KEYS
"""
)

# KEYS: gen, count. ARGV: rid, blocks recorded, blocks per generation
COUNT = """
local n = redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2])
local gen = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if n >= tonumber(ARGV[3]) then
  gen = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('HSET', KEYS[2], ARGV[1], 0)
  redis.call('PUBLISH', ARGV[4], ARGV[1] .. ':' .. gen)
end
return gen
"""

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

# KEYS: gen, count, start. ARGV: rid, start marker ('' = unconditional), channel
BUMP = """
if ARGV[2] ~= '' then
  local old = redis.call('HGET', KEYS[3], ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  if (not old) or old == ARGV[2] then
    return {tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0'), 0}
  end
end
local gen = redis.call('HINCRBY', KEYS[1], ARGV[1], 2)
redis.call('HSET', KEYS[2], ARGV[1], 0)
redis.call('PUBLISH', ARGV[3], ARGV[1] .. ':' .. gen)
return {gen, 1}
"""
