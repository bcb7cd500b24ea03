"""The usage object a client of each profile sees on the OpenAI-shaped path."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.billing.pricing.usage import merge_into_openai_usage
from gateway.billing.simulate import simulate

PROFILES = {
    "anthropic": "sonnet-5",
    "openai": "gpt-5.6",
    "openai_legacy": "gpt-4o",
    "google_implicit": "gemini-3.1-pro",
    "deepseek": "deepseek-v4.1-flash",
}


def second_charge(profile: str) -> Any:
    segments = [{"id": "ctx", "tokens": 6000, "cache_control": {}}]
    lines = [
        json.dumps({"t": 0, "segments": segments, "output_tokens": 5}),
        json.dumps(
            {"t": 30, "segments": [*segments, {"id": "q", "tokens": 500}], "output_tokens": 5}
        ),
    ]
    return simulate(lines, profile, PROFILES[profile]).rows[1].charge


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cached_tokens_become_the_contracts_and_the_profiles_fields_join(profile: str) -> None:
    charge = second_charge(profile)
    engine = {
        "prompt_tokens": 6500,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 6496},
        "engine_cached_tokens": 6496,
    }
    merge_into_openai_usage(profile, charge, engine)
    assert engine["prompt_tokens_details"]["cached_tokens"] == charge.read
    assert engine["engine_cached_tokens"] == 6496  # the physical truth stays
    expected: dict[str, set[str]] = {
        "anthropic": {
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
            "cache_creation",
        },
        "openai": set(),
        "openai_legacy": set(),
        "google_implicit": {"usageMetadata"},
        "deepseek": {"prompt_cache_hit_tokens", "prompt_cache_miss_tokens"},
    }
    base = {"prompt_tokens", "completion_tokens", "prompt_tokens_details", "engine_cached_tokens"}
    assert set(engine) == base | expected[profile]
    if profile == "openai":
        assert engine["prompt_tokens_details"]["cache_write_tokens"] == 500
    if profile == "deepseek":
        assert engine["prompt_cache_hit_tokens"] + engine["prompt_cache_miss_tokens"] == 6500
    if profile == "google_implicit":
        assert engine["usageMetadata"]["cachedContentTokenCount"] == 6000
    if profile == "anthropic":
        assert engine["cache_read_input_tokens"] == 6000 and engine["input_tokens"] == 500
