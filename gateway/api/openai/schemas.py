"""The OpenAI-compatible request and response shapes, declared for the OpenAPI document.

Handlers parse bodies by hand (`gateway.request.parsed`), so these models never run on the hot path;
they document what the gateway accepts, and schemathesis generates requests from them. Keep them
in step with the rules in `gateway.request.parsed`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(_Open):
    model: str = Field(min_length=1, description="A model served by the engines (GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = Field(None, description="An end-user id (a per-user isolation scope).")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(
        description="A string, a list of one string, or a list of token ids (0 <= id < 2^31)."
    )


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    engine_cached_tokens: int = Field(
        description="Tokens the serving engine read from its own cache (physical hits)."
    )


class CompletionResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


SCHEMAS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
