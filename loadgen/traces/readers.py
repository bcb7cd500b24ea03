"""Request traces: the Mooncake FAST'25 JSONL format (prompts for them: `loadgen.traces.synthesis`).

A trace line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}` where hash id i names the whole prefix up to the end of block i (blocks of
`block_size` tokens, 512 in Mooncake's files; the last block is usually partial, and
len(hash_ids) == ceil(input_length / block_size)). Equal ids mean the same reusable KV.

Tenants (optional): a conversation is named by its first two hash ids (every conversation-trace
request shares block 0, the system prompt), and hashed to one of `num_tenants` tenants, so a
conversation never changes tenant.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import mmh3
import orjson

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake FAST'25 traces."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `arrival_s` is relative to the first request read."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None


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


def _field(obj: dict[str, object], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: '{name}' must be a non-negative number, got {value!r}")
    return int(value)


def parse_line(line: bytes | str, block_size: int, index: int, where: str) -> TraceRequest:
    """One JSONL line; `where` names it in errors (file:line)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{where}: malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    timestamp = obj.get("timestamp")
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise ValueError(f"{where}: 'timestamp' (milliseconds) must be a number")
    input_length = _field(obj, "input_length", where)
    output_length = _field(obj, "output_length", where)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    expected = math.ceil(input_length / block_size)
    if len(hash_ids) != expected:
        raise ValueError(
            f"{where}: {len(hash_ids)} hash_ids for {input_length} input tokens do not match "
            f"blocks of {block_size} tokens (expected {expected}); pass the trace's block size"
        )
    return TraceRequest(index, timestamp / 1000.0, input_length, output_length, tuple(hash_ids))


def conversation_key(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """A conversation's name: its first two hash ids (block 0 is shared by everyone)."""
    return tuple(hash_ids[:2])


def tenant_of(hash_ids: Sequence[int], num_tenants: int) -> str:
    key = ",".join(map(str, conversation_key(hash_ids))).encode()
    return f"tenant-{mmh3.hash(key, signed=False) % num_tenants}"


def read_trace(
    path: str | Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    start: int = 0,
    limit: int | None = None,
    num_tenants: int = 0,
) -> Trace:
    """Requests `start` .. `start + limit` (0-based lines) of a JSONL trace, arrivals shifted so
    the first one is at 0 s. `num_tenants` > 0 assigns each conversation to a tenant."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start < 0 or (limit is not None and limit < 0):
        raise ValueError("start and limit must be non-negative")
    if num_tenants < 0:
        raise ValueError(f"num_tenants must be non-negative, got {num_tenants}")
    path = Path(path)
    requests: list[TraceRequest] = []
    with path.open("rb") as f:
        stop = None if limit is None else start + limit
        for lineno, line in enumerate(itertools.islice(f, start, stop), start=start + 1):
            if not line.strip():
                continue
            req = parse_line(line, block_size, len(requests), f"{path}:{lineno}")
            if num_tenants:
                req = replace(req, tenant=tenant_of(req.hash_ids, num_tenants))
            requests.append(req)
    if requests:
        t0 = requests[0].arrival_s
        requests = [replace(r, arrival_s=r.arrival_s - t0) for r in requests]
    for a, b in itertools.pairwise(requests):
        if b.arrival_s < a.arrival_s:
            raise ValueError(f"{path}: timestamps must be non-decreasing (request {b.index})")
    return Trace(path.name, block_size, requests)


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """The same JSONL format (tenants are not written: they are an assignment, not data)."""
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
