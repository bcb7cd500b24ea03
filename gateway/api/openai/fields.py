"""The fields kvgate forwards to an engine, per OpenAI route: an allow-list, not a deny-list.

An OpenAI-compatible engine (vLLM, SGLang) accepts many fields beyond OpenAI's, and some of them
steer the engine itself rather than the sampling: `kv_transfer_params` names KV blocks another
request computed (a way around the salt's isolation), `vllm_xargs` / `logits_processors` reach
custom extensions, a chosen `request_id` may collide with another tenant's. So a body passes
only with fields from three lists, each field with its reason, and anything else is a 400
that names it (docs/api.md):

- what OpenAI's API defines for the route (the SDKs send these, and an engine that does not
  support one answers its own 4xx, relayed as is);
- the sampling extras vLLM and SGLang accept that only shape this request's decoding (load
  tools such as aiperf and inference-perf send `ignore_eos`, `min_tokens`, `top_k`, ...);
- kvgate's own billing hints, which the gateway reads and strips (`TOP_LEVEL_KEYS`), and
  `priority` (vLLM's name), which flow control reads and strips: it orders the gateway's queue,
  within the tenant's allowed range, and never reaches the engine's.

Fields that change the prompt the engine sees after the gateway has hashed it
(`chat_template`, `add_generation_prompt`, `truncate_prompt_tokens`, `documents`, ...) are
refused too: the directory would then predict a prefix the engine never cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gateway.errors import InvalidRequest
from gateway.request.cache_control import TOP_LEVEL_KEYS

OPENAI_COMMON = frozenset(
    {
        "model",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "user",
    }
)
"""Defined by OpenAI for both routes."""
OPENAI_CHAT = OPENAI_COMMON | {
    "messages",
    "audio",
    "function_call",
    "functions",
    "max_completion_tokens",
    "metadata",
    "modalities",
    "moderation",
    "parallel_tool_calls",
    "prediction",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "service_tier",
    "store",
    "tool_choice",
    "tools",
    "top_logprobs",
    "verbosity",
    "web_search_options",
}
"""`POST /v1/chat/completions` as OpenAI's API defines it (the openai SDK's parameters)."""
OPENAI_COMPLETION = OPENAI_COMMON | {"prompt", "best_of", "echo", "suffix", "prompt_cache_key"}
"""`POST /v1/completions` as OpenAI's API defines it (`prompt_cache_key` names the end user of
a `user`-scoped tenant on either route)."""

SAMPLING_EXTRAS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "bad_words",
        "allowed_token_ids",
    }
)
"""vLLM's (and SGLang's) sampling parameters beyond OpenAI's: each only shapes how this
request's own tokens are drawn or when it stops."""

ENGINE_CONTROL = {
    "kv_transfer_params": "names KV blocks computed for another request (disaggregated "
    "serving's hand-off), which would bypass the cache isolation",
    "bootstrap_room": "names another request's KV hand-off (SGLang's disaggregated serving), "
    "which would bypass the cache isolation",
    "bootstrap_host": "names a prefill instance for SGLang's KV hand-off; the gateway sets it",
    "bootstrap_port": "names a prefill instance for SGLang's KV hand-off; the gateway sets it",
    "vllm_xargs": "passes arguments to engine extensions",
    "logits_processors": "loads engine-side code by name",
    "request_id": "sets the engine's own request id, which must be unique across tenants",
    "cache_salt": "is set by the gateway from your API key and may not be sent",
    "chat_template": "changes the prompt the engine renders after kvgate hashed it",
    "chat_template_kwargs": "changes the prompt the engine renders after kvgate hashed it",
    "add_generation_prompt": "changes the prompt the engine renders after kvgate hashed it",
    "continue_final_message": "changes the prompt the engine renders after kvgate hashed it",
    "add_special_tokens": "changes the prompt's tokens after kvgate hashed it",
    "documents": "changes the prompt the engine renders after kvgate hashed it",
    "truncate_prompt_tokens": "cuts the prompt after kvgate hashed it",
    "mm_processor_kwargs": "reconfigures the engine's input processor",
    "prompt_logprobs": "recomputes the whole prompt, bypassing the prefix cache",
    "use_beam_search": "runs several generations per request (kvgate routes one)",
    "length_penalty": "applies to beam search, which kvgate does not route",
}
"""Engine fields refused with the reason (the message names it)."""

GATEWAY_FIELDS = frozenset(TOP_LEVEL_KEYS) | {"priority"}
"""Read and stripped by the gateway, never forwarded."""
CHAT_FIELDS = OPENAI_CHAT | SAMPLING_EXTRAS | GATEWAY_FIELDS
COMPLETION_FIELDS = OPENAI_COMPLETION | SAMPLING_EXTRAS | GATEWAY_FIELDS


def check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """A 400 naming the first field (in sorted order) that `allowed` does not hold."""
    if allowed.issuperset(body):
        return
    field = min(_unknown(body, allowed))
    reason = ENGINE_CONTROL.get(field)
    if reason is not None:
        message = f"'{field}' {reason}; it is not forwarded (see docs/api.md)"
    else:
        message = (
            f"unknown field '{field}': kvgate forwards OpenAI's fields and the sampling extras "
            f"listed in docs/api.md ({', '.join(sorted(SAMPLING_EXTRAS))})"
        )
    raise InvalidRequest(message, param=field, code="unsupported_field")


def _unknown(body: Iterable[str], allowed: frozenset[str]) -> list[str]:
    return [name for name in body if name not in allowed]
