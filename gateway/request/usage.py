"""The engine's usage object, parsed once.

vLLM and SGLang report `usage` in OpenAI's shape; the physical prefix-cache hit is
`prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`). Every stage
reads the same counts from one `EngineUsage`, parsed when the usage arrives; the wire object
itself (`fields`) is what the client will see, and billing may rewrite it first (its profile's
fields, the contract's `cached_tokens`). The engine's own hit stays in `cached_tokens` here and in
`fields["engine_cached_tokens"]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _count(value: Any) -> int | None:
    """A token count as the engine sent it: a non-negative int, else unknown."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


@dataclass(slots=True)
class EngineUsage:
    fields: dict[str, Any]
    """The usage object on the wire (rewritten in place by billing, then sent to the client)."""
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    cached_tokens: int
    """The engine's physical prefix-cache hit (0 when it did not say)."""
    cached_reported: bool = True
    """Whether the engine said (`prompt_tokens_details.cached_tokens`: vLLM only with
    `--enable-prompt-tokens-details`): an answer without it says nothing about the cache."""

    @classmethod
    def parse(cls, fields: dict[str, Any]) -> EngineUsage:
        """Read the counts and add `engine_cached_tokens` (the physical hit) to the object."""
        details = fields.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        fields["engine_cached_tokens"] = cached or 0
        return cls(
            fields,
            prompt_tokens=_count(fields.get("prompt_tokens")),
            completion_tokens=_count(fields.get("completion_tokens")),
            total_tokens=_count(fields.get("total_tokens")),
            cached_tokens=cached or 0,
            cached_reported=cached is not None,
        )

    @property
    def used_tokens(self) -> int | None:
        """Prompt plus completion: what a tokens/min budget is charged."""
        if self.total_tokens is not None:
            return self.total_tokens
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens
