"""What every front end is given: the pipeline's entry, the tenants, the fleet's health, and the
settings a front end reads. Front ends use these and nothing else of the gateway."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from gateway.api.body import check_json_media_type, read_body
from gateway.fleet.replicas import ReplicaSet
from gateway.pipeline.director import Director
from gateway.tenancy.registry import TenantRegistry


@dataclass(frozen=True)
class FrontEnd:
    pipeline: Director
    """`open(parsed, tenant, trace_headers)`: admit, route, forward."""
    tenants: TenantRegistry
    replicas: ReplicaSet
    """Read-only here: `/v1/models`, readiness."""
    max_prompt_bytes: int
    debug_headers: bool
    max_body_bytes: int
    body_read_timeout_s: float

    async def read(self, request: Request) -> bytes:
        """The request's body within `max_body_bytes` and `body_read_timeout_s`
        (`gateway.api.body.read_body`), declared as JSON if declared at all (415)."""
        check_json_media_type(request.headers.get("content-type"))
        return await read_body(request, self.max_body_bytes, self.body_read_timeout_s)
