"""The gateway's token ids are the engine's: every front end's request, rendered with the
model's template and tokenized by segments, against a real engine's /tokenize."""

from __future__ import annotations

import array
import itertools
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cachemap.tokenizer import ModelTokenizer
from gateway.api.anthropic.convert import parse_messages
from gateway.api.openai.parse import parse_chat, parse_completion
from gateway.events.precise import PromptTokens
from gateway.events.prompts import firsts_of, special_starts
from gateway.pipeline.keying import engine_body
from gateway.request.parsed import CHAT, ParsedRequest
from loadgen.engine.server import EngineConfig, create_engine_app
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.text import words
from tests.conftest import FAST, MODEL
from tests.gateway.events.tokenizers import merging_tokenizer
from tests.servers import Served, start_app

LIMIT = 1 << 20
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
SYSTEM = {"role": "system", "content": "Be brief." + words("tok-system", 50)}


@pytest.fixture(scope="module")
def engine() -> Iterator[Served]:
    served = start_app(create_engine_app(EngineConfig(timing=FAST)))
    yield served
    served.stop()


def engine_ids(engine: Served, parsed: ParsedRequest) -> list[int]:
    body = engine_body(parsed)
    keys = ("messages", "tools") if parsed.kind == CHAT else ("prompt",)
    ask = {k: body[k] for k in keys if body.get(k) is not None}
    r = httpx.post(engine.url + "/tokenize", json={"model": MODEL, **ask})
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["tokens"]
    return ids


def raw(body: dict[str, Any]) -> bytes:
    return orjson.dumps({"model": MODEL, **body})


CASES = {
    "chat": lambda: parse_chat(
        raw({"messages": [SYSTEM, {"role": "user", "content": "What is in a.py?"}]}), LIMIT
    ),
    "tools": lambda: parse_chat(
        raw(
            {
                "tools": [TOOL],
                "messages": [
                    {"role": "user", "content": "What is in a.py?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
                ],
            }
        ),
        LIMIT,
    ),
    "completions": lambda: parse_completion(raw({"prompt": "Once upon" + words("tok", 80)}), LIMIT),
    "anthropic": lambda: parse_messages(
        raw(
            {
                "max_tokens": 8,
                "system": [
                    {
                        "type": "text",
                        "text": SYSTEM["content"],
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
                "tools": [
                    {
                        "name": "read_file",
                        "description": "Read a file.",
                        "input_schema": {
                            "type": "object",
                            "properties": {"path": {"type": "string"}},
                        },
                    }
                ],
                "messages": [
                    {"role": "user", "content": "What is in a.py?"},
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "tool_use",
                                "id": "t1",
                                "name": "read_file",
                                "input": {"path": "a.py"},
                            }
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}
                        ],
                    },
                ],
            }
        ),
        LIMIT,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gateways_ids_are_the_engines(engine: Served, case: str) -> None:
    parsed = CASES[case]()
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    ids = tokens.ids(engine_body(parsed), parsed.kind == CHAT)
    assert list(ids) == engine_ids(engine, parsed) and len(ids) > 16


def test_a_continuation_tokenizes_only_its_new_messages() -> None:
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": words("turn0", 400)}]
    first = tokens.ids({"messages": messages}, chat=True)
    encoded = tokens.stats.tokens_encoded
    assert encoded <= len(first)  # a repeated segment ("<|im_end|>\\n") is encoded once
    messages += [
        {"role": "assistant", "content": words("reply0", 50)},
        {"role": "user", "content": words("turn1", 30)},
    ]
    second = tokens.ids({"messages": messages}, chat=True)
    whole = tokens.tokenizer.encode(tokens.tokenizer.render_chat(messages))
    assert list(second) == whole and second[: len(first) - 3] == first[: len(first) - 3]
    new = tokens.stats.tokens_encoded - encoded
    # what was encoded again: the two new turns (and the generation prompt), not the 467
    # tokens of the conversation before them
    assert new <= len(second) - len(first) + 3 < 100


def test_the_segment_cache_is_bounded() -> None:
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR), max_cached_tokens=200)
    for i in range(10):
        tokens.ids({"messages": [{"role": "user", "content": words(f"b{i}", 60)}]}, chat=True)
    assert 0 < tokens.cached_tokens <= 200


def test_a_continuation_hashes_only_its_new_blocks() -> None:
    from cachemap.events import precise_keys
    from gateway.events.precise import ChainCache

    chains = ChainCache(16)
    ids = list(range(1000, 1000 + 16 * 40 + 5))
    assert chains.keys(ids, "s") == precise_keys(ids, "s", 16)
    longer = ids[: 16 * 30 + 3] + list(range(3000, 3000 + 16 * 20))  # diverges inside block 30
    assert chains.keys(longer, "s") == precise_keys(longer, "s", 16)
    assert (chains.reused_blocks, chains.hashed_blocks) == (30, 40 + len(longer) // 16 - 30)
    assert chains.keys(ids, "other") == precise_keys(ids, "other", 16)  # another salt: fresh


async def test_a_tokenizer_mismatch_is_counted_and_logged(
    engine: Served, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import aiohttp

    from gateway.events.precise import TokenizerCheck

    config = orjson.loads((MODEL_DIR / "tokenizer_config.json").read_bytes())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (tmp_path / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "hi"}]}
    ours = PromptTokens(ModelTokenizer(MODEL_DIR)).ids(body, chat=True)
    theirs = PromptTokens(ModelTokenizer(tmp_path)).ids(body, chat=True)
    check = TokenizerCheck(every=10)
    assert check.due() and not check.due()  # the first, then every 10th
    async with aiohttp.ClientSession() as session:
        assert await check.check(session, engine.url, body, True, ours) is True
        with caplog.at_level("WARNING"):
            assert await check.check(session, engine.url, body, True, theirs) is False
    assert (check.stats.checks, check.stats.mismatches) == (2, 1)
    assert "disagrees" in caplog.text and engine.url in caplog.text


def conversation(parsed: ParsedRequest) -> list[dict[str, Any]]:
    body = engine_body(parsed)
    messages: list[dict[str, Any]] = body["messages"]  # type: ignore[assignment]
    return messages


TWO_RESULTS = [
    SYSTEM,
    {"role": "user", "content": "What is in a.py and b.py?" + words("tok-two", 40)},
    {
        "role": "assistant",
        "content": "Reading both.",
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": ""}}
            for i in (1, 2)
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
    {"role": "assistant", "content": "Two prints." + words("tok-two-reply", 30)},
    {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "c?"}]},
]


@pytest.mark.parametrize("case", ["chat", "tools", "anthropic", "two tool results"])
def test_a_conversation_keyed_turn_by_turn_has_the_engines_ids(engine: Served, case: str) -> None:
    """Every prefix of the conversation sent in order, as an agent sends its turns: each after
    the first is rendered from the previous one's cached prefix (only its new messages through
    the template), and every one has the ids the engine gives the whole request."""
    if case == "two tool results":
        body: dict[str, Any] = {"model": MODEL, "tools": [TOOL], "messages": TWO_RESULTS}
    else:
        body = dict(engine_body(CASES[case]()))
    messages = body["messages"]
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    for n in range(1, len(messages) + 1):
        for agp in (True, False):
            turn = {**body, "messages": messages[:n], "add_generation_prompt": agp}
            ids = tokens.ids(turn, chat=True, cache_salt="tenant-a")
            ask = {k: turn[k] for k in ("messages", "tools", "add_generation_prompt") if k in turn}
            r = httpx.post(engine.url + "/tokenize", json={"model": MODEL, **ask})
            assert r.status_code == 200, r.text
            assert list(ids) == r.json()["tokens"], (n, agp)
    # every request after the first found a prefix (its own conversation's shorter turn),
    # but for the second of two tool results, whose left neighbour's turn is still open
    # (rendered whole)
    assert tokens.stats.prefix_hits == 2 * len(messages) - 1 - (case == "two tool results")
    assert tokens.stats.incremental_mismatches == 0 and tokens.stats.incremental_checks >= 1


def test_a_continuation_renders_and_encodes_only_its_new_messages() -> None:
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    messages: list[dict[str, Any]] = [SYSTEM]
    for turn in range(6):
        messages.append({"role": "user", "content": words(f"inc-user{turn}", 200)})
        before = tokens.stats.tokens_encoded, tokens.stats.prefix_tokens
        ids = tokens.ids({"messages": messages}, chat=True, cache_salt="s")
        whole = tokens.tokenizer.encode(tokens.tokenizer.render_chat(messages))
        assert list(ids) == whole
        encoded = tokens.stats.tokens_encoded - before[0]
        reused = tokens.stats.prefix_tokens - before[1]
        if turn:
            # the user turn and the reply before it (~300 words), not the conversation
            assert encoded < 400 and reused > len(whole) - 400
        messages.append({"role": "assistant", "content": words(f"inc-reply{turn}", 100)})
    assert tokens.stats.prefix_hits == 5


def test_tenants_share_no_cached_segment_or_prefix() -> None:
    """The same system prompt and turn from two cache salts: the second tenant's request finds
    nothing of the first's (a hit would be faster: a timing oracle), and gets the same ids."""
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    tokens._cut_count = 1  # neither is the sampled check's text (that one goes word by word)
    body = {"messages": [SYSTEM, {"role": "user", "content": words("shared", 100)}]}
    a = tokens.ids(body, chat=True, cache_salt="salt-a")
    first = tokens.stats.tokens_encoded, tokens.stats.segment_hits
    b = tokens.ids(body, chat=True, cache_salt="salt-b")
    assert list(a) == list(b) and first[0] > len(a) / 2
    # tenant B encoded all of it again and hit only its own repeated segments, as A did
    assert (tokens.stats.tokens_encoded, tokens.stats.segment_hits) == (2 * first[0], 2 * first[1])
    assert tokens.stats.prefix_hits == 0
    assert list(tokens.ids(body, chat=True, cache_salt="salt-a")) == list(a)
    assert tokens.stats.prefix_hits == 1 and tokens.stats.tokens_encoded == 2 * first[0]


def test_the_prefix_cache_is_bounded() -> None:
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR), max_prefix_tokens=500)
    for i in range(8):
        messages = [SYSTEM, {"role": "user", "content": words(f"bound{i}", 120)}]
        tokens.ids({"messages": messages}, chat=True, cache_salt="s")
    assert 0 < tokens.prefix_cached_tokens <= 500


def message_keys_from_scratch(salt: str, messages: list[Any], tools: Any) -> list[bytes]:
    """The message keys' definition (`gateway.events.prompts`), a dump and a hash a message."""
    import mmh3

    from gateway.events.prompts import _PROMPTS_DOMAIN

    key = mmh3.mmh3_x64_128_digest(_PROMPTS_DOMAIN + salt.encode() + b"\x00" + orjson.dumps(tools))
    keys = []
    for message in messages:
        key = mmh3.mmh3_x64_128_digest(key + orjson.dumps(message))
        keys.append(key)
    return keys


MESSAGE_VALUES = st.one_of(
    st.text(max_size=6),
    st.integers(-20, 200),
    st.none(),
    st.booleans(),
    st.lists(st.integers(0, 12), max_size=2),
)
MESSAGES = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"]), "content": MESSAGE_VALUES}
        ),
        MESSAGE_VALUES,
    ),
    max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["extend", "same", "cut", "edit", "new"]),
            MESSAGES,
            st.sampled_from(["s", "t"]),
            st.sampled_from([None, [{"n": 1}]]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_message_keys_reused_from_a_conversations_last_list_are_its_keys_from_scratch(
    steps: list[tuple[str, list[Any], str, Any]],
) -> None:
    """A conversation's keys reuse the last list's keys where its JSON begins the new one's:
    turns that extend it (numbers that run on, `1` then `12`, included), retries, lists cut
    short, edited and new, under two salts and two tool lists, are each keyed exactly as from
    scratch."""
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    messages: list[Any] = [{"role": "system", "content": "sys"}]
    for action, more, salt, tools in steps:
        if action == "extend":
            messages = [*messages, *more]
        elif action == "cut":
            messages = messages[: max(1, len(messages) // 2)]
        elif action == "edit" and more:
            messages = [*messages[:-1], more[0]]
        elif action == "new":
            messages = [{"role": "system", "content": "sys"}, *more]
        assert tokens._message_keys(salt, messages, tools) == message_keys_from_scratch(
            salt, messages, tools
        )


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": 'quotes " and \\ slashes, \n\t\x00 controls, naïve 日本語 🙂'},
        {"role": "user", "content": ""},
        "a bare string",
        [1, [2, {"a": None}]],
        -7,
    ],
)
def test_a_lone_message_is_keyed_as_the_first_of_a_longer_list(message: Any) -> None:
    """A one-message list (its list is not kept for later ones: it has no other key to lend)
    is keyed as from scratch, and gets the key(0) a longer list that opens with the same
    message gets, so its next turn finds the prefix."""
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    for salt, tools in (("s", None), ("t", [TOOL])):
        lone = tokens._message_keys(salt, [message], tools)
        assert lone == message_keys_from_scratch(salt, [message], tools)
        longer = [message, {"role": "assistant", "content": "ok"}]
        fresh = PromptTokens(ModelTokenizer(MODEL_DIR))._message_keys(salt, longer, tools)
        assert fresh is not None and lone == fresh[:1]


def test_the_ids_returned_are_the_callers_own() -> None:
    """The caches keep no array the caller gets (a text's ids, a prefix's): changing the ids
    returned changes no later request's."""
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    long = "Log:" + words("own-ids", 3_000)
    messages: list[dict[str, Any]] = [{"role": "user", "content": long}]
    for turn in range(3):
        for agp in (True, False):
            body = {"messages": messages, "add_generation_prompt": agp}
            whole = tokens.tokenizer.encode(
                tokens.tokenizer.render_chat(messages, add_generation_prompt=agp)
            )
            ids = tokens.ids(body, chat=True, cache_salt="s")
            assert list(ids) == whole, (turn, agp)
            assert isinstance(ids, array.array)
            ids[:] = array.array("I", [0] * len(ids))  # the caller's to change
            ids.append(1)
            assert list(tokens.ids(body, chat=True, cache_salt="s")) == whole
            text = tokens.encode(long, "s")
            assert list(text) == tokens.tokenizer.encode(long)
            text[:] = array.array("I", [0] * len(text))
        messages = [*messages, {"role": "assistant", "content": words(f"own{turn}", 50)}]
        messages.append({"role": "user", "content": long + words(f"own-more{turn}", 400)})
    assert tokens.stats.prefix_hits and tokens.stats.text_prefix_hits


def test_a_number_that_runs_on_is_not_a_message_already_keyed() -> None:
    """[..., 1] then [..., 12, ...]: the old JSON is a byte prefix of the new one, but the last
    message differs; only a comma right after it says the message ended there."""
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    first: list[Any] = [{"role": "system", "content": "sys"}, 1]
    tokens._message_keys("s", first, None)
    then: list[Any] = [{"role": "system", "content": "sys"}, 12, "x"]
    assert tokens._message_keys("s", then, None) == message_keys_from_scratch("s", then, None)


def test_the_message_keys_kept_are_bounded() -> None:
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR), max_message_keys_bytes=2_000)
    for i in range(8):
        messages = [
            {"role": "system", "content": f"conversation {i}"},
            {"role": "user", "content": words(f"b{i}", 60)},
        ]
        assert tokens._message_keys("s", messages, None) == message_keys_from_scratch(
            "s", messages, None
        )
    assert 0 < tokens._chat_bytes <= 2_000 and len(tokens._chats) < 8


def test_a_template_that_does_not_render_by_message_is_caught_and_rendered_whole(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A template numbering turns past the tenth (beyond every probe) passes the load-time
    probes; the sampled whole rendering catches it and every chat is rendered whole after."""
    from gateway.events import prompts

    monkeypatch.setattr(prompts, "VERIFY_EVERY", 1)
    config = orjson.loads((MODEL_DIR / "tokenizer_config.json").read_bytes())
    plain = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    assert plain in config["chat_template"]
    numbered = (
        "{{- '<|im_start|>' + message.role + ((' ' + loop.index|string) if loop.index > 10 "
        "else '') + '\\n' + message.content + '<|im_end|>\\n' }}"
    )
    config["chat_template"] = config["chat_template"].replace(plain, numbered)
    (tmp_path / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    tokens = PromptTokens(ModelTokenizer(tmp_path))
    assert tokens.incremental
    messages: list[dict[str, Any]] = []
    with caplog.at_level("WARNING"):
        for turn in range(12):
            messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": "t"})
            ids = tokens.ids({"messages": messages}, chat=True)
            prompt = tokens.tokenizer.render_chat(messages)
            assert list(ids) == tokens.tokenizer.encode(prompt)
    assert tokens.stats.incremental_mismatches == 1 and not tokens.incremental
    assert "differs from rendering it whole" in caplog.text


def test_a_template_that_refuses_a_lone_system_message_still_keys_every_chat(
    tmp_path: Any,
) -> None:
    """The header entry (a conversation's first message alone) is rendered on the side; a
    template that refuses it must not turn a valid request into an error."""
    config = orjson.loads((MODEL_DIR / "tokenizer_config.json").read_bytes())
    config["chat_template"] = (
        "{%- if messages|length == 1 and messages[0].role == 'system' %}"
        "{{- raise_exception('a system message alone') }}{%- endif %}" + config["chat_template"]
    )
    (tmp_path / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    tokens = PromptTokens(ModelTokenizer(tmp_path))
    messages: list[dict[str, Any]] = [SYSTEM]
    for turn in range(3):
        messages.append({"role": "user", "content": words(f"lone{turn}", 40)})
        ids = tokens.ids({"messages": messages}, chat=True)
        assert list(ids) == tokens.tokenizer.encode(tokens.tokenizer.render_chat(messages))
        messages.append({"role": "assistant", "content": "ok"})
    assert tokens.stats.prefix_hits == 2


def test_long_messages_sharing_a_beginning_encode_from_where_they_part(engine: Served) -> None:
    """Single-message prompts of ~3k tokens (bench point 2's shape) that begin alike: the
    second encodes about what follows their shared text, not all of it, and both are the
    engine's ids (the whole message cut at word boundaries, async path included). Word by word
    off: what is measured is the pieces' reuse."""
    import asyncio

    tokens = PromptTokens(ModelTokenizer(MODEL_DIR), words=False)
    assert tokens.chunking
    shared = "Context: " + words("doc-shared", 2500) + ",  then\n\n" + words("doc-more", 400)
    ids: list[list[int]] = []
    encoded: list[int] = []
    for i, body_text in enumerate((shared + words("ask-a", 300), shared + words("ask-b", 300))):
        parsed = parse_chat(raw({"messages": [{"role": "user", "content": body_text}]}), LIMIT)
        before = tokens.stats.tokens_encoded
        got = asyncio.run(tokens.ids_off_loop(engine_body(parsed), True, "s"))
        encoded.append(tokens.stats.tokens_encoded - before)
        ids.append(list(got))
        assert ids[i] == engine_ids(engine, parsed)
    assert encoded[0] >= len(ids[0]) - 3  # all new
    assert encoded[1] < 300 + 1_000  # the different end and about one piece before it
    assert tokens.stats.chunk_checks == 1 and tokens.stats.chunk_mismatches == 0


def test_word_cuts_fall_between_two_non_spaces_about_every_n() -> None:
    from gateway.events.prompts import word_cuts

    text = "ab  cd\n ef gh ijk   l m"
    assert word_cuts(text, 0, len(text), 1) == [10, 13, 21]  # 'f g', 'h i', 'l m'
    cuts = word_cuts(words("cuts", 2000), 0, 12_000, 2048)
    assert cuts and all(b - a >= 2048 for a, b in itertools.pairwise(cuts))


def test_a_tokenizer_that_merges_across_spaces_encodes_long_texts_whole(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a pre-tokenizer the BPE merges across spaces: the probes turn cutting off; and
    were it forced on, the first cut text's whole encoding catches it and is what returns."""
    tokenizer = merging_tokenizer(tmp_path)
    assert not PromptTokens(tokenizer).chunking
    from gateway.events import prompts

    monkeypatch.setattr(prompts, "CHUNK_CHARS", 1)  # cut at every word boundary
    forced = PromptTokens(tokenizer)
    forced.chunking = True
    text = prompts._CHUNK_PROBES[2] * 3
    with caplog.at_level("WARNING"):
        got = forced.encode(text)
    assert list(got) == tokenizer.encode(text)
    assert forced.stats.chunk_mismatches == 1 and not forced.chunking
    assert "cut at word boundaries differ" in caplog.text
    # the same text again (the object whose cut was kept): no longer cut at words
    assert forced.segments(text) == [text]
    assert list(forced.encode(text)) == tokenizer.encode(text)


def test_the_gateways_tokenizer_runs_no_thread_pool() -> None:
    """A fresh process keying a long chat (in its worker thread too) starts no rayon threads:
    `PromptTokens` turns the library's pool off unless the operator set it; set, it is kept."""
    import subprocess
    import sys

    script = (
        "import asyncio, os\n"
        "from cachemap.tokenizer import ModelTokenizer\n"
        "from gateway.events.prompts import PromptTokens\n"
        "from loadgen.engine.tokenizer import MODEL_DIR\n"
        "from loadgen.text import words\n"
        "tokens = PromptTokens(ModelTokenizer(MODEL_DIR))\n"
        "body = {'messages': [{'role': 'user', 'content': words('pool', 6000)}]}\n"
        "asyncio.run(tokens.ids_off_loop(body, True))\n"
        "tokens.ids({'messages': [{'role': 'user', 'content': words('pool2', 900)}]}, True)\n"
        "print(os.environ['TOKENIZERS_PARALLELISM'], len(os.listdir('/proc/self/task')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    # the main thread and asyncio's one worker thread, no pool
    assert out[0] == "false" and int(out[1]) <= 2
    env["TOKENIZERS_PARALLELISM"] = "true"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "true" and int(out[1]) > 2  # the operator's choice: the pool runs


def _starts_by_token(text: str, specials: tuple[str, ...]) -> set[int]:
    """Every occurrence of each added token, leftmost and not overlapping one another (as a
    find after the last one's end gives them): the reference, by `re`."""
    return {0} | {m.start() for token in specials for m in re.finditer(re.escape(token), text)}


SPECIAL_SETS = (
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
    ("<|im", "<|im_start|>", "im_end", "[INST]"),  # a prefix of another, one inside another
    ("aba", "<|x|>"),  # overlaps itself: a find per token
    (),
)


@settings(max_examples=300, deadline=None)
@example(SPECIAL_SETS[2], ["ab", "aba"])  # "ababa": "aba" at 0, and at 2 only by overlapping
@given(
    st.sampled_from(SPECIAL_SETS),
    st.lists(
        st.sampled_from(["<", "|", "<|", "im", "_end", "<|im_start|>", "<|im_end|>", "aba", "ab",
                         "a", " word", "\n", "[INST]", "</tool_call>", "<" * 70]),
        max_size=30,
    ),
)  # fmt: skip
def test_special_starts_are_every_occurrence_of_every_added_token(
    specials: tuple[str, ...], parts: list[str]
) -> None:
    """The scan by first characters finds what a find per token finds, with tokens that are
    prefixes of others, tokens inside others, a token that overlaps itself, and markup past
    `FEW_SPECIAL_FIRSTS` places."""
    text = "".join(parts)
    assert special_starts(text, specials, firsts_of(specials)) == _starts_by_token(text, specials)


def test_conversations_that_open_alike_each_reuse_their_own_message_keys() -> None:
    """Three conversations with one system prompt (one key(0)), their turns interleaved: each
    continuation reuses the keys of its own last list, not only the latest conversation's."""
    tokens = PromptTokens(ModelTokenizer(MODEL_DIR))
    chats: list[list[Any]] = [[SYSTEM] for _ in range(3)]
    for turn in range(4):
        for c, messages in enumerate(chats):
            messages.append({"role": "user", "content": words(f"alike{c}-{turn}", 20)})
            before = tokens.stats.message_keys_reused
            keys = tokens._message_keys("s", messages, None)
            assert keys == message_keys_from_scratch("s", messages, None)
            reused = tokens.stats.message_keys_reused - before
            assert reused == (len(messages) - 2 if turn else 0), (turn, c)
            messages.append({"role": "assistant", "content": words(f"reply{c}-{turn}", 10)})
