"""The ext-proc messages the endpoint picker sends and reads, built and parsed in one place.

What goes to Envoy (GIE's endpoint-picker protocol, `docs/deployment.md#endpoint-picker`):

    request headers  ─▶ HeadersResponse: x-gateway-destination-endpoint: ip:port,ip:port,…
                        (set, and the same list under dynamic metadata envoy.lb), the tenant's
                        Authorization / x-api-key removed, content-length set to the new body's
    request body     ─▶ StreamedBodyResponse chunks of at most MAX_CHUNK_BYTES, the last one
                        end_of_stream (FULL_DUPLEX_STREAMED: the body is re-sent whole)
    an error         ─▶ ImmediateResponse: status, JSON body (the gateway's own error shapes)
    a hold           ─▶ override_message_timeout (Envoy's message timer, default 200 ms)

What comes from Envoy: headers as a HeaderMap (values in `raw_value`), the data plane's subset
hint and the served endpoint in `metadata_context` (both optional).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
"""The header and the `envoy.lb` metadata key of the pick (GIE's protocol)."""
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
TENANT_HEADERS = ("authorization", "x-api-key")
"""The tenant's credentials: read by the picker, never passed to the engine."""
MAX_CHUNK_BYTES = 62_000
"""GIE's bound on a streamed body chunk: Envoy's gRPC client takes messages up to 64 KiB by
default (`max_receive_message_length`), and the message wraps the chunk with a few bytes."""


def header_map(headers: Any) -> dict[str, str]:
    """A HeaderMap as a dict (lower-case keys; Envoy sends the value in `raw_value`)."""
    out: dict[str, str] = {}
    for header in headers.headers:
        raw = header.raw_value
        out[header.key] = raw.decode("latin-1") if raw else header.value
    return out


def _metadata_fields(request: Any, namespace: str) -> Mapping[str, Any] | None:
    if not request.HasField("metadata_context"):
        return None
    entry = request.metadata_context.filter_metadata.get(namespace)
    return None if entry is None else entry.fields


def subset_hint(request: Any) -> list[str] | None:
    """The data plane's subset (endpoints as ip:port), or None when it sent none."""
    fields = _metadata_fields(request, SUBSET_NAMESPACE)
    if fields is None or SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    text = value.string_value  # a comma-separated string is taken too
    return [e.strip() for e in text.split(",") if e.strip()]


def served_endpoint(request: Any) -> str | None:
    """The endpoint Envoy sent the request to, when its config reports it (envoy.lb)."""
    fields = _metadata_fields(request, LB_NAMESPACE)
    if fields is None or SERVED_KEY not in fields:
        return None
    return fields[SERVED_KEY].string_value or None


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def picked_headers(
    endpoints: Sequence[str], body_length: int, extra: Mapping[str, str] | None = None
) -> Any:
    """The request-headers answer of a pick: the destination header, its metadata twin, the
    body's new length, the tenant's key removed (`extra`: the trace context and the DP
    rank for the engine, `Pick.headers`)."""
    value = ",".join(endpoints)
    sets = [_header(DESTINATION, value), _header("content-length", str(body_length))]
    sets += [_header(k, v) for k, v in (extra or {}).items()]
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    mutation = pb.HeaderMutation(set_headers=sets, remove_headers=list(TENANT_HEADERS))
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)),
        dynamic_metadata=metadata,
    )


def buffered_body(headers: Any, body: bytes) -> Any:
    """BUFFERED request bodies: one answer to the body, with the pick's header mutation and
    metadata (`headers`: what `picked_headers` built) and the whole new body."""
    common = headers.request_headers.response
    common.body_mutation.body = body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=headers.dynamic_metadata
    )


def body_chunks(body: bytes, *, response: bool, end: bool = True) -> Iterator[Any]:
    """`body` as StreamedBodyResponse messages of at most MAX_CHUNK_BYTES (an empty body is one
    message), the last marked end_of_stream when `end`."""
    size = len(body)
    starts = range(0, size, MAX_CHUNK_BYTES) if size else range(1)
    for start in starts:
        chunk = body[start : start + MAX_CHUNK_BYTES]
        last = end and start + MAX_CHUNK_BYTES >= size
        streamed = pb.StreamedBodyResponse(body=chunk, end_of_stream=last)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        if response:
            yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
        else:
            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def immediate(
    status: int, body: bytes, headers: Mapping[str, str] | None = None, details: str = ""
) -> Any:
    """An answer Envoy sends the client itself: the request goes no further."""
    sets = [_header("content-type", "application/json")]
    sets += [_header(k, v) for k, v in (headers or {}).items()]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=sets),
            body=body,
            details=details,
        )
    )


def extend_timeout(seconds: float) -> Any:
    """Envoy's message timer restarted with `seconds` (at most its `max_message_timeout`)."""
    whole = int(seconds)
    nanos = int((seconds - whole) * 1e9)
    return pb.ProcessingResponse(
        override_message_timeout=duration_pb2.Duration(seconds=whole, nanos=nanos)
    )


def headers_continue(response: bool) -> Any:
    """Headers passed on unchanged."""
    if response:
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def trailers_continue(response: bool) -> Any:
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def endpoints_of(urls: Iterable[str]) -> dict[str, str]:
    """Replica URL → its `ip:port`, the address Envoy knows it by."""
    out = {}
    for url in urls:
        _, _, rest = url.partition("://")
        out[url] = rest.split("/", 1)[0]
    return out
