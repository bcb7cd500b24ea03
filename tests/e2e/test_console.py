"""The console (gateway.server.console) in a real headless Chromium: each page renders with live
data from a running gateway and engines, the charts move as traffic flows, a request is looked up
by its id, a page without the admin key is refused, nothing of it is on the tenants' port, and
no tenant's text appears in any page."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from gateway.billing.pricing.prices import PriceTable
from gateway.billing.wal import read_directory
from loadgen.harness.browser import Browser, browser
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY, metrics_url
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
ADMIN_KEY = "console-admin-key-0123456789"
SECRET = "zebraquartz"
"""A word in every prompt: it must never appear in a console page."""
PAGES = ("/console", "/console/routing", "/console/tenants", "/console/requests")
PRICED = "gpt-5.6"
"""The model the engines' is billed as (the default profile, openai: a prompt of 1,024 tokens or
more is cached, a read costs a tenth)."""


def chat(gateway: Served, key: str, turn: int, topic: str = "") -> httpx.Response:
    """Three prompts by turn per topic (over 1,024 tokens: billing's openai profile caches
    them)."""
    content = f"{SECRET} " + words(f"{SECRET}{topic}{turn % 3}", 1_100)
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
    gateway = start_gateway(
        start_engines(3),
        admin_keys=[ADMIN_KEY],
        billing_wal_dir=tmp_path / "wal",
        billing_model_map={MODEL: PRICED},
    )
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

    # spend and savings over a chosen window: nothing within the last minute of the page's own
    # polls, then what billing recorded for the new exchanges (a write, then two reads)
    chromium.script("document.getElementById('window').value = '60';")
    cells = (
        "const r = [...document.querySelectorAll('table[data-live=tenants] tbody tr')]"
        ".find(r => r.cells[0].textContent === 'acme');"
        "return r ? [6, 7, 8, 9].map(i => r.cells[i].textContent) : null;"
    )
    polls(chromium, 1)
    wait_until(lambda: (chromium.script(cells) or [])[:3] == ["$0"] * 3, what="an empty window")
    billed = {r["id"] for r in read_directory(tmp_path / "wal")}
    for _ in range(3):
        chat(gateway, TENANT_KEY, 0, topic="spend")  # a prompt not sent before
    new = [r for r in read_directory(tmp_path / "wal") if r["id"] not in billed]
    spend = sum(Decimal(r["cost"]) for r in new)
    price = PriceTable.default().lookup("openai", PRICED)
    without = sum(
        price.input * r["prompt_tokens"] / 1_000_000 + Decimal(r["output_cost"]) for r in new
    )
    assert sorted(r["read_tokens"] > 0 for r in new) == [False, True, True] and spend < without
    expected = [spend, without, without - spend, (without - spend) / without * 100]

    def shown() -> bool:
        try:  # a poll between the three exchanges shows part of it; "–" before any
            values = [float(t.strip("$%").replace(",", "")) for t in chromium.script(cells)]
        except ValueError:
            return False
        money = [
            v == pytest.approx(float(e), rel=1e-3)
            for v, e in zip(values[:3], expected[:3], strict=True)
        ]
        return all(money) and values[3] == pytest.approx(float(expected[3]), abs=0.06)

    wait_until(shown, 20, "the window's spend, without caching, saved and saved share")
    (tmp_path / "tenants.png").write_bytes(chromium.png())

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
