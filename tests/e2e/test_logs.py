"""The gateway's logs, read from a real `kvgate serve`'s stderr: one format (JSON here, every
line), a start-up line, an access line per exchange with its numbers and nothing secret, a
failed key by its hash prefix; and replica health changes at WARNING."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.request.tenant import hash_key
from loadgen.harness.processes import STARTUP_TIMEOUT_S, free_port, wait_ready
from tests.conftest import MODEL
from tests.servers import Served, serve, wait_until

pytestmark = pytest.mark.e2e
KEY = "sk-logs-acme"
WRONG_KEY = "sk-not-a-key-of-anyone"
PROMPT = "the secret prompt words zebra quartz"


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def json_gateway(
    tmp_path: Path, start_engines: Callable[..., list[Served]]
) -> Iterator[tuple[str, Path]]:
    (engine,) = start_engines(1)
    port, stderr = free_port(), tmp_path / "stderr"
    args = ["serve", "--port", str(port), "--engine", engine.url, "--tenant", f"acme:{KEY}"]
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate_cli", *args, "--log-format", "json"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "KVGATE_METRICS_PORT": str(free_port())},
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/readyz", proc, STARTUP_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}", stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_one_json_format_a_start_up_line_and_an_access_line(json_gateway: tuple[str, Path]) -> None:
    url, stderr = json_gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    answer = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code == 200
    refused = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {WRONG_KEY}"}
    )
    assert refused.status_code == 401
    wait_until(  # the refusal's access line comes after its warning: wait for both exchanges'
        lambda: (
            {e.get("status") for e in log_lines(stderr) if e["logger"] == "kvgate.access"}
            >= {200, 401}
            and "authentication failed" in stderr.read_text()
        ),
        what="the access and authentication lines",
    )
    entries = log_lines(stderr)  # every line parses as JSON: uvicorn's too
    (start,) = [e for e in entries if "serving on" in e["message"]]
    assert f"{url}," in start["message"] and "policy cache_aware" in start["message"]
    assert "keying approximate" in start["message"] and "billing off" in start["message"]
    (access,) = [e for e in entries if e["logger"] == "kvgate.access" and e.get("tenant")]
    usage = answer.json()["usage"]
    assert access["request_id"] == answer.headers["x-request-id"]
    assert access["response_id"] == answer.json()["id"]
    assert (access["tenant"], access["model"], access["status"]) == ("acme", MODEL, 200)
    assert access["prompt_tokens"] == usage["prompt_tokens"]
    assert access["completion_tokens"] == usage["completion_tokens"] == 4
    assert access["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert access["replica"].startswith("http://127.0.0.1:")
    assert 0 < access["ttft_ms"] <= access["duration_ms"]
    (refusal,) = [e for e in entries if e["logger"] == "kvgate.access" and e["status"] == 401]
    assert (refusal["method"], refusal["path"]) == ("POST", "/v1/chat/completions")
    assert refusal["duration_ms"] >= 0 and "tenant" not in refusal
    (failed,) = [e for e in entries if "authentication failed" in e["message"]]
    assert failed["level"] == "WARNING" and hash_key(WRONG_KEY)[:12] in failed["message"]
    text = stderr.read_text()
    for secret in (KEY, WRONG_KEY, "zebra", answer.json()["choices"][0]["message"]["content"]):
        assert secret not in text


def test_replica_health_changes_are_warnings(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = start_engines(2)
    start_gateway(engines)
    caplog.set_level(logging.INFO)
    app, port = engines[0].app, engines[0].port
    engines[0].stop()
    wait_until(lambda: "marked down" in caplog.text, what="the replica marked down")
    with serve(app, port):  # the same engine, back on its port
        wait_until(lambda: "is back up" in caplog.text, what="the replica back up")
        changes = [
            r for r in caplog.records if "marked down" in r.message or "back up" in r.message
        ]
        assert len(changes) == 2 and all(r.levelno == logging.WARNING for r in changes)
