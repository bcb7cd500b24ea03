"""The gRPC front end: `kvgate.v1.Gateway` (Generate, GenerateStream), health checking and
reflection, on a `grpc.aio` server in the HTTP server's event loop (the app's lifespan starts and
stops it).

Handlers stay thin, as the HTTP ones do: authenticate (the `authorization` metadata), convert
(`gateway.api.grpc.convert`), `Director.open`, consume the exchange's chunks, map errors in one
place (`gateway.errors.to_grpc`). Both RPCs stream from the engine, so when an RPC ends early (the
client's deadline passes or it cancels) the handler's task is cancelled and the exchange
aborted: the upstream connection closes and the engine drops the request.

Health: the overall service ("") is SERVING while the server runs (liveness, like /healthz);
"kvgate.v1.Gateway" is SERVING while some replica is healthy (readiness, like /readyz),
refreshed every `health_interval_s`. Both turn NOT_SERVING at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.api.context import FrontEnd
from gateway.api.errors import report_internal, to_grpc
from gateway.api.grpc._pb import gateway_pb2 as pb
from gateway.api.grpc._pb import gateway_pb2_grpc
from gateway.api.grpc.convert import to_parsed, usage_message
from gateway.api.responses import debug_headers
from gateway.api.usage import cache_usage
from gateway.errors import EngineRejected, GatewayError, TenantError
from gateway.observability.metrics import RequestMetrics
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.forwarder import Passthrough
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from gateway.request.trace import trace_context
from gateway.settings import Settings
from gateway.tasks import BackgroundTasks
from gateway.tenancy.registry import bearer_key

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
GRPC_SHUTDOWN_GRACE_S = 5.0
"""A stop's default grace for RPCs in flight (the gateway passes its `shutdown_grace_s`)."""
GRPC_MESSAGE_HEADROOM_BYTES = 64 * 1024
"""A request's proto may exceed its rendered prompt by field tags and JSON whitespace; beyond
`max_prompt_bytes` + this, gRPC itself refuses it with RESOURCE_EXHAUSTED before parsing."""


async def _abort(context: Any, err: GatewayError) -> NoReturn:
    code, details, trailing = to_grpc(err)
    await context.abort(code, details, trailing)
    raise AssertionError("ServicerContext.abort returns by raising")


def _status_name(exc: BaseException, context: Any) -> str:
    """The status a failed RPC ends with: what the handler aborted with (INTERNAL for the last
    resort), CANCELLED when the client left (or its deadline passed); UNKNOWN only if some
    exception escaped the last resort."""
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


def _usage(parsed: ParsedRequest, engine: Mapping[str, Any] | None) -> pb.Usage:
    """The usage as every front end reports it: the bill's with billing on (what the WAL
    records, with its cost and record id), else the provisional split (`cache_usage`)."""
    engine = engine or {}
    return usage_message(cache_usage(parsed, engine), engine)


class GatewayService:
    """The `kvgate.v1.Gateway` servicer (registered by the generated `add_..._to_server`)."""

    def __init__(self, front: FrontEnd, metrics: RequestMetrics | None = None) -> None:
        self.front = front
        self.tenants = front.tenants
        self.metrics = metrics

    def _authenticate(self, metadata: dict[str, str]) -> Tenant:
        key = bearer_key(metadata.get("authorization"))
        if key is None and len(self.tenants):
            raise TenantError(
                "missing API key: send 'authorization: Bearer KEY' in the call's metadata",
                code="missing_api_key",
            )
        return self.tenants.authenticate(key)

    async def _open(self, request: pb.GenerateRequest, context: Any, streaming: bool) -> Exchange:
        metadata = dict(context.invocation_metadata() or ())
        tenant = self._authenticate(metadata)
        parsed = to_parsed(
            request,
            streaming_rpc=streaming,
            max_prompt_bytes=self.front.max_prompt_bytes,
        )
        opened = await self.front.pipeline.open(parsed, tenant, trace_context(metadata))
        if isinstance(opened, Passthrough):
            raise EngineRejected(opened.status, opened.body)
        headers = debug_headers(opened, self.front.debug_headers)
        if headers:
            await context.send_initial_metadata(tuple(headers.items()))
        return opened

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        started = time.perf_counter()
        code = "OK"
        try:
            try:
                return await self._generate(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # the last resort: logged, INTERNAL with the request id
                await _abort(context, report_internal(exc, "gRPC Generate"))
        except BaseException as exc:
            code = _status_name(exc, context)
            raise
        finally:
            self._observe("Generate", code, started)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        started = time.perf_counter()
        code = "OK"
        try:
            try:
                async for message in self._generate_stream(request, context):
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # the last resort: logged, INTERNAL with the request id
                await _abort(context, report_internal(exc, "gRPC GenerateStream"))
        except BaseException as exc:
            code = _status_name(exc, context)
            raise
        finally:
            self._observe("GenerateStream", code, started)

    def _observe(self, method: str, code: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_grpc(method, code, time.perf_counter() - started)

    async def _generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        try:
            exchange = await self._open(request, context, streaming=False)
        except GatewayError as err:
            await _abort(context, err)
        parsed = exchange.parsed
        response = pb.GenerateResponse(model=parsed.model)
        pieces: list[str] = []
        calls: dict[int, pb.ToolCall] = {}
        try:
            async for chunk in exchange.chunks():
                response.id = response.id or str(chunk.get("id") or "")
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if isinstance(delta.get("content"), str):
                        pieces.append(delta["content"])
                    for call in delta.get("tool_calls") or ():
                        into = calls.setdefault(int(call.get("index", 0)), pb.ToolCall())
                        function = call.get("function") or {}
                        into.id = into.id or call.get("id") or ""
                        into.name = into.name or function.get("name") or ""
                        into.arguments_json += function.get("arguments") or ""
                    if choice.get("finish_reason"):
                        response.finish_reason = choice["finish_reason"]
        except asyncio.CancelledError:
            exchange.abort()
            raise
        finally:
            await exchange.finish()
        if exchange.failure is not None:  # the stream ended early: the RPC's status says why
            await _abort(context, exchange.failure)
        if not parsed.prewarm:
            response.text = "".join(pieces)
            response.tool_calls.extend(calls[i] for i in sorted(calls))
        response.usage.CopyFrom(_usage(parsed, exchange.usage))
        return response

    async def _generate_stream(
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            exchange = await self._open(request, context, streaming=True)
        except GatewayError as err:
            await _abort(context, err)
        parsed = exchange.parsed
        started = False
        finish = ""
        try:
            async for chunk in exchange.chunks():
                if not started:
                    started = True
                    start = pb.StreamStart(id=str(chunk.get("id") or ""), model=parsed.model)
                    yield pb.GenerateStreamResponse(start=start)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = delta.get("content")
                    if isinstance(text, str) and text:
                        yield pb.GenerateStreamResponse(text=text)
                    for call in delta.get("tool_calls") or ():
                        function = call.get("function") or {}
                        piece = pb.ToolCallDelta(
                            index=int(call.get("index", 0)),
                            id=call.get("id") or "",
                            name=function.get("name") or "",
                            arguments_json=function.get("arguments") or "",
                        )
                        yield pb.GenerateStreamResponse(tool_call=piece)
                    if choice.get("finish_reason"):
                        finish = str(choice["finish_reason"])
        except asyncio.CancelledError:
            exchange.abort()
            raise
        finally:
            await exchange.finish()
        if exchange.failure is not None:  # the stream ended early: the RPC's status says why
            await _abort(context, exchange.failure)
        end = pb.StreamEnd(finish_reason=finish, usage=_usage(parsed, exchange.usage))
        yield pb.GenerateStreamResponse(end=end)


class GrpcServer:
    """The running gRPC server of one gateway process."""

    def __init__(
        self,
        server: Any,
        health_servicer: Any,
        port: int,
        tasks: BackgroundTasks,
        grace_s: float = GRPC_SHUTDOWN_GRACE_S,
    ):
        self.server = server
        self.health = health_servicer
        self.port = port
        self.grace_s = grace_s
        self._tasks = tasks
        self._stopping: asyncio.Task[None] | None = None

    def drain(self) -> asyncio.Task[None]:
        """Begin the graceful stop (once): health says NOT_SERVING, no new RPC is taken, RPCs
        in flight get `grace_s` to finish and are cancelled after it."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(), name="gRPC drain")
        return self._stopping

    async def stop(self) -> None:
        await self.drain()

    async def _stop(self) -> None:
        stopping = asyncio.ensure_future(self.server.stop(self.grace_s))  # takes no new RPC
        await self.health.enter_graceful_shutdown()
        await self._tasks.close()
        await stopping


async def _watch_readiness(front: FrontEnd, servicer: Any, interval_s: float) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while True:
        ready = front.replicas.any_healthy()
        await servicer.set(SERVICE_NAME, serving if ready else not_serving)
        await asyncio.sleep(interval_s)


async def start_grpc(
    settings: Settings, front: FrontEnd, metrics: RequestMetrics | None = None
) -> GrpcServer:
    """Start the gRPC server on `settings.host:settings.grpc_port` (0: any free port) in the
    running event loop; `metrics` counts and times its RPCs."""
    assert settings.grpc_port is not None
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            # a second server on a taken port fails, not shares it; workers share it
            ("grpc.so_reuseport", int(settings.worker_index is not None)),
        ]
    )
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayService(front, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{settings.host}:{settings.grpc_port}"
    port = server.add_insecure_port(address)
    if not port:
        raise RuntimeError(f"cannot listen for gRPC on {address}")
    await server.start()
    tasks = BackgroundTasks("gRPC")
    tasks.spawn(_watch_readiness(front, health_servicer, settings.health_interval_s), "readiness")
    log.info("kvgate: gRPC on %s:%d", settings.host, port)
    return GrpcServer(server, health_servicer, port, tasks, settings.shutdown_grace_s)
