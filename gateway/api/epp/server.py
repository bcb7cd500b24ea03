"""The endpoint picker's gRPC server: the ext-proc service and gRPC health checking.

Health services (GIE's endpoint-picker protocol): `liveness`, `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` (and the overall "") are SERVING while the server
runs — it starts after the replicas' first probe, so the picker is synced when it is ready. Ready
does not mean some replica is healthy: with none, the picker answers each request 503 itself
(GIE's protocol), where an unready picker would leave Envoy to its fail-open guess. Envoy's
health check of the picker cluster asks the ext-proc service, so a dead picker has no healthy
host and the stream fails before the request's body is streamed to it: that is when
FailOpen (`failure_mode_allow`) can still let the request through. All turn NOT_SERVING at
shutdown.

The health services answer anyone (they tell nothing); the ext-proc service, with `epp_token`
set, serves only streams that carry it (`PickerService`, docs/deployment.md#the-envoy-config).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.api.context import FrontEnd
from gateway.api.epp.service import PickerService
from gateway.settings import Settings
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS = "liveness"
READINESS = "readiness"
EPP_SHUTDOWN_GRACE_S = 5.0
"""At shutdown, streams in flight get 5 s: Envoy has already forwarded their requests, and
their responses' records (first token, usage) still arrive here."""
EPP_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Envoy's chunks are at most its buffer (~1 MiB by default) plus framing; 8 MiB is headroom."""


class EppServer:
    def __init__(self, server: Any, health_servicer: Any, port: int, tasks: BackgroundTasks):
        self.server = server
        self.health = health_servicer
        self.port = port
        self._tasks = tasks

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self._tasks.close()
        await self.server.stop(EPP_SHUTDOWN_GRACE_S)


async def start_epp(settings: Settings, front: FrontEnd) -> EppServer:
    """Serve the picker on `settings.host:settings.epp_port` (0: any free port)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", EPP_MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", int(settings.worker_index is not None)),
        ]
    )
    token = settings.epp_token.get_secret_value() if settings.epp_token else None
    service = PickerService(front, settings.epp_max_message_timeout_s, token)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.host}:{settings.epp_port}"
    port = server.add_insecure_port(address)
    if not port:
        raise RuntimeError(f"cannot listen for ext-proc on {address}")
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", LIVENESS, READINESS, EXT_PROC_SERVICE):
        await health_servicer.set(name, serving)
    tasks = BackgroundTasks("endpoint picker")
    log.info("kvgate: endpoint picker (ext-proc) on %s:%d", settings.host, port)
    return EppServer(server, health_servicer, port, tasks)
