"""The OpenAI front end's allow-list: what the OpenAPI document declares is exactly what is
forwarded, and each refused field is named with its reason."""

from __future__ import annotations

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
