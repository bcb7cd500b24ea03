"""The admin ledger endpoints (auth, exports that round-trip, summaries) and a tenant's explicit
cached contents (create, use, extend, delete; rent), through the running gateway."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.billing.export import from_csv, from_jsonl, from_parquet
from gateway.billing.pricing.money import iso
from gateway.billing.records import COLUMNS
from gateway.billing.wal import read_directory
from loadgen.text import words
from tests.conftest import MODEL, OTHER_KEY, TENANT_KEY
from tests.e2e.billing.test_gateway_billing import ADMIN_KEY, billed_gateway, client
from tests.servers import Served

pytestmark = pytest.mark.e2e

START = 1_000_000


def admin_get(
    gateway: Served, path: str, key: str | None = ADMIN_KEY, **params: Any
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(gateway.url + path, params=params, headers=headers, timeout=30)


def test_admin_endpoints_need_an_admin_key_and_exports_round_trip(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    gateway, clock = billed_gateway(
        start_engines, start_gateway, tmp_path, billing_profiles={"acme": "anthropic"}
    )
    acme, globex = client(gateway), client(gateway, OTHER_KEY)
    system = {
        "role": "system",
        "content": [
            {"type": "text", "text": words("admin", 1500), "cache_control": {"type": "ephemeral"}}
        ],
    }
    for i in range(3):
        clock.set(START + 10 * i)
        acme.chat.completions.create(
            model=MODEL, messages=[system, {"role": "user", "content": f"q{i}"}], max_tokens=3
        )
        globex.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words("g", 1200)}], max_tokens=3
        )
    window = {"tenant": "acme", "from": iso(Decimal(START)), "to": iso(Decimal(START + 30))}
    assert admin_get(gateway, "/admin/billing/export", None, **window).status_code == 401
    assert admin_get(gateway, "/admin/billing/export", "sk-nobody", **window).status_code == 401
    forbidden = admin_get(gateway, "/admin/billing/export", TENANT_KEY, **window)
    assert forbidden.status_code == 403 and "admin key" in forbidden.json()["error"]["message"]
    bad = admin_get(gateway, "/admin/billing/export", **{**window, "format": "xml"})
    assert bad.status_code == 400 and "csv, jsonl, parquet" in bad.json()["error"]["message"]
    assert (
        admin_get(gateway, "/admin/billing/export", **{**window, "from": "yesterday"}).status_code
        == 400
    )

    wal = [r for r in read_directory(tmp_path / "wal") if r["tenant"] == "acme"]
    assert len(wal) == 3
    exported = {}
    for fmt, decode in (
        ("jsonl", from_jsonl),
        ("csv", lambda b: from_csv(b.decode())),
        ("parquet", from_parquet),
    ):
        response = admin_get(gateway, "/admin/billing/export", **{**window, "format": fmt})
        assert response.status_code == 200, response.text
        exported[fmt] = decode(response.content)
    for fmt, rows in exported.items():
        assert [r["id"] for r in rows] == [r["id"] for r in wal], fmt
        for row, original in zip(rows, wal, strict=True):
            assert list(row) == list(COLUMNS)
            for column in COLUMNS:
                if column in ("input_cost", "output_cost", "rent", "cost"):
                    assert Decimal(str(row[column])) == Decimal(original[column]), (fmt, column)
                else:
                    assert row[column] == original[column], (fmt, column)
    # adjacent windows partition the records: none dropped or doubled at the boundary
    halves = [
        admin_get(
            gateway,
            "/admin/billing/export",
            tenant="acme",
            **{"from": iso(Decimal(a)), "to": iso(Decimal(b))},
        )
        for a, b in ((START, START + 10), (START + 10, START + 30))
    ]
    ids = [r["id"] for h in halves for r in from_jsonl(h.content)]
    assert ids == [r["id"] for r in wal]

    summary = admin_get(gateway, "/admin/billing/summary").json()
    assert set(summary) == {"acme", "globex"}
    a = summary["acme"]
    assert a["requests"] == 3
    assert a["input_tokens"] == a["written_tokens"] + a["read_tokens"] + a["uncached_tokens"]
    assert a["read_tokens"] == 2 * a["written_tokens"]  # one write, two reads of the system block
    assert Decimal(a["cost"]) == sum(Decimal(r["cost"]) for r in wal)
    assert Decimal(a["hit_rate"]) > Decimal("0.5")
    acme.close()
    globex.close()


def test_a_parquet_export_without_pyarrow_is_a_clear_400(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Item 17: without pyarrow (a gateway installed without the `parquet` extra) a parquet
    export answered 500; it is the client's choice of format that cannot be served: a 400 that
    says what to install. The other formats still work."""
    gateway, clock = billed_gateway(start_engines, start_gateway, tmp_path)
    clock.set(START)
    client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    window = {"tenant": "acme", "from": iso(Decimal(START)), "to": iso(Decimal(START + 30))}
    refused = admin_get(gateway, "/admin/billing/export", **{**window, "format": "parquet"})
    assert refused.status_code == 400, refused.text
    assert "kvgate[parquet]" in refused.json()["error"]["message"]
    assert admin_get(gateway, "/admin/billing/export", **window).status_code == 200


def test_explicit_cached_contents_create_use_extend_delete_with_rent(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    gateway, clock = billed_gateway(
        start_engines,
        start_gateway,
        tmp_path,
        billing_profiles={"acme": "google_explicit"},
        billing_model_map={MODEL: "gemini-3.1-pro"},
    )
    url = gateway.url + "/v1/cached_contents"
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    handbook = [{"role": "system", "content": words("handbook", 5000)}]
    clock.set(START)
    created = httpx.post(
        url, json={"model": MODEL, "messages": handbook, "ttl_s": 7200}, headers=auth
    )
    assert created.status_code == 200, created.text
    obj = created.json()
    assert obj["tokens"] > 4000 and obj["expire_time"] == iso(Decimal(START + 7200))
    # another profile's tenant, a malformed body, an unknown id
    other = httpx.post(
        url,
        json={"model": MODEL, "messages": handbook},
        headers={"authorization": f"Bearer {OTHER_KEY}"},
    )
    assert other.status_code == 400 and "google_explicit" in other.json()["error"]["message"]
    assert (
        httpx.post(
            url, json={"model": MODEL, "messages": handbook, "ttl_s": -1}, headers=auth
        ).status_code
        == 400
    )
    assert httpx.get(url + "/cc-nope", headers=auth).status_code == 404

    c = client(gateway)
    clock.set(START + 600)
    response = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": words("question", 300)}],
        max_tokens=3,
        extra_body={"cached_content": obj["id"]},
    )
    meta = response.usage.usageMetadata  # type: ignore[union-attr]
    assert meta["cachedContentTokenCount"] == obj["tokens"]
    assert meta["promptTokenCount"] == response.usage.prompt_tokens  # type: ignore[union-attr]
    assert response.usage.prompt_tokens > obj["tokens"] + 300  # type: ignore[union-attr]

    clock.set(START + 3600)
    extended = httpx.patch(
        url + "/" + obj["id"], json={"ttl_s": 7200}, headers=auth
    )  # to START + 10800
    assert extended.status_code == 200 and Decimal(extended.json()["rent"]) > 0
    clock.set(START + 5400)
    deleted = httpx.delete(url + "/" + obj["id"], headers=auth)
    assert deleted.status_code == 200 and Decimal(deleted.json()["rent"]) < 0
    with pytest.raises(openai.BadRequestError, match="expired or was deleted"):
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "again"}],
            max_tokens=3,
            extra_body={"cached_content": obj["id"]},
        )
    records = [r for r in read_directory(tmp_path / "wal") if r["cached_content"] == obj["id"]]
    assert [r["kind"] for r in records] == [
        "cache.create",
        "request",
        "cache.update",
        "cache.delete",
    ]
    rent = sum(Decimal(r["rent"]) for r in records)
    expected = Decimal(obj["tokens"]) * Decimal("4.50") * Decimal(5400) / Decimal(3600) / 10**6
    assert rent == expected.quantize(Decimal("1e-12"))  # from creation to deletion, 1.5 h
    c.close()


def test_explicit_contents_survive_a_gateway_restart(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    settings: dict[str, Any] = {
        "billing_profiles": {"acme": "google_explicit"},
        "billing_model_map": {MODEL: "gemini-3.1-pro"},
    }
    gateway, clock = billed_gateway(start_engines, start_gateway, tmp_path, **settings)
    clock.set(int(time.time()))  # the restarted gateway loads its objects on the wall clock
    url = "/v1/cached_contents"
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    created = httpx.post(
        gateway.url + url,
        json={"model": MODEL, "messages": [{"role": "system", "content": words("kept", 800)}]},
        headers=auth,
    ).json()
    gateway.stop()  # the WAL directory (and its snapshot of live objects) outlives the process
    again = start_gateway(start_engines(1), billing_wal_dir=tmp_path / "wal", **settings)
    again.app.state.billing.meter.clock = clock  # the same instant: the object is still live
    found = httpx.get(again.url + url + "/" + created["id"], headers=auth)
    assert found.status_code == 200 and found.json()["tokens"] == created["tokens"]
    c = client(again)
    response = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "and now?"}],
        max_tokens=2,
        extra_body={"cached_content": created["id"]},
    )
    assert response.usage.usageMetadata["cachedContentTokenCount"] == created["tokens"]  # type: ignore[union-attr]
    c.close()
