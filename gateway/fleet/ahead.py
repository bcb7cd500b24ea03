"""The requests looked up ahead, live (issue 39 item 3, `router.ahead`): each gateway registers
its request's routing inputs in Redis and is answered, in the same script call, with the
published load and the requests registered before it whose placements are not yet in it.

    kvg:{kvg-load}:ahead     zset   request id -> its order (an INCR of `:ahead:n`)
    kvg:{kvg-load}:ahead:d   hash   request id -> "<Redis ms>|<gateway>|<had>|<routing inputs>"

One slot with the load hash (`gateway.fleet.shared_load`): `REGISTER` reads the load hash and
the list and adds this request in one call, so what it answers is exact — every request of the
list is one whose gateway has not published its placement, and every placement published is in
the figures it returns — on one Redis and on a Cluster alike. `PUBLISH` writes a gateway's
figures and removes the requests it has decided since its last write, in one call: a request
leaves the list when its placement is in its gateway's figures. An entry older than
`AHEAD_TTL_MS` is dropped by the next registration (a gateway that died, or one whose publish
did not reach Redis, leaves nothing that counts past it), and the keys expire unused.

`<had>` is 1 when the request had any ahead of it when it registered: it is then decided with
ties by id (`router.ahead.ties_by_id`), else by the herd rule's copies, and its peers replay it
so. The routing inputs are the `RouteRequest` as the gateway decides it (`encode_route`), home,
committed and claimed maps included: precise mode replays what approximate does.

Registration is one more round trip a decision, on the load's lane, and only with peers live: a
gateway alone registers nothing and routes as it always did. A gateway of the commit before
neither registers nor removes: its placements reach its peers in its figures as before, and its
plain `HSET` leaves the list as it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from router.types import RouteRequest

AHEAD_KEY = b"kvg:{kvg-load}:ahead"
AHEAD_TTL_MS = 2_000
"""A registered request counts at most this long unpublished (a loop turn and a round trip is
the usual; a gateway that died leaves its entries this long)."""

# KEYS: the load hash, the order (zset), the entries (hash), the counter. ARGV: this gateway's
# id, the request's id, its routing inputs, the entries' bound (ms).
# Returns {Redis ms, 1 when any request was ahead, [id, entry, ...] ahead in order, HGETALL of
# the load hash}.
REGISTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
local out = {}
local ids = redis.call('ZRANGE', KEYS[2], 0, -1)
for _, id in ipairs(ids) do
  local v = redis.call('HGET', KEYS[3], id)
  local bar = v and string.find(v, '|', 1, true)
  local stamp = bar and tonumber(string.sub(v, 1, bar - 1))
  if not stamp or now - stamp > ttl then
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
  else
    out[#out + 1] = id
    out[#out + 1] = string.sub(v, bar + 1)
  end
end
local had = 0
if #out > 0 then had = 1 end
local seq = redis.call('INCR', KEYS[4])
redis.call('ZADD', KEYS[2], seq, ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], now .. '|' .. ARGV[1] .. '|' .. had .. '|' .. ARGV[3])
for j = 2, 4 do redis.call('PEXPIRE', KEYS[j], ttl * 4) end
return {now, had, out, redis.call('HGETALL', KEYS[1])}
"""

# KEYS: the load hash, the order, the entries. ARGV: this gateway's id, its stamped figures,
# then the ids of the requests it decided since its last write.
PUBLISH = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
for j = 3, #ARGV do
  redis.call('ZREM', KEYS[2], ARGV[j])
  redis.call('HDEL', KEYS[3], ARGV[j])
end
return #ARGV - 2
"""


def ahead_keys(key: bytes = AHEAD_KEY) -> tuple[bytes, bytes, bytes]:
    """The order, the entries, the counter: one slot with the load hash."""
    return key, key + b":d", key + b":n"


def encode_route(req: RouteRequest) -> bytes:
    """What a peer needs to decide `req` as its gateway does (adapters aside: a peer cannot
    read them, and ties by id do not)."""
    return orjson.dumps(
        [
            req.num_blocks,
            req.num_prompt_tokens,
            dict(req.overlap),
            req.tokens_per_block,
            req.affinity_key.hex(),
            req.decode_token_weight,
            dict(req.offloaded),
            req.offload_cost,
            req.home,
            req.home_blocks,
            dict(req.claimed),
            dict(req.committed),
            req.peers,
            req.peer_rank,
        ]
    )


def decode_route(blob: bytes) -> RouteRequest | None:
    """`encode_route`'s request, or None when it cannot be read (another version's)."""
    try:
        (
            blocks,
            tokens,
            overlap,
            per_block,
            key,
            weight,
            offloaded,
            cost,
            home,
            home_blocks,
            claimed,
            committed,
            peers,
            rank,
        ) = orjson.loads(blob)
        return RouteRequest(
            num_blocks=int(blocks),
            num_prompt_tokens=float(tokens),
            overlap=_counts(overlap),
            tokens_per_block=float(per_block),
            affinity_key=bytes.fromhex(key),
            decode_token_weight=float(weight),
            offloaded=_counts(offloaded),
            offload_cost=float(cost),
            home=None if home is None else str(home),
            home_blocks=int(home_blocks),
            claimed=_counts(claimed),
            committed=_counts(committed),
            peers=int(peers),
            peer_rank=int(rank),
        )
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None


def _counts(value: Mapping[str, Any]) -> dict[str, int]:
    return {str(k): int(v) for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class Registered:
    """One request ahead as Redis listed it."""

    id: str
    gateway: str
    had: bool
    """It had any ahead when it registered (decided with ties by id)."""
    req: RouteRequest


def parse_entries(flat: list[Any]) -> tuple[list[Registered], int]:
    """`REGISTER`'s list ([id, entry, ...]) and how many entries were unreadable (skipped)."""
    out: list[Registered] = []
    malformed = 0
    for rid, value in zip(flat[::2], flat[1::2], strict=True):
        gateway, _, rest = bytes(value).partition(b"|")
        had, _, blob = rest.partition(b"|")
        req = decode_route(blob)
        if req is None:
            malformed += 1
            continue
        name = rid.decode() if isinstance(rid, bytes) else str(rid)
        out.append(Registered(name, gateway.decode(), had == b"1", req))
    return out, malformed
