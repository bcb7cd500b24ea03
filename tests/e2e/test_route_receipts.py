"""The route receipt (gateway.request.receipt): a tenant the operator gave `route_receipts`
sees why its request went where it went, in `x-kvgate-route`; another tenant sees nothing of
it; the access log carries the same fields for every exchange."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tenancy.tenant_file import add_key
from loadgen.text import words
from tests.conftest import MODEL
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e


def receipt(answer: httpx.Response) -> dict[str, str]:
    return dict(field.split("=", 1) for field in answer.headers["x-kvgate-route"].split(" "))


def test_a_tenant_given_receipts_sees_why_and_another_sees_nothing(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = start_engines(3)
    tenants = tmp_path / "tenants.yaml"
    shown, _, _ = add_key(tenants, "shown", route_receipts=True)
    hidden, _, _ = add_key(tenants, "hidden")
    gateway = start_gateway(engines, tenants_file=tenants, debug_headers=False)
    messages = [{"role": "user", "content": words("receipt", 600)}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}

    def ask(key: str) -> httpx.Response:
        r = httpx.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        return r

    caplog.set_level(logging.INFO, logger="kvgate.access")
    first = receipt(ask(shown))
    assert (first["policy"], first["reason"]) == ("cache_aware", "no_match")
    matched, total = (int(n) for n in first["matched"].split("/"))
    assert matched == 0 and total > 0
    second = ask(shown)  # the same prompt: its prefix is where the first went
    again = receipt(second)
    assert (again["reason"], again["replica"]) == ("prefix", first["replica"])
    assert again["matched"] == f"{total}/{total}"
    assert again["runner_up"] != again["replica"] and again["runner_up_matched"] == "0"
    assert float(again["score"]) > float(again["runner_up_score"])
    other = ask(hidden)
    assert not [h for h in other.headers if h.startswith("x-kvgate")]
    assert other.headers["x-request-id"].startswith("req_")

    def access_line() -> dict[str, Any] | None:  # logged when the exchange ends: wait for it
        for r in caplog.records:
            fields: dict[str, Any] = r.__dict__.get("fields", {})
            if (
                r.name == "kvgate.access"
                and fields.get("request_id") == second.headers["x-request-id"]
            ):
                return fields
        return None

    wait_until(lambda: access_line() is not None, what="the second answer's access line")
    fields = access_line()
    assert fields is not None
    assert (fields["policy"], fields["reason"]) == ("cache_aware", "prefix")
    assert fields["matched"] == again["matched"]
    assert fields["runner_up"] == again["runner_up"] and "decided" not in fields
