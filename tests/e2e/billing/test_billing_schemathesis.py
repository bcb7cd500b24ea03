"""Property-based requests to the billing routes (from the gateway's OpenAPI document, billing
on) find no 5xx: bad query strings, bodies and ids are all 4xx."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

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
    schema = schemathesis.openapi.from_url(metrics_url(gateway) + "/openapi.json")
    operations = [
        op
        for result in schema.get_all_operations()
        if (op := result.ok()).path.startswith(BILLING_PATHS)
    ]
    assert len(operations) == 6
    statuses: dict[str, set[int]] = {}

    def exercise(operation: Any, mode: GenerationMode) -> None:
        key = ADMIN_KEY if operation.path.startswith("/admin") else TENANT_KEY

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any) -> None:
            response = case.call_and_validate(
                base_url=gateway.url,
                headers={"authorization": f"Bearer {key}"},
                checks=[not_a_server_error],
            )
            statuses.setdefault(operation.path, set()).add(response.status_code)

        check()

    for operation, mode in itertools.product(operations, GenerationMode):
        exercise(operation, mode)
    assert 400 in statuses["/admin/billing/export"]
