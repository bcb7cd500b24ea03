"""Usage fields in each profile's own names (docs/billing.md#profiles), from a `Charge`.

- anthropic: `input_tokens` = U (after the last breakpoint), `cache_creation_input_tokens` = W
  = `cache_creation.ephemeral_5m_input_tokens + ephemeral_1h_input_tokens`,
  `cache_read_input_tokens` = R, `output_tokens`.
- openai (5.6): `prompt_tokens` includes cached and written; `prompt_tokens_details.cached_tokens`
  = R, `prompt_tokens_details.cache_write_tokens` = W.
- openai_legacy: `prompt_tokens`, `prompt_tokens_details.cached_tokens` (no write field).
- google_*: `usageMetadata.promptTokenCount` includes `cachedContentTokenCount` = R; W is never
  reported.
- deepseek: `prompt_cache_hit_tokens` = R, `prompt_cache_miss_tokens` = U, `prompt_tokens` = R + U.
"""

from __future__ import annotations

from typing import Any

from gateway.billing.pricing.model import Charge


def profile_usage(profile: str, charge: Charge) -> dict[str, Any]:
    """The usage object a client of this profile's API would receive."""
    n, o = charge.num_prompt_tokens, charge.num_output_tokens
    if profile == "anthropic":
        return {
            "input_tokens": charge.uncached,
            "cache_creation_input_tokens": charge.num_written,
            "cache_read_input_tokens": charge.read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": charge.written.get("5m", 0),
                "ephemeral_1h_input_tokens": charge.written.get("1h", 0),
            },
            "output_tokens": o,
        }
    if profile in ("openai", "openai_legacy"):
        details: dict[str, int] = {"cached_tokens": charge.read}
        if profile == "openai":
            details["cache_write_tokens"] = charge.num_written
        return {
            "prompt_tokens": n,
            "completion_tokens": o,
            "total_tokens": n + o,
            "prompt_tokens_details": details,
        }
    if profile in ("google_implicit", "google_explicit"):
        return {
            "usageMetadata": {
                "promptTokenCount": n,
                "cachedContentTokenCount": charge.read,
                "candidatesTokenCount": o,
                "totalTokenCount": n + o,
            }
        }
    assert profile == "deepseek", profile
    return {
        "prompt_tokens": n,
        "prompt_cache_hit_tokens": charge.read,
        "prompt_cache_miss_tokens": charge.uncached,
        "completion_tokens": o,
        "total_tokens": n + o,
    }


def flat_usage(usage: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested usage fields as dotted names (for one-line display)."""
    out: dict[str, Any] = {}
    for key, value in usage.items():
        if isinstance(value, dict):
            out.update(flat_usage(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def merge_into_openai_usage(profile: str, charge: Charge, usage: dict[str, Any]) -> None:
    """Rewrite an OpenAI-shaped usage object in place with the contract's numbers.

    `prompt_tokens_details.cached_tokens` becomes the contract's R under every profile (the
    engine's physical hit stays in `engine_cached_tokens`); the profile's own fields join the
    object (OpenAI-compatible providers add theirs at the top level the same way: DeepSeek's
    `prompt_cache_hit_tokens`, Anthropic-style `cache_*_input_tokens`, Google's
    `usageMetadata` as an extension field).
    """
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = {}
        usage["prompt_tokens_details"] = details
    details["cached_tokens"] = charge.read
    native = profile_usage(profile, charge)
    if profile == "openai":
        details["cache_write_tokens"] = charge.num_written
    elif profile == "anthropic":
        for key in (
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
            "cache_creation",
        ):
            usage[key] = native[key]
    elif profile == "deepseek":
        usage["prompt_cache_hit_tokens"] = native["prompt_cache_hit_tokens"]
        usage["prompt_cache_miss_tokens"] = native["prompt_cache_miss_tokens"]
    elif profile in ("google_implicit", "google_explicit"):
        usage["usageMetadata"] = native["usageMetadata"]
