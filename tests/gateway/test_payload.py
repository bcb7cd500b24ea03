"""The engine's body spliced from the client's bytes: the same JSON as the parsed body with the
gateway's fields set, or no splice when that would need a duplicate key."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.pipeline.payload import splice_fields

SALTED = {"cache_salt": "s1", "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[{"role":"user","content":"hi \\u00e9 }"}]}',
        b'{\n  "model": "m",\n  "messages": [{"role": "user", "content": "hi"}]\n}\n\t ',
        b'{"model":"m","stream":true,"messages":[]}',
        b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}',
        b"{}",
        b"{ }  ",
    ],
)
def test_the_spliced_body_reads_as_the_body_with_the_fields_set(raw: bytes) -> None:
    body: dict[str, Any] = orjson.loads(raw)
    spliced = splice_fields(raw, body, SALTED)
    assert spliced is not None
    assert orjson.loads(spliced) == {**body, **SALTED}
    # the client's bytes are kept as they were sent, the fields only appended
    assert spliced.startswith(raw.rstrip()[:-1])


def test_a_field_the_client_set_otherwise_is_not_spliced_as_a_duplicate_key() -> None:
    for raw in (
        b'{"model":"m","stream":false}',
        b'{"model":"m","stream":1}',  # equal to True in Python, not in JSON
        b'{"model":"m","stream":true,"stream_options":{"include_usage":false}}',
    ):
        assert splice_fields(raw, orjson.loads(raw), SALTED) is None


def test_fields_already_equal_leave_the_bytes_as_sent() -> None:
    raw = b'{"model":"m","stream":true} \n'
    assert splice_fields(raw, orjson.loads(raw), {"stream": True}) == raw.rstrip()
    assert splice_fields(b"[1]", {}, {"stream": True}) is None  # not an object's bytes
