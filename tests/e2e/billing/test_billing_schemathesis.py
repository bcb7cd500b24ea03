"""Property-based requests to the billing routes (from the gateway's OpenAPI document, billing
on) find no 5xx: bad query strings, bodies and ids are all 4xx."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from loadgen.chaos.schema_fuzz import fuzz, operations, server_errors
from loadgen.engine.timing import TimingModel
from tests.conftest import MODEL, TENANT_KEY, metrics_url
from tests.e2e.billing.test_gateway_billing import ADMIN_KEY
from tests.servers import Served

pytestmark = pytest.mark.e2e

EXAMPLES_PER_OPERATION = 30
BILLING_PATHS = ("/admin/billing", "/v1/cached_contents")


def test_billing_routes_have_no_server_errors(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    tmp_path: Path,
) -> None:
    engines = start_engines(1, max_model_len=4096, timing=TimingModel(time_scale=1e5))
    gateway = start_gateway(
        engines,
        debug_headers=False,
        billing_wal_dir=tmp_path / "wal",
        billing_profiles={"acme": "google_explicit"},
        billing_model_map={MODEL: "gemini-3.1-pro"},
        admin_keys=[ADMIN_KEY],
    )
    # the document is on the admin port; the requests go to the tenants' port
    ops = operations(metrics_url(gateway) + "/openapi.json", BILLING_PATHS)
    assert len(ops) == 6

    def key_for(path: str) -> str:
        return ADMIN_KEY if path.startswith("/admin") else TENANT_KEY

    statuses = fuzz(ops, gateway.url, key_for, EXAMPLES_PER_OPERATION, MODEL)
    assert server_errors(statuses) == 0, statuses
    assert 400 in statuses["GET /admin/billing/export"]
