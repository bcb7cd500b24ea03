"""What the pipeline tells a request's trace, declared where the pipeline uses it.

The pipeline reports each step to a `RequestTrace` and never knows what is behind it:
`gateway.observability.tracing` implements these protocols with OpenTelemetry spans; with
tracing off (or the request not sampled) the request gets an `Untraced`, whose calls do nothing
but pass the client's own W3C trace-context headers on to the engine.

    begin ─▶ looked_up ─▶ decided ─▶ attempt ×n (failed | committed) ─▶ finished
                                               └─▶ passthrough (an engine's 4xx)
             any step may end in failed (the error the client gets)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.request.parsed import ParsedRequest
from gateway.request.state import ExchangeRecord
from gateway.request.tenant import Tenant
from router.types import Decision

TRACE_HEADERS = ("traceparent", "tracestate")


def trace_context(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of a client's request (HTTP headers or gRPC metadata),
    or None: the only headers kvgate continues and passes on."""
    found = {k: headers[k] for k in TRACE_HEADERS if k in headers}
    return found if "traceparent" in found else None


class AttemptTrace(Protocol):
    """One upstream attempt."""

    def headers(self) -> dict[str, str] | None:
        """The trace-context headers to send to the engine with this attempt."""

    def failed(self, exc: BaseException) -> None: ...


class RequestTrace(Protocol):
    def looked_up(
        self, started_ns: int, ended_ns: int, num_blocks: int, source: str, matched_blocks: int
    ) -> None: ...

    def decided(self, policy: str, decision: Decision, num_blocks: int) -> None: ...

    def attempt(self, replica: str, attempt: int, uncached_tokens: float) -> AttemptTrace: ...

    def passthrough(self, status: int) -> None:
        """The last attempt's engine answered a 4xx, relayed to the client: the trace ends."""

    def failed(self, exc: BaseException) -> None:
        """The request ends with this error before it committed."""

    def finished(self, record: ExchangeRecord) -> None:
        """The committed exchange ended."""


class Tracer(Protocol):
    def begin(
        self, parsed: ParsedRequest, tenant: Tenant, client_headers: Mapping[str, str] | None
    ) -> RequestTrace:
        """The trace of a new request; `client_headers` is its W3C trace context, if any."""


class Untraced:
    """A request kvgate does not trace: every step is a no-op, and each attempt passes the
    client's trace-context headers on unchanged (the engine may still continue its trace)."""

    __slots__ = ("client_headers",)

    def __init__(self, client_headers: Mapping[str, str] | None = None) -> None:
        self.client_headers = dict(client_headers) if client_headers else None

    def looked_up(
        self, started_ns: int, ended_ns: int, num_blocks: int, source: str, matched_blocks: int
    ) -> None:
        return None

    def decided(self, policy: str, decision: Decision, num_blocks: int) -> None:
        return None

    def attempt(self, replica: str, attempt: int, uncached_tokens: float) -> Untraced:
        return self

    def headers(self) -> dict[str, str] | None:
        return self.client_headers

    def passthrough(self, status: int) -> None:
        return None

    def failed(self, exc: BaseException) -> None:
        return None

    def finished(self, record: ExchangeRecord) -> None:
        return None


UNTRACED = Untraced()


class NoTracer:
    """Tracing off: no request is traced."""

    def begin(
        self, parsed: ParsedRequest, tenant: Tenant, client_headers: Mapping[str, str] | None
    ) -> RequestTrace:
        return UNTRACED if not client_headers else Untraced(client_headers)
