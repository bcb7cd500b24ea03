"""Property-based requests generated from the gateway's own OpenAPI document find no 5xx.

The gateway runs in front of real simulated engines with a short context (so every generated
max_tokens finishes quickly); about half the generated bodies get the served model's name, so
both the validation path and the proxy path are exercised. (Schemathesis is driven through its
Python API inside an ordinary test: its pytest fixture loader does not support pytest 9 yet.)
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from loadgen.engine.timing import TimingModel
from tests.conftest import MODEL, TENANT_KEY, metrics_url
from tests.servers import Served

pytestmark = pytest.mark.e2e

EXAMPLES_PER_OPERATION = 60


def test_no_server_errors(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    engines = start_engines(2, max_model_len=2048, timing=TimingModel(time_scale=1e5))
    gateway = start_gateway(engines, debug_headers=False)
    # the document is on the admin port; the requests go to the tenants' port
    schema = schemathesis.openapi.from_url(metrics_url(gateway) + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models"} <= paths
    statuses: dict[str, set[int]] = {}

    def exercise(operation: Any, mode: GenerationMode) -> None:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any) -> None:
            body = case.body
            if isinstance(body, dict) and "model" in body and zlib.crc32(repr(body).encode()) % 2:
                body["model"] = MODEL
            response = case.call_and_validate(
                base_url=gateway.url,
                headers={"authorization": f"Bearer {TENANT_KEY}"},
                checks=[not_a_server_error],
            )
            statuses.setdefault(operation.path, set()).add(response.status_code)

        check()

    for operation, mode in itertools.product(operations, GenerationMode):
        exercise(operation, mode)
    # both paths were reached: validation errors and the proxy
    assert 200 in statuses["/v1/chat/completions"]
    assert 200 in statuses["/v1/completions"]
    assert 400 in statuses["/v1/chat/completions"]
    assert {200, 400} <= statuses["/v1/messages"]
