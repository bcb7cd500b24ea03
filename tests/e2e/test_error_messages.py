"""What an error tells a client, and what it must not: no replica URL or engine text in a 502
(they are logged), no model a tenant may not use in a 404, no secret in an invalid-settings
message."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.tenancy.tenant_file import add_key
from kvgate_cli import main
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served

pytestmark = pytest.mark.e2e

AUTH = {"authorization": f"Bearer {TENANT_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENGINE_TEXT = "simulated failure before the first byte"
"""What the simulated engine says in its 500s."""


def test_a_502_names_no_replica_and_no_engine_text_on_any_front_end(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = start_engines(2, fail_first_bytes=100)
    gateway = start_gateway(engines, grpc_port=0)
    caplog.set_level(logging.WARNING)
    answers = [
        httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=AUTH).json()["error"],
        httpx.post(gateway.url + "/v1/messages", json=CHAT, headers=AUTH).json()["error"],
    ]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.app.state.grpc_port}") as channel:
        request = pb.GenerateRequest(
            model=MODEL,
            messages=[pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="x")])],
        )
        with pytest.raises(grpc.RpcError) as info:
            gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, metadata=tuple(AUTH.items()), timeout=30
            )
    error: grpc.RpcError = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    messages = [a["message"] for a in answers] + [error.details()]  # type: ignore[attr-defined]
    for message in messages:
        assert "every attempt at an engine failed" in message
        assert ENGINE_TEXT not in message and "127.0.0.1" not in message, message
        assert not any(e.url in message for e in engines)
    # the operator still has both, in the log
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert ENGINE_TEXT in logged and engines[0].url in logged


def test_model_not_found_lists_only_the_models_the_tenant_may_use(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    engines = start_engines(1) + start_engines(1, model="internal-eval-model")
    tenants = tmp_path / "tenants.yaml"
    boxed, _, _ = add_key(tenants, "boxed", models=[MODEL, "ghost-model"])
    gateway = start_gateway(engines, tenants_file=tenants)
    body = {**CHAT, "model": "ghost-model"}  # allowed, but no replica serves it
    for key, shown, hidden in ((boxed, MODEL, "internal-eval-model"), (TENANT_KEY, None, None)):
        r = httpx.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 404, r.text
        message = r.json()["error"]["message"]
        if hidden is None:  # a tenant without an allow-list may use, and see, every model
            assert MODEL in message and "internal-eval-model" in message
        else:
            assert shown in message and hidden not in message, message


def test_invalid_settings_never_print_a_key_or_a_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_key, password, admin = "sk-very-secret-key-1", "hunter2-redis-password", "sk-admin-7"
    monkeypatch.setenv("KVGATE_ADMIN_KEYS", f'["{admin}"]')
    cases = [
        # a field error beside a tenant key, an error in the Redis URL itself
        ["--tenant", f"bad/name:{secret_key}"],
        ["--tenant", f"acme:{secret_key}", "--redis-url", f"{password}@redis:6379"],
        # a model-level error (pydantic would repeat the whole input)
        ["--tenant", f"acme:{secret_key}", "--discovery", "kubernetes"],
    ]
    for flags in cases:
        status = main(["serve", "--engine", "http://127.0.0.1:9", "--metrics-port", "0", *flags])
        out, err = capsys.readouterr()
        assert status == 2 and "invalid settings" in out, out
        for secret in (secret_key, password, admin):
            assert secret not in out + err, (flags, out)
    # what is wrong is still said, by field
    main(["serve", "--engine", "http://127.0.0.1:9", "--redis-url", f"{password}@redis:6379"])
    out, _ = capsys.readouterr()
    assert "redis_url: Value error, redis_url '***@redis:6379' must start with one of" in out
