"""The OpenAI-compatible request and response shapes, declared for the OpenAPI document.

Handlers parse bodies by hand (`gateway.api.openai.parse`), so these models never run on the hot
path; they document what the gateway accepts, and schemathesis generates requests from them. Keep
them in step with the rules in `gateway.api.openai.parse` and the allow-list in
`gateway.api.openai.fields` (the request models are closed: a field they do not declare is a 400).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class _Sampling(_Closed):
    model: str = Field(min_length=1, description="A model served by the engines (GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(None, description="An end-user id (a per-user isolation scope).")
    prompt_cache_key: str | None = Field(
        None, description="OpenAI's routing hint; names the end user when `user` is absent."
    )
    # -- vLLM's sampling extras (gateway.api.openai.fields.SAMPLING_EXTRAS) --
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # -- billing hints, read and stripped by the gateway (docs/billing.md) --
    cache_control: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # -- flow control, read and stripped by the gateway (docs/flow-control.md) --
    priority: int | None = Field(
        None,
        description="The request's band in the gateway's queue when the fleet is saturated "
        "(vLLM's field; lower is served first), within the range the API key allows.",
    )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    cached_content: str | None = Field(
        None, description="An explicit cached content's id (google_explicit billing)."
    )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(
        description="A string, a list of one string, or a list of token ids (0 <= id < 2^31)."
    )
    best_of: Literal[1] | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


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
