"""How many tokens a request's bytes are: the gateway's one estimate.

The gateway does not tokenize (approximate mode): token ids count exactly, text by a
bytes-per-token ratio learned **per tenant and model** from the prompt token counts the
engines report for that tenant's own requests, an exponential moving average over the last
~10 responses (`LEARNING_RATE`), starting from a configured default until the tenant's first
response for the model. Admission (size limits, rate-limit charges), routing (prefill
estimates) and billing (token positions of a stream's blocks) read this one estimate, so they
never disagree about a request's size.

Why per tenant: a tenant chooses its text, and text can tokenize at 1 byte a token (digits,
scattered letters) or at 8 (long words). One estimate learned from everyone let a tenant move
every other tenant's — their `max_prompt_tokens` refusals and the 400s' "about N tokens". Each
tenant's requests now move only its own estimate, whose limits are its own; its end users (a
`user` scope) share it, as they share the tenant's policy. Each observation is also clamped to
[`MIN_BYTES_PER_TOKEN`, `MAX_BYTES_PER_TOKEN`], so a tenant cannot push even its own estimate
beyond what a real tokenizer does. The table holds at most `MAX_ESTIMATES` (tenant, model)
pairs, least recently used first out (an evicted pair starts again from the default).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from gateway.request.parsed import CHAT, ParsedRequest

LEARNING_RATE = 0.1
"""Weight of each response in the ratio (an EMA over ~10 responses)."""
MIN_BYTES_PER_TOKEN = 1.0
"""No tokenizer makes a token of less than a byte of UTF-8."""
MAX_BYTES_PER_TOKEN = 8.0
"""BPE tokens of English average ~4 bytes and long ones rarely pass 8 on average over a prompt;
a ratio above that is a prompt built to look small."""
MAX_ESTIMATES = 100_000
"""(tenant, model) pairs remembered: ~100 bytes each, ~10 MB at most."""


def _clamp(ratio: float) -> float:
    return min(max(ratio, MIN_BYTES_PER_TOKEN), MAX_BYTES_PER_TOKEN)


class TokenEstimator:
    def __init__(self, default_bytes_per_token: float) -> None:
        if default_bytes_per_token <= 0:
            raise ValueError("default_bytes_per_token must be positive")
        self.default_bytes_per_token = default_bytes_per_token
        self._ratios: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.fleet_bytes_per_token = default_bytes_per_token
        """The same ratio over every tenant's and model's responses (the first one, then an EMA
        at the same rate; the default until then):
        what a token of the engines' KV holds of prompt text, whoever sent it — what the
        directory's capacity is sized by (`gateway.directory.sizing`), never a tenant's
        estimate."""
        self.fleet_learned = False

    def bytes_per_token(self, model: str, *, tenant: str) -> float:
        return self._ratios.get((tenant, model), self.default_bytes_per_token)

    def tokens(self, model: str, num_bytes: int, *, tenant: str) -> float:
        """The estimated tokens of `num_bytes` of rendered prompt."""
        return num_bytes / self.bytes_per_token(model, tenant=tenant)

    def prompt_tokens(self, parsed: ParsedRequest, *, tenant: str) -> int:
        """A request's prompt tokens: exact for a completion given as token ids."""
        if _token_ids(parsed):
            return len(parsed.body["prompt"])
        return math.ceil(self.tokens(parsed.model, len(parsed.rendered), tenant=tenant))

    def learn(self, parsed: ParsedRequest, prompt_tokens: int, *, tenant: str) -> None:
        """An engine counted `prompt_tokens` for `parsed`'s rendered prompt (a token-id prompt
        counts exactly and teaches nothing about text)."""
        num_bytes = len(parsed.rendered)
        if prompt_tokens <= 0 or num_bytes <= 0 or _token_ids(parsed):
            return
        observed = _clamp(num_bytes / prompt_tokens)
        fleet = self.fleet_bytes_per_token if self.fleet_learned else observed
        self.fleet_bytes_per_token = fleet + LEARNING_RATE * (observed - fleet)
        self.fleet_learned = True
        key = (tenant, parsed.model)
        ratios = self._ratios
        old = ratios.get(key)
        ratios[key] = observed if old is None else old + LEARNING_RATE * (observed - old)
        ratios.move_to_end(key)
        while len(ratios) > MAX_ESTIMATES:
            ratios.popitem(last=False)


def _token_ids(parsed: ParsedRequest) -> bool:
    prompt = parsed.body.get("prompt") if parsed.kind != CHAT else None
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)
