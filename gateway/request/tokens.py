"""How many tokens a request's bytes are: the gateway's one estimate.

The gateway does not tokenize (approximate mode): token ids count exactly, text by a
bytes-per-token ratio learned per model from the prompt token counts the engines report, an
exponential moving average over the last ~10 responses (`LEARNING_RATE`), starting from a
configured default until the model's first response. Admission (size limits, rate-limit charges),
routing (prefill estimates) and billing (token positions of a stream's blocks) read this one
estimate, so they never disagree about a request's size.
"""

from __future__ import annotations

import math

from gateway.request.parsed import CHAT, ParsedRequest

LEARNING_RATE = 0.1
"""Weight of each response in the ratio (an EMA over ~10 responses)."""


class TokenEstimator:
    def __init__(self, default_bytes_per_token: float) -> None:
        if default_bytes_per_token <= 0:
            raise ValueError("default_bytes_per_token must be positive")
        self.default_bytes_per_token = default_bytes_per_token
        self._ratios: dict[str, float] = {}

    def bytes_per_token(self, model: str) -> float:
        return self._ratios.get(model, self.default_bytes_per_token)

    def tokens(self, model: str, num_bytes: int) -> float:
        """The estimated tokens of `num_bytes` of rendered prompt."""
        return num_bytes / self.bytes_per_token(model)

    def prompt_tokens(self, parsed: ParsedRequest) -> int:
        """A request's prompt tokens: exact for a completion given as token ids."""
        prompt = parsed.body.get("prompt") if parsed.kind != CHAT else None
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            return len(prompt)
        return math.ceil(self.tokens(parsed.model, len(parsed.rendered)))

    def learn(self, model: str, num_bytes: int, prompt_tokens: int) -> None:
        """An engine counted `prompt_tokens` for `num_bytes` of rendered prompt."""
        if prompt_tokens <= 0 or num_bytes <= 0:
            return
        observed = num_bytes / prompt_tokens
        old = self._ratios.get(model)
        self._ratios[model] = observed if old is None else old + LEARNING_RATE * (observed - old)
