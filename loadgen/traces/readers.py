"""Request traces: the public JSONL formats, read into one `Trace` of `TraceRequest`s.

Every format names a request's prompt by `hash_ids`: hash id i names the whole prefix up to the
end of block i (blocks of the trace's block size); equal ids mean the same reusable KV.

- **Mooncake** (FAST'25; `MOONCAKE_BLOCK_SIZE` 512): one line per request,
  `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`.
- **Qwen-Bailian** (Alibaba's anonymised Qwen usage traces; `BAILIAN_BLOCK_SIZE` 16): one line
  per request, `{"chat_id": int, "parent_chat_id": int (-1 for a conversation's first turn),
  "timestamp": seconds, "input_length", "output_length", "type": "text" | "search" | ...,
  "turn": int, "hash_ids": [...]}` — salted block hashes, so ids never collide across users.
  A conversation is the chain of `parent_chat_id`s back to its root.
- **Agent sessions** (`loadgen.traces.agent`): one JSON document per session.

The hash ids cover either every block, the last one usually partial (len == ceil(input /
block)), or only the full blocks (len == floor(input / block)): a tail no id names can never
hit. Anything else is refused with the line, the numbers and the block size in the message.

Tenants (optional): each conversation is hashed to one of `num_tenants` tenants, so it never
changes tenant. A Mooncake conversation is named by its first two hash ids (every
conversation-trace request shares block 0, the system prompt); a Bailian one by its root chat
id; an agent session by its file and place.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mmh3
import orjson

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake FAST'25 traces."""
BAILIAN_BLOCK_SIZE = 16
"""Tokens per hash id in the Qwen-Bailian traces (`qwen_trace*_blksz_16.jsonl`)."""
FORMATS = ("mooncake", "bailian", "agent")
_MAX_HASH_ID = 2**63 - 1
"""Hash ids are packed as unsigned 64-bit words by the simulator; the traces' ids are far below."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `arrival_s` is relative to the first request read."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None
    conversation: str | None = None
    """What tenants are assigned by (None: the first two hash ids, Mooncake's convention)."""


@dataclass(frozen=True)
class Trace:
    name: str
    block_size: int
    requests: list[TraceRequest]

    def unique_blocks(self) -> int:
        """Distinct KV blocks: (tenant, hash id) pairs, since tenants never share KV."""
        return len({(r.tenant, h) for r in self.requests for h in r.hash_ids})

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def tenants(self) -> list[str]:
        return sorted({r.tenant for r in self.requests if r.tenant is not None})


def number(obj: dict[str, Any], name: str, where: str, *, minimum: float = 0) -> float:
    value = obj.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}: '{name}' must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def count(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: '{name}' must be a non-negative number, got {value!r}")
    return int(value)


def hash_ids_of(
    obj: dict[str, Any], input_length: int, block_size: int, where: str, *, key: str = "hash_ids"
) -> tuple[int, ...]:
    """`obj[key]` when it is a list of hash ids covering the input's blocks (every block, or
    only the full ones: see the module docstring)."""
    hash_ids = obj.get(key)
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MAX_HASH_ID for h in hash_ids
    ):
        raise ValueError(f"{where}: '{key}' must be a list of non-negative 64-bit integers")
    every, full = math.ceil(input_length / block_size), input_length // block_size
    if len(hash_ids) not in (every, full):
        expected = str(every) if every == full else f"{every}, or {full} for full blocks only"
        raise ValueError(
            f"{where}: {len(hash_ids)} {key} for {input_length} input tokens do not match "
            f"blocks of {block_size} tokens (expected {expected}); pass the trace's block size"
        )
    return tuple(hash_ids)


def _object(line: bytes | str, where: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{where}: malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    return obj


def parse_line(line: bytes | str, block_size: int, index: int, where: str) -> TraceRequest:
    """One Mooncake JSONL line; `where` names it in errors (file:line)."""
    obj = _object(line, where)
    timestamp = obj.get("timestamp")
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise ValueError(f"{where}: 'timestamp' (milliseconds) must be a number")
    input_length = count(obj, "input_length", where)
    output_length = count(obj, "output_length", where)
    hash_ids = hash_ids_of(obj, input_length, block_size, where)
    return TraceRequest(index, timestamp / 1000.0, input_length, output_length, hash_ids)


def parse_bailian_line(
    line: bytes | str, block_size: int, index: int, where: str
) -> tuple[TraceRequest, int, int]:
    """One Qwen-Bailian JSONL line: the request (its conversation not yet resolved), its
    chat_id and its parent_chat_id."""
    obj = _object(line, where)
    ids = []
    for name in ("chat_id", "parent_chat_id", "turn"):
        value = obj.get(name, 1 if name == "turn" else None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: '{name}' must be an integer, got {value!r}")
        ids.append(value)
    chat_id, parent, turn = ids
    if chat_id < 0 or parent < -1 or turn < 1:
        raise ValueError(
            f"{where}: chat_id must be >= 0, parent_chat_id >= -1 (a first turn) and turn >= 1"
        )
    kind = obj.get("type", "text")
    if not isinstance(kind, str):
        raise ValueError(f"{where}: 'type' must be a string, got {kind!r}")
    arrival = number(obj, "timestamp", where)  # seconds, unlike Mooncake's milliseconds
    input_length = count(obj, "input_length", where)
    output_length = count(obj, "output_length", where)
    hash_ids = hash_ids_of(obj, input_length, block_size, where)
    request = TraceRequest(index, arrival, input_length, output_length, hash_ids)
    return request, chat_id, parent


def conversation_key(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """A Mooncake conversation's name: its first two hash ids (block 0 is shared by everyone)."""
    return tuple(hash_ids[:2])


def _tenant(key: str, num_tenants: int) -> str:
    return f"tenant-{mmh3.hash(key.encode(), signed=False) % num_tenants}"


def tenant_of(hash_ids: Sequence[int], num_tenants: int) -> str:
    return _tenant(",".join(map(str, conversation_key(hash_ids))), num_tenants)


def assign_tenants(requests: Sequence[TraceRequest], num_tenants: int) -> list[TraceRequest]:
    """Each request with the tenant of its conversation (unchanged when `num_tenants` is 0)."""
    if num_tenants <= 0:
        return list(requests)
    return [
        replace(
            r,
            tenant=_tenant(r.conversation, num_tenants)
            if r.conversation is not None
            else tenant_of(r.hash_ids, num_tenants),
        )
        for r in requests
    ]


def detect_format(path: Path) -> str:
    """The format of the trace at `path`, from its first non-empty line (or whole document).
    A first line that is not a JSON object reads as Mooncake, whose reader names what is wrong
    with it; an object with none of the formats' keys is refused here."""
    with path.open("rb") as f:
        first = next((line for line in f if line.strip()), b"")
    try:
        obj = orjson.loads(first)
    except orjson.JSONDecodeError:
        try:  # a pretty-printed document: an agent session
            obj = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            return "mooncake"
    if not isinstance(obj, dict):
        return "mooncake"
    if "requests" in obj:
        return "agent"
    if "chat_id" in obj or "parent_chat_id" in obj:
        return "bailian"
    if obj.keys() & {"timestamp", "input_length", "output_length", "hash_ids"}:
        return "mooncake"
    raise ValueError(
        f"{path}: not a trace in a known format ({', '.join(FORMATS)}): expected JSON lines with "
        "timestamp/input_length/output_length/hash_ids (Mooncake), with chat_id/parent_chat_id "
        "too (Qwen-Bailian), or session documents with block_size and requests (agent); the "
        f"first has the keys {', '.join(sorted(obj)) or 'none'}"
    )


def _check_start_limit(block_size: int | None, start: int, limit: int | None, tenants: int) -> None:
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start < 0 or (limit is not None and limit < 0):
        raise ValueError("start and limit must be non-negative")
    if tenants < 0:
        raise ValueError(f"num_tenants must be non-negative, got {tenants}")


def read_trace(
    path: str | Path,
    *,
    block_size: int | None = None,
    start: int = 0,
    limit: int | None = None,
    num_tenants: int = 0,
    fmt: str = "auto",
) -> Trace:
    """Requests `start` .. `start + limit` (0-based lines; for agent sessions, 0-based requests
    in arrival order) of a trace, arrivals shifted so the first one is at 0 s. `path` may also
    be agent session files merged at offsets, "a.json@0,b.json@30" (seconds). `block_size`
    None: the format's own (512 Mooncake, 16 Bailian, the documents' for agent sessions).
    `fmt`: "auto" (detected) or one of `FORMATS`. `num_tenants` > 0 assigns each conversation
    to a tenant. `path` "agent-sessions[:options]" builds the simulator's many concurrent agent
    sessions (`loadgen.traces.sessions`) instead of reading a file."""
    _check_start_limit(block_size, start, limit, num_tenants)
    if isinstance(path, str) and path.startswith("agent-sessions") and not Path(path).exists():
        # many concurrent agent sessions, as `kvgate sim` builds them (loadgen.traces.sessions)
        from loadgen.traces.sessions import agent_sessions_trace

        built = agent_sessions_trace(path)
        if block_size is not None and block_size != built.block_size:
            raise ValueError(
                f"{path}: its blocks are {built.block_size} tokens; set block=N in the spec"
            )
        picked = built.requests[start : None if limit is None else start + limit]
        sliced = assign_tenants([replace(r, index=i) for i, r in enumerate(picked)], num_tenants)
        return Trace(built.name, built.block_size, _shifted(sliced))
    if isinstance(path, str) and ("@" in path or "," in path) and not Path(path).exists():
        fmt = "agent"  # session files merged at offsets: "a.json@0,b.json@30"
    elif fmt == "auto":
        fmt = detect_format(Path(path))
    if fmt == "agent":
        from loadgen.traces.agent import parse_sources, read_agent_sessions

        sources = parse_sources(path) if isinstance(path, str) else [(path, 0.0)]
        trace = read_agent_sessions(sources, block_size=block_size)
        picked = trace.requests[start : None if limit is None else start + limit]
        sliced = assign_tenants([replace(r, index=i) for i, r in enumerate(picked)], num_tenants)
        return Trace(trace.name, trace.block_size, _shifted(sliced))
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; use auto or one of {', '.join(FORMATS)}")
    bailian = fmt == "bailian"
    block = block_size or (BAILIAN_BLOCK_SIZE if bailian else MOONCAKE_BLOCK_SIZE)
    requests: list[TraceRequest] = []
    roots: dict[int, int] = {}
    with path.open("rb") as f:
        stop = None if limit is None else start + limit
        for lineno, line in enumerate(itertools.islice(f, start, stop), start=start + 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            if bailian:
                req, chat_id, parent = parse_bailian_line(line, block, len(requests), where)
                # a parent outside the slice read: its id still names the conversation
                roots[chat_id] = chat_id if parent < 0 else roots.get(parent, parent)
                req = replace(req, conversation=f"bailian/{roots[chat_id]}")
            else:
                req = parse_line(line, block, len(requests), where)
            requests.append(req)
    requests = _shifted(assign_tenants(requests, num_tenants))
    for a, b in itertools.pairwise(requests):
        if b.arrival_s < a.arrival_s:
            raise ValueError(f"{path}: timestamps must be non-decreasing (request {b.index})")
    return Trace(path.name, block, requests)


def _shifted(requests: list[TraceRequest]) -> list[TraceRequest]:
    if not requests:
        return requests
    t0 = requests[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in requests]


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """The Mooncake format (tenants are not written: they are an assignment, not data)."""
    with Path(path).open("wb") as f:
        for r in requests:
            f.write(
                orjson.dumps(
                    {
                        "timestamp": round(r.arrival_s * 1000),
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + b"\n"
            )


HOT_SPINE_DEFAULTS = {"rate": 60.0, "seconds": 30.0, "system": 4000, "suffix": 300, "output": 8}
HOT_SPINE_BLOCK_SIZE = 16
WARM_UP_S = 1.0


def hot_spine_trace(spec: str = "hot-spine") -> Trace:
    """A hot spine as a trace: requests at `rate` per second for `seconds`, all sharing a
    `system`-token prefix (the same hash ids) followed by `suffix` tokens of their own, with
    `output` output tokens each; vLLM-sized 16-token blocks. One request comes first, alone, and
    the rest a second later, so one replica holds the spine when the load starts (as in
    production, where a spine turns hot after it was cached). `spec` is "hot-spine" or
    "hot-spine:rate=60,seconds=30,system=4000,suffix=300,output=8" (any subset)."""
    values: dict[str, float] = dict(HOT_SPINE_DEFAULTS)
    _, _, options = spec.partition(":")
    for item in filter(None, options.split(",")):
        name, _, value = item.partition("=")
        if name not in values:
            raise ValueError(
                f"hot-spine option {name!r} unknown; use {', '.join(HOT_SPINE_DEFAULTS)}"
            )
        values[name] = float(value)
    if values["rate"] <= 0 or values["seconds"] <= 0 or values["system"] < HOT_SPINE_BLOCK_SIZE:
        raise ValueError("hot-spine needs rate > 0, seconds > 0 and a system prompt of a block")
    bs = HOT_SPINE_BLOCK_SIZE
    system, suffix, output = int(values["system"]), int(values["suffix"]), int(values["output"])
    shared = system // bs
    per_request = -(-(system + suffix) // bs) - shared
    requests = []
    for i in range(int(values["rate"] * values["seconds"])):
        own = range(shared + i * per_request, shared + (i + 1) * per_request)
        arrival = 0.0 if i == 0 else WARM_UP_S + (i - 1) / values["rate"]
        requests.append(TraceRequest(i, arrival, system + suffix, output, (*range(shared), *own)))
    return Trace(spec, bs, requests)
