"""The console (gateway.server.console) in a real headless Chromium: each page renders with live
data from a running gateway and engines, the charts move as traffic flows, a request is looked up
by its id, a page without the admin key is refused, nothing of it is on the tenants' port, and
no tenant's text appears in any page."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loadgen.harness.browser import Browser, browser
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, metrics_url
from tests.servers import Served

pytestmark = pytest.mark.e2e
ADMIN_KEY = "console-admin-key-0123456789"
SECRET = "zebraquartz"
"""A word in every prompt: it must never appear in a console page."""
PAGES = ("/console", "/console/routing", "/console/tenants", "/console/requests")


def chat(gateway: Served, key: str, turn: int) -> httpx.Response:
    content = words(f"{SECRET}{turn % 3}", 300)
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200, r.text
    return r


@pytest.fixture
def chromium() -> Iterator[Browser]:
    with browser() as b:
        yield b


def polls(b: Browser, more_than: int) -> None:
    b.wait_for(
        f"return Number(document.body.dataset.polls || 0) > {more_than}", what="a state poll"
    )


def test_the_console_shows_the_fleet_routing_tenants_and_a_request(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    chromium: Browser,
    tmp_path: Path,
) -> None:
    gateway = start_gateway(start_engines(3), admin_keys=[ADMIN_KEY])
    admin = metrics_url(gateway)
    first = chat(gateway, TENANT_KEY, 0)
    chat(gateway, OTHER_KEY, 1)

    # refused without the key, and nowhere on the tenants' port
    for path in (*PAGES, "/console/state.json"):
        r = httpx.get(admin + path)
        assert r.status_code == 401, path
        assert "kvgate_" not in r.text and "127.0.0.1" not in r.text and "acme" not in r.text
        assert httpx.get(gateway.url + path).status_code == 404
    assert (
        httpx.get(admin + "/console", headers={"authorization": "Bearer wrong"}).status_code == 401
    )

    # the login form sets the cookie the pages read
    chromium.open(admin + "/console")
    assert "needs an admin key" in chromium.source()
    chromium.type("input[name=key]", ADMIN_KEY)
    chromium.click("button[type=submit]")
    polls(chromium, 0)

    # the fleet: every replica up, with its counters
    rows = chromium.wait_for(
        "const rows = [...document.querySelectorAll('table[data-live=replicas] tbody tr')];"
        "return rows.length === 3 && rows.every(r => r.cells[1].textContent === 'up')"
        " && rows.map(r => r.cells[0].textContent);",
        what="three healthy replicas",
    )
    assert all(r.startswith("http://127.0.0.1:") for r in rows)
    (tmp_path / "fleet.png").write_bytes(chromium.png())

    # routing: the charts grow a point per poll and the decisions count the new traffic
    chromium.open(admin + "/console/routing")
    polls(chromium, 1)
    before = chromium.script(
        "return Number(document.querySelector('[data-chart=decisions]').dataset.points)"
    )
    for turn in range(6):
        chat(gateway, TENANT_KEY, turn)
    chromium.wait_for(
        "const t = [...document.querySelectorAll('table[data-live=decisions] tbody tr')]"
        ".reduce((n, r) => n + Number(r.cells[2].textContent.replace(/,/g, '') || 0), 0);"
        "return t >= 8;",
        what="eight routing decisions",
    )
    after = chromium.wait_for(
        "const n = Number(document.querySelector('[data-chart=decisions]').dataset.points);"
        f"return n > {before} && n;",
        what="the decisions chart moving",
    )
    assert after > before
    hit = chromium.wait_for(
        "const c = document.querySelector('[data-chart=hit] canvas'); return c && c.width;",
        what="the hit-ratio chart drawn",
    )
    assert hit > 0

    # tenants: both, with their tokens
    chromium.open(admin + "/console/tenants")
    tenants = chromium.wait_for(
        "return [...document.querySelectorAll('table[data-live=tenants] tbody tr')]"
        ".map(r => r.cells[0].textContent).join(',')",
        what="the tenants table",
    )
    assert set(tenants.split(",")) == {"acme", "globex"}
    assert "queued now" in chromium.source()  # fair flow control's queue, per tenant

    # a request by the id its answer carried: the receipt and its candidates
    request_id = first.headers["x-request-id"]
    chromium.open(admin + f"/console/requests?id={request_id}")
    receipt = chromium.script("return document.getElementById('receipt').textContent")
    assert request_id in receipt and "cache_aware" in receipt and "acme" in receipt
    candidates = chromium.script(
        "return document.querySelectorAll('table[data-live=candidates] tbody tr').length"
    )
    assert candidates == 3
    response_id = first.json()["id"]
    chromium.open(admin + f"/console/requests?id={response_id}")  # the answer's own id too
    assert request_id in chromium.script("return document.getElementById('receipt').textContent")

    # no page, as rendered by the browser after its polls, holds any tenant's text
    for path in PAGES:
        chromium.open(admin + path)
        polls(chromium, 0)
        assert SECRET not in chromium.source(), path
    state = httpx.get(
        admin + "/console/state.json", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert state.status_code == 200 and SECRET not in state.text
