"""Agent traces: one JSON document per session, many sessions merged into one stream.

A session document:

    {"block_size": 64, "requests": [ENTRY, ...]}        ("session_id" optional: a name)

where an ENTRY is either a request,

    {"t": seconds since the session started, "in": tokens, "out": tokens, "hash_ids": [...]}

(`"type": "request"` optional; the hash ids cover full blocks only, len == floor(in /
block_size), so a request's tail can never hit), or a sub-agent,

    {"type": "subagent", "t": seconds since the session started, "requests": [ENTRY, ...]}

whose entries' `t` count from the sub-agent's own start (a nested sub-agent's from its own).
So a request's arrival is offset(session) + Σ t along its path of sub-agents + its own t.

A file holds one document (pretty-printed or not) or one document per line. `read_agent_sessions`
places each file's sessions at the offset given for the file and merges them into one trace in
arrival order (ties keep file, then document order). Every session must have the same block
size. A session's requests share one conversation, sub-agents included (they are one agent's
work, so they go to one tenant).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadgen.traces.readers import Trace, TraceRequest, count, hash_ids_of, number

AGENT_BLOCK_SIZE = 64
"""The block size agent traces are published with."""
_MAX_DEPTH = 16
"""Sub-agents nested deeper than this are refused (a cycle in a generated file, not an agent)."""


def _entries(
    entries: Any, start_s: float, block_size: int, where: str, depth: int
) -> list[tuple[float, int, int, tuple[int, ...]]]:
    if not isinstance(entries, list):
        raise ValueError(f"{where}: 'requests' must be a list of entries")
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: sub-agents nested more than {_MAX_DEPTH} deep")
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    for i, entry in enumerate(entries):
        here = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{here}: an entry must be an object (a request or a sub-agent)")
        kind = entry.get("type", "request")
        t = start_s + number(entry, "t", here)
        if kind == "subagent":
            inner = entry.get("requests")
            out.extend(_entries(inner, t, block_size, here + ".requests", depth + 1))
        elif kind == "request":
            input_length = count(entry, "in", here)
            hash_ids = hash_ids_of(entry, input_length, block_size, here)
            if len(hash_ids) != input_length // block_size:
                raise ValueError(
                    f"{here}: {len(hash_ids)} hash_ids for {input_length} input tokens: an agent "
                    f"trace hashes full blocks only ({input_length // block_size} of {block_size})"
                )
            out.append((t, input_length, count(entry, "out", here), hash_ids))
        else:
            raise ValueError(f"{here}: 'type' {kind!r} unknown; use 'request' or 'subagent'")
    return out


def parse_session(
    doc: Any, where: str
) -> tuple[int, list[tuple[float, int, int, tuple[int, ...]]]]:
    """A session document: its block size and its requests as (seconds since the session
    started, input tokens, output tokens, hash ids), in document order."""
    if not isinstance(doc, dict) or "requests" not in doc:
        raise ValueError(f"{where}: a session is an object with 'block_size' and 'requests'")
    block_size = doc.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"{where}: 'block_size' must be a positive integer, got {block_size!r}")
    return block_size, _entries(doc["requests"], 0.0, block_size, where + ".requests", 0)


def _documents(path: Path) -> list[tuple[str, Any]]:
    data = path.read_bytes()
    try:
        return [(str(path), orjson.loads(data))]
    except orjson.JSONDecodeError:
        pass
    docs = []
    for lineno, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            try:
                docs.append((f"{path}:{lineno}", orjson.loads(line)))
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: malformed JSON: {exc}") from None
    return docs


def parse_sources(spec: str) -> list[tuple[Path, float]]:
    """`"a.json@0,b.json@12.5"` (offsets in seconds, 0 when left out) as (path, offset) pairs."""
    sources = []
    for part in filter(None, spec.split(",")):
        name, _, offset = part.rpartition("@") if "@" in part else (part, "", "0")
        try:
            value = float(offset)
        except ValueError:
            raise ValueError(f"{part!r}: the offset after '@' must be seconds") from None
        if value < 0:
            raise ValueError(f"{part!r}: a session's offset must be non-negative")
        sources.append((Path(name), value))
    if not sources:
        raise ValueError("give at least one session file (PATH[@OFFSET_S],...)")
    return sources


def read_agent_sessions(
    sources: Sequence[tuple[str | Path, float]], *, block_size: int | None = None
) -> Trace:
    """The sessions of every (file, offset) merged into one trace in arrival order, times as
    given (offset + time in the session; the caller shifts them when it slices)."""
    rows: list[tuple[float, int, int, int, int, int, tuple[int, ...], str]] = []
    block: int | None = block_size
    for f, (path, offset) in enumerate(sources):
        path = Path(path)
        for d, (where, doc) in enumerate(_documents(path)):
            size, requests = parse_session(doc, where)
            if block is not None and size != block:
                raise ValueError(
                    f"{where}: block_size {size} differs from the trace's {block}; "
                    "merge only sessions hashed with the same block size"
                )
            block = size
            name = doc.get("session_id")
            conversation = f"agent/{name}" if isinstance(name, str) else f"agent/{where}/{d}"
            for k, (t, input_length, output_length, hash_ids) in enumerate(requests):
                row = (offset + t, f, d, k, input_length, output_length, hash_ids, conversation)
                rows.append(row)
    rows.sort(key=lambda row: row[:4])
    requests_out = [
        TraceRequest(i, t, input_length, output_length, hash_ids, conversation=conversation)
        for i, (t, _, _, _, input_length, output_length, hash_ids, conversation) in enumerate(rows)
    ]
    name = "+".join(Path(p).name for p, _ in sources)
    return Trace(name, block or AGENT_BLOCK_SIZE, requests_out)
