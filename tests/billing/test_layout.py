"""Blocks, marks and token positions of a rendered request; the proportional error bound."""

from __future__ import annotations

import random
from typing import Any

import pytest

from cachemap.rendering import GENERATION_PROMPT, render_chat
from gateway.billing.pricing.layout import (
    BlockCounts,
    chat_layout,
    counted_ends,
    fit_to_total,
    has_marks,
    proportional_ends,
    strip_marks,
)
from gateway.billing.pricing.model import BillingError
from loadgen.engine.tokenizer import count_tokens
from loadgen.text import words


def layout_of(body: dict[str, Any]) -> tuple[bytes, Any]:
    rendered = render_chat(body["messages"], body.get("tools")).encode()
    return rendered, chat_layout(body, rendered)


def test_blocks_end_at_parts_and_messages_and_own_the_generation_prompt() -> None:
    body = {
        "tools": [
            {"type": "function", "function": {"name": "ls"}, "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "A"},
                    {
                        "type": "text",
                        "text": "B",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    },
                ],
            },
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": "answer"},
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": "result",
                "prompt_cache_breakpoint": True,
            },
        ],
    }
    rendered, layout = layout_of(body)
    texts = [rendered[: b.end] for b in layout.blocks]
    assert texts[0].endswith(b"<|im_end|>\n") and layout.blocks[0].mark == ""
    assert texts[1].endswith(b"system\nA") and layout.blocks[1].mark is None
    assert texts[2].endswith(b"B<|im_end|>\n") and layout.blocks[2].mark == "1h"
    assert texts[3].endswith(b"question<|im_end|>\n" + GENERATION_PROMPT.encode())
    assert texts[4].endswith(b"answer<|im_end|>\n")
    assert layout.blocks[5].end == len(rendered) and layout.blocks[5].mark == ""
    assert [b.eligible for b in layout.blocks] == [False, False, False, True, False, True]


def test_a_turns_whole_prompt_is_a_block_prefix_of_the_next_turn() -> None:
    turn1 = {"messages": [{"role": "user", "content": words("t1", 50)}]}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"},
        ]
    }
    r1, l1 = layout_of(turn1)
    _, l2 = layout_of(turn2)
    assert l1.blocks[-1].end == len(r1) == l2.blocks[0].end
    assert l1.keys[0] == l2.keys[0]  # same bytes, same key: the entry is found
    assert l1.keys[0] != layout_of({"messages": [{"role": "user", "content": "other"}]})[1].keys[0]


def test_bad_marks_name_the_field() -> None:
    with pytest.raises(BillingError, match=r"messages\[0\].cache_control must be"):
        layout_of(
            {
                "messages": [
                    {"role": "user", "content": "x", "cache_control": {"type": "persistent"}}
                ]
            }
        )
    with pytest.raises(BillingError, match=r"prompt_cache_options\.mode"):
        layout_of(
            {
                "messages": [{"role": "user", "content": "x"}],
                "prompt_cache_options": {"mode": "eager"},
            }
        )


def test_billing_fields_are_stripped_before_the_engine_sees_them() -> None:
    body = {
        "model": "m",
        "cache_control": {"type": "ephemeral"},
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
            }
        ],
    }
    assert has_marks(body)
    clean = strip_marks(body)
    assert not has_marks(clean)
    assert clean == {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    assert "cache_control" in body  # the original is untouched
    assert not has_marks({"model": "m", "messages": [{"role": "user", "content": "x"}]})


def test_proportional_positions_round_half_up_and_stay_within_the_documented_bound() -> None:
    assert proportional_ends([0, 1, 2, 3, 4], 4, 2) == [0, 1, 1, 2, 2]  # 0.5 → 1, 1.5 → 2
    rng = random.Random(7)
    for trial in range(30):
        messages = []
        for i in range(rng.randint(2, 8)):
            kind = rng.choice(["words", "long", "spaces"])
            n = rng.randint(5, 400)
            if kind == "words":
                text = words(f"{trial}-{i}", n)
            elif kind == "long":  # 8-character tokens: few tokens per byte
                text = "".join(rng.choices("abcdefgh", k=8 * n))
            else:  # one token per whitespace byte: many tokens per byte
                text = " \n" * n
            messages.append({"role": rng.choice(["user", "assistant"]), "content": text})
        rendered, layout = layout_of({"messages": messages})
        ends = [b.end for b in layout.blocks]
        exact = counted_ends(rendered, ends, count_tokens)
        total = count_tokens(rendered.decode())
        assert exact[-1] == total  # blocks split at whitespace tokens: counts add up
        estimate = proportional_ends(ends, len(rendered), total)
        starts = [0, *ends[:-1]]
        densities = [
            (exact[i] - (exact[i - 1] if i else 0)) / (e - s)
            for i, (s, e) in enumerate(zip(starts, ends, strict=True))
        ]
        spread = max(densities) - min(densities)
        size = len(rendered)
        for x, true, guess in zip(ends, exact, estimate, strict=True):
            assert abs(guess - true) <= spread * x * (size - x) / size + 0.5


def test_counted_positions_fit_the_engines_total() -> None:
    assert fit_to_total([10, 20, 30], 33) == [10, 20, 33]  # the template's extra tokens
    assert fit_to_total([10, 20, 30], 25) == [10, 20, 25]
    assert fit_to_total([10, 20, 30], 15) == [10, 15, 15]  # clamped, never more than N


def test_a_continuation_counts_only_the_blocks_it_adds_and_only_within_its_scope() -> None:
    """The billing tokenizer's counts of blocks seen before are kept per scope: a session's
    step counts its new messages, not its whole prompt again; the counts are the same."""
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return count_tokens(text)

    messages: list[dict[str, Any]] = [{"role": "system", "content": words("sys", 300)}]
    cache = BlockCounts()
    for step in range(4):
        messages.append({"role": "user", "content": words(f"u{step}", 200)})
        rendered, layout = layout_of({"messages": messages})
        ends = [b.end for b in layout.blocks]
        counted.clear()
        got = counted_ends(rendered, ends, count, keys=layout.keys, cache=cache, scope="acme")
        assert got == counted_ends(rendered, ends, count_tokens)
        new_blocks = len(ends) if step == 0 else 2  # the last reply and the new message
        assert len(counted) == new_blocks, step
        messages.append({"role": "assistant", "content": words(f"a{step}", 100)})
    counted.clear()
    counted_ends(rendered, ends, count, keys=layout.keys, cache=cache, scope="globex")
    assert len(counted) == len(ends)  # another scope counts for itself


def test_the_block_counts_are_bounded() -> None:
    cache = BlockCounts(max_entries=3)
    for i in range(5):
        cache.put("acme", bytes([i]), i)
    assert len(cache) == 3
    assert cache.get("acme", bytes([0])) is None and cache.get("acme", bytes([4])) == 4
