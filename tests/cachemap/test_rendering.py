"""The canonical rendering: prefix-monotone and independent of JSON key order."""

from __future__ import annotations

import base64
import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachemap.keys import chain_hashes, root_hash
from cachemap.rendering import (
    GENERATION_PROMPT,
    MAX_JSON_DEPTH,
    NestingError,
    render_chat,
    render_completion,
    too_deep,
)

text = st.text(max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": text}
)


@given(st.lists(message, min_size=1, max_size=6), st.lists(message, min_size=1, max_size=4))
def test_appending_messages_appends_to_the_rendering(
    history: list[dict[str, str]], more: list[dict[str, str]]
) -> None:
    first = render_chat(history)
    assert render_chat(history + more).startswith(first.removesuffix(GENERATION_PROMPT))


@given(st.lists(message, min_size=1, max_size=4), text)
def test_the_generation_prompt_is_a_prefix_of_the_next_turn(
    history: list[dict[str, str]], reply: str
) -> None:
    turn = render_chat(history)
    nxt = render_chat([*history, {"role": "assistant", "content": reply}])
    assert nxt.startswith(turn)


def test_tools_come_first_with_sorted_keys_whatever_the_client_order() -> None:
    tool_a = {"type": "function", "function": {"name": "ls", "parameters": {"b": 1, "a": 2}}}
    tool_b = {"function": {"parameters": {"a": 2, "b": 1}, "name": "ls"}, "type": "function"}
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    a, b = render_chat(messages, [tool_a]), render_chat(messages, [tool_b])
    assert a == b
    assert a.index("tools") < a.index("system") < a.index("user")
    assert '{"a":2,"b":1}' in a


def test_string_content_and_text_parts_render_alike() -> None:
    as_string = [{"role": "user", "content": "hello world"}]
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
        }
    ]
    assert render_chat(as_string) == render_chat(as_parts)


def test_an_images_bytes_are_in_the_rendering_so_another_image_parts_the_chain() -> None:
    """Approximate mode's identity of an image is its data URL (the bytes, base64): the same
    text with another image shares only the blocks before the image (issue 16's images)."""

    def turn(image: bytes) -> list[dict[str, Any]]:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content = [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        return [{"role": "system", "content": "S" * 600}, {"role": "user", "content": content}]

    root = root_hash(b"tenant", "m")
    cat, dog = (render_chat(turn(b"cat" * 200)).encode(), render_chat(turn(b"dog" * 200)).encode())
    assert render_chat(turn(b"cat" * 200)).encode() == cat
    a, b = chain_hashes(cat, root), chain_hashes(dog, root)
    before = next(i for i, (x, y) in enumerate(zip(cat, dog, strict=True)) if x != y) // 256
    assert before >= 2 and a[:before] == b[:before]
    assert not set(a[before:]) & set(b)


def test_tool_call_arguments_are_canonical_json() -> None:
    def call(arguments: str) -> list[dict[str, object]]:
        fn = {"name": "read", "arguments": arguments}
        return [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
            }
        ]

    assert render_chat(call('{"path": "a", "n": 1}')) == render_chat(call('{"n":1,"path":"a"}'))
    assert render_chat(call("not json")) != render_chat(call("not  json"))


def test_completion_prompts() -> None:
    assert render_completion("abc") == "abc"
    assert render_completion([1, 2, 3]) == "<|token_ids|>1 2 3"


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_nesting_is_limited_at_max_json_depth_whatever_the_shape() -> None:
    assert not too_deep(_nested(MAX_JSON_DEPTH)) and too_deep(_nested(MAX_JSON_DEPTH + 1))
    assert not too_deep({"a": _nested(MAX_JSON_DEPTH - 1)})
    assert too_deep({"a": [{"b": _nested(MAX_JSON_DEPTH - 2)}]})
    assert not too_deep("[[[[") and not too_deep(7)
    # an integer orjson cannot serialize: the tree is walked instead, with the same answer
    assert not too_deep({"big": 10**30, "a": _nested(MAX_JSON_DEPTH - 1)})
    assert too_deep({"big": 10**30, "a": _nested(MAX_JSON_DEPTH)})


def test_orjsons_recursion_guard_is_where_too_deep_counts_on_it() -> None:
    """`too_deep` relies on orjson refusing the 255th level: pin it."""
    orjson.dumps(_nested(254))
    with pytest.raises(TypeError, match="Recursion limit reached"):
        orjson.dumps(_nested(255))


def test_tool_call_arguments_nested_too_deep_are_a_nesting_error() -> None:
    for arguments in ("[" * 3000 + "]" * 3000, json.dumps(_nested(MAX_JSON_DEPTH + 1))):
        call = {"id": "c", "function": {"name": "f", "arguments": arguments}}
        with pytest.raises(NestingError, match="nest deeper than 64"):
            render_chat([{"role": "assistant", "tool_calls": [call]}])
    fine = {"id": "c", "function": {"name": "f", "arguments": json.dumps(_nested(10))}}
    assert "<|tool_call|>" in render_chat([{"role": "assistant", "tool_calls": [fine]}])


def test_many_shallow_containers_are_not_too_deep_and_one_deep_among_them_is() -> None:
    """Past `MAX_JSON_DEPTH` containers the count gives up and the serialization answers."""
    shallow = {"messages": [{"role": "user", "content": [{"type": "text"}]} for _ in range(200)]}
    assert not too_deep(shallow)
    shallow["messages"].append({"content": _nested(MAX_JSON_DEPTH - 2)})
    assert too_deep(shallow)
    # a body of one long message (the bench's shape) is 3 containers: the count alone answers
    assert not too_deep({"model": "m", "messages": [{"role": "user", "content": "[{" * 5000}]})
