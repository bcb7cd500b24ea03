"""Reading a request body: what every front end does before it parses its own shape."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import InvalidRequest


def load_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body
