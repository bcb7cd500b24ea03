"""The canonical rendering: prefix-monotone and independent of JSON key order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachemap.rendering import GENERATION_PROMPT, render_chat, render_completion

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
