"""The engine's tokenizer and chat template, as documented in loadgen/engine/tokenizer.py and
loadgen/engine/chat_template.py (golden renderings written out by hand)."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.chat_template import ChatTemplateError
from loadgen.engine.tokenizer import (
    MODEL_DIR,
    EngineTokenizer,
    block_hashes,
    count_tokens,
    default_tokenizer,
)
from loadgen.text import words

TOK = default_tokenizer()
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more of these functions to help with the request.\n\n"
    "The function signatures are inside <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nTo call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_the_vocabulary_is_small_and_the_special_tokens_follow_the_bpe() -> None:
    assert TOK.vocab_size == 4097
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    assert [TOK.encode(t) for t in added] == [[4089], [4090], [4091], [4092], [4093]]
    assert TOK.image_token == "<|image_pad|>" and TOK.encode(TOK.image_token) == [4096]
    assert TOK.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert (MODEL_DIR / "tokenizer.json").stat().st_size < 400_000


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_round_trips(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.count(text) == len(ids)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>", "x y", "\n"])))
def test_special_tokens_in_text_are_matched_and_round_trip(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert TOK.decode(TOK.encode(text)) == text


def test_every_single_token_word_is_one_token_and_many_exist() -> None:
    assert len(TOK.words) >= 1500
    assert len(set(TOK.words)) == len(TOK.words)
    for word, token_id in zip(TOK.words, TOK.word_ids, strict=True):
        assert word[0] == " " and word[1:].isalpha() and word[1:].islower()
        assert TOK.encode(word) == [token_id], word
        assert TOK.pieces([token_id]) == [word]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 10**6), min_size=1, max_size=60),
    st.sampled_from(["", "\n", "Task:", "<|im_start|>user\n", "x.", "42"]),
    st.sampled_from(["", "\n", ".", "<|im_end|>", " 7", "?"]),
)
def test_words_concatenate_into_exactly_their_ids(
    picks: list[int], before: str, after: str
) -> None:
    chosen = [TOK.words[p % len(TOK.words)] for p in picks]
    ids = [TOK.word_ids[p % len(TOK.words)] for p in picks]
    encoded = TOK.encode(before + "".join(chosen) + after)
    head, tail = TOK.encode(before), TOK.encode(after)
    assert encoded == head + ids + tail


def test_every_letter_after_a_space_is_one_token() -> None:
    # as in real vocabularies; the timing audit's random-letter prompts count on it
    assert [TOK.count(" " + c) for c in string.ascii_letters] == [1] * 52


def test_synthetic_words_are_exact_and_deterministic() -> None:
    assert count_tokens(words(3, 1234)) == 1234
    assert words("a", 50) == words("a", 50) != words("b", 50)
    assert count_tokens("Context:" + words("c", 300) + "\n") == count_tokens("Context:\n") + 300


def test_output_tokens_are_words_whose_pieces_add_up() -> None:
    ids = TOK.output_ids(seed=12345, count=40)
    assert ids == TOK.output_ids(seed=12345, count=40) != TOK.output_ids(seed=1, count=40)
    assert set(ids) <= set(TOK.word_ids)
    assert "".join(TOK.pieces(ids)) == TOK.decode(ids)
    assert TOK.encode(TOK.decode(ids)) == ids


def test_block_hashes_chain_full_blocks_salted_at_block_zero() -> None:
    ids = list(range(40))
    plain = block_hashes(ids, 16, None)
    assert len(plain) == 2  # 40 tokens: two full blocks, the tail is not hashed
    assert block_hashes(ids[:32], 16, None) == plain
    assert block_hashes(ids, 16, "tenant-a")[0] != plain[0]
    changed = block_hashes([*ids[:16], 99, *ids[17:]], 16, None)  # token 16 is in block 1
    assert changed[0] == plain[0] and changed[1] != plain[1]
    assert block_hashes(list(range(48)), 16, None, resume=plain)[:2] == plain
    assert block_hashes(list(range(48)), 16, None, resume=plain) == block_hashes(
        list(range(48)), 16, None
    )


# -- the chat template --------------------------------------------------------------------
def test_a_multi_turn_chat_renders_as_chatml() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
    ]
    assert TOK.render_chat(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\none\ntwo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = TOK.render_chat(messages[1:2], add_generation_prompt=False)
    assert without == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_calls_and_results_render_as_qwen_does() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read a.py and b.py"},
        {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "call_2", "content": "print(2)"},
        {"role": "assistant", "content": "Both print."},
    ]
    tool_json = json.dumps(READ_FILE)  # tojson: default spacing, the client's key order
    tool_call = '\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    assert TOK.render_chat(messages, [READ_FILE], add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.\n\n"
        + TOOLS_PREAMBLE
        + tool_json
        + TOOLS_POSTAMBLE
        + "<|im_start|>user\nRead a.py and b.py<|im_end|>\n"
        "<|im_start|>assistant" + tool_call + tool_call + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response>"
        "\n<tool_response>\nprint(2)\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nBoth print.<|im_end|>\n"
    )
    # tools without a system message still open a system turn; no default system prompt
    assert TOK.render_chat([{"role": "user", "content": "x"}], [READ_FILE]).startswith(
        "<|im_start|>system\n" + TOOLS_PREAMBLE
    )


def test_the_template_is_prefix_monotone_over_turns() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b c"}]
    turn = TOK.render_chat(history[:1])
    nxt = TOK.render_chat([*history, {"role": "user", "content": "d"}])
    assert nxt.startswith(turn + " b c")
    assert TOK.encode(nxt)[: len(TOK.encode(turn))] == TOK.encode(turn)


def test_continue_final_message_stops_inside_the_last_message() -> None:
    messages = [
        {"role": "user", "content": "Write a poem"},
        {"role": "assistant", "content": "Roses are "},
    ]
    rendered = TOK.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered == "<|im_start|>user\nWrite a poem<|im_end|>\n<|im_start|>assistant\nRoses are "
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        TOK.render_chat(messages, continue_final_message=True)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"content": "x"}], "'role' must be a non-empty string"),
        ([{"role": "user", "content": 3}], "'content' must be"),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "'input_audio' is not supported by this model",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
            "not valid JSON",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "a tool call needs a function name",
        ),
        (["not an object"], "must be an object"),
    ],
)
def test_malformed_conversations_are_refused_with_the_reason(
    messages: list[Any], message: str
) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        TOK.render_chat(messages)


def test_empty_tool_calls_take_the_plain_assistant_path() -> None:
    messages = [{"role": "assistant", "content": "ok", "tool_calls": []}]
    assert TOK.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>assistant\nok<|im_end|>\n"
    )


def test_the_template_runs_sandboxed() -> None:
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    from cachemap.chat_template import ChatTemplate

    with pytest.raises(ChatTemplateError, match="cannot render"):
        ChatTemplate(evil, {}).render([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append(1) %}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(mutate, {}).render([{"role": "user", "content": "x"}])


_ATTRIBUTES = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.name is defined }}|"
    "{{ m.tool_calls or '-' }}|{{ m.get('role') }}|{{ m.keys() | list | length }}|"
    "{{ m.items is callable }}|{{ m['content'] }}|{{ m.missing | default('d') }}\n"
    "{% endfor %}"
)


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(["role", "content", "name", "tool_calls", "items", "get", "keys"]),
            st.text(max_size=5),
            min_size=1,
        ),
        min_size=1,
        max_size=4,
    )
)
@settings(max_examples=60, deadline=None)
def test_attributes_of_messages_render_as_in_the_plain_sandbox(
    messages: list[dict[str, str]],
) -> None:
    """`message.role` on a dict is answered without the sandbox's raise-and-catch: the same
    text as the sandbox itself, for present and missing keys and keys named like dict
    methods (`m.items`, `m.get`: the method, as before)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from cachemap.chat_template import _compile

    plain = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    ).from_string(_ATTRIBUTES)
    assert _compile(_ATTRIBUTES).render(messages=messages) == plain.render(messages=messages)


_GLOBALS = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m.role == 'stop' %}{{ raise_exception('no ' + m.content) }}{% endif %}"
    "{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ ns.n }}{{ m.role }}:{{ m.content | tojson }}{% for i in range(2) %}.{% endfor %}"
    "{% endfor %}{{ cycler('a', 'b').next() }}{{ joiner(',')() }}"
    "{% if add_generation_prompt %}{{ eos_token }}{% endif %}{{ tools | length }}"
    "{{ strftime_now('%Y') | length }}"
)


@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "skip", "stop"]), "content": st.text()}
        ),
        max_size=4,
    ),
    st.booleans(),
)
@settings(max_examples=80, deadline=None)
def test_a_render_equals_jinjas_own_with_the_globals_it_flattens(
    messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    """`ChatTemplate.render` builds its context with the globals flattened once (not merged
    from their `ChainMap` per render): the same text as `jinja2.Template.render` with every
    kind of global (namespace, range, cycler, joiner, ours), and the same error."""
    from cachemap.chat_template import ChatTemplate, _compile

    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    template = ChatTemplate(_GLOBALS, tokens)
    try:
        expected = _compile(_GLOBALS).render(
            messages=messages, tools=[{}], add_generation_prompt=add_generation_prompt, **tokens
        )
    except jinja2.TemplateError as exc:
        with pytest.raises(ChatTemplateError, match=re.escape(str(exc))):
            template.render(messages, [{}], add_generation_prompt=add_generation_prompt)
        return
    got = template.render(messages, [{}], add_generation_prompt=add_generation_prompt)
    assert got == expected


def test_a_dicts_methods_stay_sandboxed() -> None:
    """The fast path leaves a dict method's name to the sandbox: mutating one is refused."""
    from cachemap.chat_template import ChatTemplate

    pop = "{{ messages[0].pop('role') }}"
    with pytest.raises(ChatTemplateError, match="cannot render"):
        ChatTemplate(pop, {}).render([{"role": "user", "content": "x"}])
    dunder = "{{ messages[0].__class__.__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="cannot render"):
        ChatTemplate(dunder, {}).render([{"role": "user", "content": "x"}])


def test_another_model_directory_loads_the_same_way(tmp_path: Any) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((MODEL_DIR / name).read_bytes())
    other = EngineTokenizer(tmp_path)
    text = "".join(random.Random(0).choices(TOK.words, k=100))
    assert other.encode(text) == TOK.encode(text) and other.words == TOK.words
