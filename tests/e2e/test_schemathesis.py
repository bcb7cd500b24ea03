"""Property-based requests generated from the gateway's own OpenAPI document find no 5xx.

The gateway runs in front of real simulated engines with a short context (so every generated
max_tokens finishes quickly); about half the generated bodies get the served model's name, so
both the validation path and the proxy path are exercised. (Schemathesis is driven through its
Python API inside an ordinary test, by `loadgen.chaos.schema_fuzz.fuzz`, the loop `kvgate chaos`
runs at 1,000 cases per operation: its pytest fixture loader does not support pytest 9 yet.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loadgen.chaos.schema_fuzz import fuzz, operations, server_errors
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
    ops = operations(metrics_url(gateway) + "/openapi.json")
    paths = {op.path for op in ops}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models"} <= paths
    statuses = fuzz(ops, gateway.url, lambda _: TENANT_KEY, EXAMPLES_PER_OPERATION, MODEL)
    assert server_errors(statuses) == 0, statuses
    # both paths were reached: validation errors and the proxy
    assert 200 in statuses["POST /v1/chat/completions"]
    assert 200 in statuses["POST /v1/completions"]
    assert 400 in statuses["POST /v1/chat/completions"]
    assert {200, 400} <= set(statuses["POST /v1/messages"])
