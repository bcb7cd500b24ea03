"""A billed gateway as the chaos scenarios run it, and one request to it judged from outside.

The client's view is the only truth about what was delivered: a response is `completed` when
the client read all of it (a streamed one: its usage with the billing record's id, then
`[DONE]`, no error event); `cut` when it had read part of a body and no more came (a stream cut
mid-body: the gateway owes it a record — its aborted one, or its own when the cut came after
that record's write; the id is known when the usage arrived before the cut); `refused` when
none of the answer arrived (an error status, or a stream whose only event is an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import orjson
import yaml

from loadgen.engine.server import DEFAULT_MODEL
from loadgen.harness import processes
from loadgen.text import words

KEY = "sk-chaos"
TENANT = "acme"


def billed_config(path: Path, wal_dir: Path, **extra: object) -> Path:
    """A gateway config with billing on (a WAL in `wal_dir`), one tenant, `extra` settings."""
    settings = {
        "tenants": [f"{TENANT}:{KEY}"],
        "server_secret": "chaos",
        "billing_wal_dir": str(wal_dir),
        "billing_model_map": {DEFAULT_MODEL: "gpt-5.6"},
        **extra,
    }
    path.write_text(yaml.safe_dump(settings))
    return path


def start_billed(port: int, engines: list[str], config: Path) -> processes.Proc:
    args = ["--config", str(config), "--log-level", "error"]
    proc = processes.start_gateway(port, engines, args)
    processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
    return proc


INSPECT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WalContents:
    """What a WAL directory holds, as `kvgate billing inspect` reads it with the gateway's own
    reader: every record's (id, status) in write order, duplicates kept, and the open entries
    no record settles."""

    records: list[tuple[str, str]]
    unsettled: list[str]


def wal_contents(wal_dir: Path) -> WalContents:
    out = processes.run_kvgate(["billing", "inspect", "--wal-dir", str(wal_dir)], INSPECT_TIMEOUT_S)
    found = orjson.loads(out)
    return WalContents([(str(i), str(s)) for i, s in found["records"]], found["unsettled"])


@dataclass(frozen=True)
class Billed:
    outcome: Literal["completed", "cut", "refused"]
    record_id: str | None = None
    status: int = 0
    error: str = ""
    """The code of the error the client was given (a 4xx/5xx body's, a stream's error event)."""


def billed_request(url: str, key: str, i: int, max_tokens: int = 16) -> Billed:
    """Request `i` (even: streamed, odd: not), its outcome as the client saw it."""
    stream = i % 2 == 0
    body = {
        "model": DEFAULT_MODEL,
        "messages": [
            {"role": "system", "content": words("durable", 1500)},
            {"role": "user", "content": f"request {i}"},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    headers = {"authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(30, connect=5)
    try:
        if not stream:
            r = httpx.post(
                url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout
            )
            if r.status_code != 200:
                return Billed("refused", status=r.status_code, error=_code(r.content))
            return Billed("completed", str(r.json()["usage"]["kvgate_billing"]["id"]), 200)
        return _streamed(url, body, headers, timeout)
    except httpx.TransportError:
        return Billed("refused")


def _streamed(
    url: str, body: dict[str, object], headers: dict[str, str], timeout: httpx.Timeout
) -> Billed:
    record_id, done, error, seen = None, False, "", False
    try:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout
        ) as r:
            if r.status_code != 200:
                return Billed("refused", status=r.status_code, error=_code(r.read()))
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    # part of the body: a chunk of the answer (an error event alone is none)
                    seen = seen or "choices" in chunk
                    error = error or _code(line[6:].encode())
                    if chunk.get("usage"):
                        record_id = chunk["usage"]["kvgate_billing"]["id"]
    except httpx.TransportError:
        pass
    if done and record_id is not None and not error:
        return Billed("completed", record_id, 200)
    if seen:  # a usage read before the cut names the record it is billed by
        return Billed("cut", record_id, status=200, error=error)
    return Billed("refused", status=200, error=error)


def _code(body: bytes) -> str:
    """The `error.code` of a JSON body or event, "" when it has none."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return str(error.get("code") or "") if isinstance(error, dict) else ""
