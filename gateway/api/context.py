"""What every front end is given: the pipeline's entry, the tenants, the fleet's health, and the
two settings a front end reads. Front ends use these and nothing else of the gateway."""

from __future__ import annotations

from dataclasses import dataclass

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
