"""Bearer auth on the admin port (issue 45 item 13): with `admin_port_auth` every route of it —
/metrics (every tenant's token counts), the API documents, the reset — takes an `admin_keys`
key, and answers 401 without one; without the setting only the reset does."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from pydantic import ValidationError

from gateway.settings import load_settings
from tests.conftest import TENANT_KEY, metrics_url
from tests.servers import Served

pytestmark = pytest.mark.e2e

ADMIN_KEY = "sk-admin-port"
READS = ("/metrics", "/docs", "/redoc", "/openapi.json")


def test_every_admin_route_takes_an_admin_key_when_the_port_is_guarded(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1), admin_port_auth=True, admin_keys=[ADMIN_KEY])
    admin = metrics_url(gateway)
    for headers in ({}, {"authorization": f"Bearer {TENANT_KEY}"}, {"authorization": "Bearer x"}):
        for path in READS:
            r = httpx.get(admin + path, headers=headers)
            assert r.status_code == 401, (path, headers, r.status_code)
            assert "kvgate_" not in r.text and "admin key" in r.json()["error"]
        assert httpx.head(admin + "/metrics", headers=headers).status_code == 401
        assert httpx.post(admin + "/reset_prefix_cache", headers=headers).status_code == 401
    key = {"authorization": f"Bearer {ADMIN_KEY}"}
    scraped = httpx.get(admin + "/metrics", headers=key)
    assert scraped.status_code == 200 and "kvgate_tenant_tokens" in scraped.text
    for path in READS[1:]:
        assert httpx.get(admin + path, headers=key).status_code == 200, path
    assert httpx.post(admin + "/reset_prefix_cache", headers=key).status_code == 200


def test_unguarded_the_reads_are_open_and_the_reset_still_takes_a_key(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1), admin_keys=[ADMIN_KEY])
    admin = metrics_url(gateway)
    assert httpx.get(admin + "/metrics").status_code == 200
    assert httpx.post(admin + "/reset_prefix_cache").status_code == 401


def test_a_guarded_port_without_any_key_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="admin_port_auth needs admin_keys"):
        load_settings(admin_port_auth=True)


def test_the_console_signs_in_with_its_cookie_on_a_guarded_port(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    """The console checks the same keys itself and takes its sign-in cookie (a browser sends
    no bearer key): the port's guard leaves it to do so, and the cookie opens nothing else."""
    gateway = start_gateway(start_engines(1), admin_port_auth=True, admin_keys=[ADMIN_KEY])
    with httpx.Client(base_url=metrics_url(gateway)) as browser:
        page = browser.get("/console")
        assert page.status_code == 401 and "needs an admin key" in page.text
        assert browser.post("/console/login", data={"key": "wrong"}).status_code == 401
        assert browser.post("/console/login", data={"key": ADMIN_KEY}).status_code == 303
        assert browser.get("/console").status_code == 200
        assert browser.get("/console/state.json").status_code == 200
        assert browser.get("/metrics").status_code == 401
