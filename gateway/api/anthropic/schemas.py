"""Anthropic's Messages request and response shapes, declared for the OpenAPI document.

As with `gateway.api.openai.schemas`, these never run on the hot path
(`gateway.api.anthropic.convert` parses by hand); they document what `/v1/messages` accepts, and
schemathesis generates requests from them. Keep them in step with the rules in
`gateway.api.anthropic.convert`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_REF = "#/components/schemas/{model}"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Closed):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(_Closed):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(_Closed):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(_Closed):
    type: Literal["url"]
    url: str


class ImageBlock(_Closed):
    type: Literal["image"]
    source: Base64Source | URLSource
    cache_control: CacheControl | None = None


class ToolUseBlock(_Closed):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Closed):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class InputMessage(_Closed):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock] = Field(
        description="tool_use blocks in assistant messages only; image and tool_result blocks "
        "in user messages only."
    )


class ToolDefinition(_Closed):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="Required when type is 'tool'.")
    disable_parallel_tool_use: bool | None = None


class Metadata(_Closed):
    user_id: str | None = None


class MessagesRequest(_Closed):
    model: str = Field(min_length=1, description="A model served by the engines.")
    max_tokens: int = Field(
        ge=0, description="0 pre-warms the cache: reads and refreshes it, generates nothing."
    )
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = Field(
        None, description="Automatic caching: a breakpoint on the last block."
    )
    priority: int | None = Field(
        None,
        description="kvgate's: the request's band in the gateway's queue when the fleet is "
        "saturated (vLLM's field; lower is served first), within the range the API key allows.",
    )


class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: CacheCreation
    engine_cached_tokens: int = Field(
        description="Tokens the serving engine read from its own cache (physical hits)."
    )


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


ANTHROPIC_SCHEMAS: tuple[type[BaseModel], ...] = (
    MessagesRequest,
    MessageResponse,
    AnthropicErrorResponse,
)

SECURITY_SCHEMES = {"x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}


def openapi_operation() -> dict[str, Any]:
    """The `openapi_extra` of `POST /v1/messages`."""
    error = {"application/json": {"schema": {"$ref": _REF.format(model="AnthropicErrorResponse")}}}
    return {
        "security": [{"x-api-key": []}, {"bearer": []}],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(model="MessagesRequest")}}
            },
        },
        "responses": {
            "200": {
                "description": "The message (JSON), or Anthropic's SSE events when stream is true",
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model="MessageResponse")}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **{
                str(status): {"description": why, "content": error}
                for status, why in (
                    (400, "A malformed body, a bad cache_control, or a refused pre-warm"),
                    (401, "A missing, unknown or revoked API key"),
                    (404, "No replica serves the model"),
                    (502, "Every attempt at an engine failed"),
                    (503, "No healthy replica"),
                )
            },
        },
    }
