"""The OpenAI front end's allow-list: what the OpenAPI document declares is exactly what is
forwarded, and each refused field is named with its reason."""

from __future__ import annotations

import re

import orjson
import pytest

from gateway.api.openai.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ENGINE_CONTROL,
    SAMPLING_EXTRAS,
)
from gateway.api.openai.parse import parse_chat, parse_completion
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.errors import InvalidRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_the_openapi_document_declares_exactly_the_forwarded_fields() -> None:
    assert set(ChatCompletionRequest.model_fields) == CHAT_FIELDS
    # `cached_content` names a chat's explicit content: on a completion billing refuses it
    assert set(CompletionRequest.model_fields) == COMPLETION_FIELDS - {"cached_content"}
    assert ChatCompletionRequest.model_config["extra"] == "forbid"


def test_no_engine_control_field_is_allowed_and_the_extras_are() -> None:
    assert not (CHAT_FIELDS | COMPLETION_FIELDS) & set(ENGINE_CONTROL)
    assert SAMPLING_EXTRAS <= CHAT_FIELDS & COMPLETION_FIELDS


@pytest.mark.parametrize("field", sorted(ENGINE_CONTROL))
def test_each_engine_control_field_is_a_400_with_its_reason(field: str) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "x"})):
        with pytest.raises(InvalidRequest) as info:
            parse(orjson.dumps({**body, field: 1}), 10_000)
        assert info.value.param == field
        assert ENGINE_CONTROL[field] in info.value.message or field == "cache_salt"


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[1].tool_call_id"),
        ({"role": "user", "content": "x", "name": 3}, "messages[1].name must be a string"),
        ({"role": "robot", "content": "x"}, "messages[1].role must be one of"),
        ({"role": "user", "content": 7}, "messages[1].content must be a string"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "tool_calls[0]"),
    ],
)
def test_the_fast_path_over_plain_turns_still_names_each_bad_field(
    message: dict[str, object], says: str
) -> None:
    """Plain turns skip the per-field checks' string building; anything else is checked in
    full, and the 400 names the message it is about."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}
    with pytest.raises(InvalidRequest, match=re.escape(says)):
        parse_chat(orjson.dumps(body), 10_000)
