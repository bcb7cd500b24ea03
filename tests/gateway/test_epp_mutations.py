"""The endpoint picker's ext-proc messages, built and read (gateway.api.epp.mutations)."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from pydantic import ValidationError

from gateway.api.epp import mutations as m
from gateway.settings import load_settings


def test_a_body_goes_back_in_chunks_of_at_most_62000_bytes_the_last_one_ending_it() -> None:
    body = bytes(range(256)) * 500  # 128,000 bytes
    chunks = [
        c.request_body.response.body_mutation.streamed_response
        for c in m.body_chunks(body, response=False)
    ]
    assert [len(c.body) for c in chunks] == [62_000, 62_000, 4_000]
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    assert b"".join(c.body for c in chunks) == body
    (empty,) = list(m.body_chunks(b"", response=True))
    assert empty.response_body.response.body_mutation.streamed_response.end_of_stream
    middle = list(m.body_chunks(b"x" * 10, response=True, end=False))
    assert not middle[0].response_body.response.body_mutation.streamed_response.end_of_stream


def test_the_pick_is_a_header_and_the_same_list_under_envoy_lb() -> None:
    answer = m.picked_headers(["10.0.0.1:8000", "10.0.0.2:8000"], 1234, {"traceparent": "00-x"})
    mutation = answer.request_headers.response.header_mutation
    sets = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert sets == {
        "x-gateway-destination-endpoint": "10.0.0.1:8000,10.0.0.2:8000",
        "content-length": "1234",
        "traceparent": "00-x",
    }
    assert list(mutation.remove_headers) == ["authorization", "x-api-key"]
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000,10.0.0.2:8000"


def _with_metadata(namespace: str, fields: dict[str, object]) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    entry = struct_pb2.Struct()
    entry.update(fields)
    request.metadata_context.filter_metadata[namespace].CopyFrom(entry)
    return request


def test_subset_hints_and_the_served_endpoint_are_read_from_the_metadata() -> None:
    listed = _with_metadata(m.SUBSET_NAMESPACE, {m.SUBSET_KEY: ["a:1", "b:2"]})
    assert m.subset_hint(listed) == ["a:1", "b:2"]
    text = _with_metadata(m.SUBSET_NAMESPACE, {m.SUBSET_KEY: "a:1, b:2"})
    assert m.subset_hint(text) == ["a:1", "b:2"]
    assert m.subset_hint(_with_metadata(m.SUBSET_NAMESPACE, {m.SUBSET_KEY: []})) == []
    assert m.subset_hint(pb.ProcessingRequest(request_headers=pb.HttpHeaders())) is None
    served = _with_metadata(m.LB_NAMESPACE, {m.SERVED_KEY: "10.0.0.2:8000"})
    assert m.served_endpoint(served) == "10.0.0.2:8000"
    assert m.served_endpoint(_with_metadata(m.LB_NAMESPACE, {"other": "x"})) is None


def test_an_error_is_an_immediate_response_with_its_body_and_headers() -> None:
    answer = m.immediate(429, b'{"error": {}}', {"retry-after": "3"}, details="QuotaExceeded")
    reply = answer.immediate_response
    assert reply.status.code == 429 and reply.body == b'{"error": {}}'
    headers = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    assert headers == {"content-type": b"application/json", "retry-after": b"3"}
    timeout = m.extend_timeout(11.25).override_message_timeout
    assert (timeout.seconds, timeout.nanos) == (11, 250_000_000)


def test_replicas_are_known_to_envoy_by_host_and_port() -> None:
    assert m.endpoints_of(["http://10.0.0.1:8000", "https://pod:443/v1"]) == {
        "http://10.0.0.1:8000": "10.0.0.1:8000",
        "https://pod:443/v1": "pod:443",
    }


def test_the_mode_is_standalone_or_epp() -> None:
    assert load_settings().mode == "standalone"
    assert load_settings(mode="epp").epp_port == 9002
    with pytest.raises(
        ValidationError, match="unknown mode 'sidecar'; choose one of standalone, epp"
    ):
        load_settings(mode="sidecar")
