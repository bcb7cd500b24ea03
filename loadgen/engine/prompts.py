"""What a request asks the engine to tokenize, and the answers of vLLM's tokenizer endpoints.

A chat request (`messages`) is rendered with the model's chat template and tokenized with its
BPE (`loadgen.engine.tokenizer`), as vLLM does: `add_generation_prompt` (default true),
`continue_final_message` (default false; both true is a 400), `tools`. A completion request's
`prompt` is a string (or a list of one string), tokenized as it is, or a list of token ids,
taken as they are once each is checked to be in the vocabulary. Every malformed request is a
`BadRequest` (400) naming what is wrong. `RenderedPrompts` keeps what the tokenizer endpoints
tokenized for the one generation that follows them.

Answers, in vLLM's shapes: `/tokenize` → `{count, max_model_len, tokens, token_strs}`,
`/detokenize` → `{prompt}`, `/v1/chat/completions/render` → one `GenerateRequest`
(`{request_id, token_ids, features, sampling_params, model, stream, stream_options,
cache_salt, priority, kv_transfer_params}`), `/v1/completions/render` → a list of them.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from cachemap.chat_template import ChatTemplateError
from cachemap.multimodal import DEFAULT_TOKENS_PER_IMAGE, Placeholder
from loadgen.engine.tokenizer import default_tokenizer

_RENDERED_PROMPTS = 256
"""Prompts tokenized by /tokenize or a /render endpoint whose ids are kept for one generation:
a router that renders a request on every worker (vllm-router's cache_aware) sends the same text
N + 1 times, and the simulator's own tokenizer cost must not be what a benchmark measures.
A generation takes the ids out, and generations never store any, so a repeated request is
tokenized again, as in vLLM: a cache of tokenizations would be a timing channel vLLM does not
have (the timing audit's positive control finds a repeat ~1 ms faster otherwise). Keyed by
`cache_salt` too, so a render for one tenant never speeds up another's request."""


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false")
    return value


def _salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string")
    return salt


def prompt_text(body: dict[str, Any], chat: bool) -> str | list[int]:
    """The text the engine tokenizes (a chat: its rendering), or a token-id prompt
    (`cachemap.tokenizer.ModelTokenizer.prompt_of`, the gateway's precise mode's too)."""
    try:
        return default_tokenizer().prompt_of(body, chat)
    except ChatTemplateError as exc:
        raise BadRequest(str(exc)) from None


def check_ids(ids: list[Any], name: str) -> list[int]:
    """`ids` when each is a token id of the vocabulary, else a `BadRequest` naming the first."""
    try:
        return default_tokenizer().check_ids(ids, name)
    except ChatTemplateError as exc:
        raise BadRequest(str(exc)) from None


class RenderedPrompts:
    """One engine's prompt token ids, with those of its last renders kept for one generation
    each (see `_RENDERED_PROMPTS`): LRU, at most `_RENDERED_PROMPTS` entries. A chat's images
    expand into `tokens_per_image` placeholder ids each (`cachemap.multimodal`): what the
    engine caches, and what /tokenize answers."""

    def __init__(self, tokens_per_image: int = DEFAULT_TOKENS_PER_IMAGE) -> None:
        self.tokens_per_image = tokens_per_image
        self._kept: OrderedDict[tuple[str, str | None], tuple[int, ...]] = OrderedDict()

    def ids(self, body: dict[str, Any], chat: bool, *, rendering: bool = False) -> tuple[int, ...]:
        """The prompt's token ids, images expanded. `rendering` (the /tokenize and /render
        endpoints): keep them for the generation of the same text and salt, which takes them."""
        return self.prompt(body, chat, rendering=rendering)[0]

    def prompt(
        self, body: dict[str, Any], chat: bool, *, rendering: bool = False
    ) -> tuple[tuple[int, ...], tuple[Placeholder, ...]]:
        """`ids`, and each image's span (identifier, offset, length) in them."""
        ids = self._text_ids(body, chat, rendering)
        try:
            expanded, spans = default_tokenizer().with_images(
                ids, body, chat, self.tokens_per_image
            )
        except ChatTemplateError as exc:
            raise BadRequest(str(exc)) from None
        return (tuple(expanded), spans) if spans else (ids, ())

    def _text_ids(self, body: dict[str, Any], chat: bool, rendering: bool) -> tuple[int, ...]:
        """The ids of the prompt's text (one placeholder per image), kept as `ids` says: the
        images are not in the key, and need not be (their spans are found again each time)."""
        text = prompt_text(body, chat)
        if not isinstance(text, str):
            return tuple(text)
        key = (text, _salt(body))
        if not rendering:
            kept = self._kept.pop(key, None)
            return kept if kept is not None else tuple(default_tokenizer().encode(text))
        ids = self._kept.pop(key, None) or tuple(default_tokenizer().encode(text))
        self._kept[key] = ids
        if len(self._kept) > _RENDERED_PROMPTS:
            self._kept.popitem(last=False)
        return ids

    def __len__(self) -> int:
        return len(self._kept)


def tokenize_response(
    body: dict[str, Any], max_model_len: int, prompts: RenderedPrompts
) -> dict[str, Any]:
    """`/tokenize`: a chat (`messages`) or a `prompt`; `return_token_strs` adds the tokens."""
    ids = list(prompts.ids(body, chat="messages" in body, rendering=True))
    _flag(body, "add_special_tokens", "messages" not in body)  # no BOS/EOS here either way
    strs = default_tokenizer().token_strs(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_response(body: dict[str, Any]) -> dict[str, Any]:
    """`/detokenize`: the text of `tokens`, special tokens included."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids")
    return {"prompt": default_tokenizer().decode(check_ids(tokens, "tokens"))}


def render_response(body: dict[str, Any], chat: bool, model: str, prompts: RenderedPrompts) -> Any:
    """`/v1/chat/completions/render` (one GenerateRequest) or `/v1/completions/render` (a list
    of one): the prompt's token ids and what the generation would be sent with."""
    ids = list(prompts.ids(body, chat, rendering=True))
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    generate = {
        "request_id": body.get("request_id") or uuid.uuid4().hex,
        "token_ids": ids,
        "features": None,
        "sampling_params": {"max_tokens": max_tokens, "n": 1},
        "model": body.get("model") or model,
        "stream": body.get("stream") is True,
        "stream_options": body.get("stream_options"),
        "cache_salt": _salt(body),
        "priority": 0,
        "kv_transfer_params": None,
    }
    return generate if chat else [generate]
