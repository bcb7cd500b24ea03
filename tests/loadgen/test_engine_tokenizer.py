"""The engine's tokenizer endpoints over real HTTP: vLLM's shapes, the template's real ids, and
token counts, context checks and the prefix cache that follow them."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadgen.engine.tokenizer import default_tokenizer
from loadgen.text import words
from tests.conftest import MODEL
from tests.servers import Served

TOK = default_tokenizer()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CHAT = [
    {"role": "system", "content": "You are a coding agent." + words("sys", 40)},
    {"role": "user", "content": "Task:" + words("task", 30)},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "2 passed"},
]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


CAT = data_url(b"\x89PNG cat" * 50)


def image_message(url: str, text: str = "What is in this picture?") -> dict[str, Any]:
    """A user turn of a text part and an image part (vLLM places the image first)."""
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


@pytest.fixture
def engine(start_engines: Callable[..., list[Served]]) -> Served:
    return start_engines(1)[0]


def post(url: str, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(url + path, json=body, timeout=10)
    assert r.status_code == status, r.text
    return r.json()


def test_tokenize_returns_the_template_and_bpe_ids(engine: Served) -> None:
    expected = TOK.encode(TOK.render_chat(CHAT, TOOLS))
    tok = post(engine.url, "/tokenize", {"model": MODEL, "messages": CHAT, "tools": TOOLS})
    assert tok["tokens"] == expected and tok["count"] == len(expected)
    assert tok["max_model_len"] == 131_072 and tok["token_strs"] is None
    text = post(engine.url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert text["tokens"] == TOK.encode("Hello world")
    assert text["token_strs"] == TOK.token_strs(text["tokens"])
    bare = post(engine.url, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare["tokens"] == TOK.encode(TOK.render_chat(CHAT, add_generation_prompt=False))


def test_render_endpoints_answer_generate_requests(engine: Served) -> None:
    expected = TOK.encode(TOK.render_chat(CHAT, TOOLS))
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 5, "cache_salt": "s"}
    chat = post(engine.url, "/v1/chat/completions/render", body)
    assert chat["token_ids"] == expected
    assert chat["sampling_params"]["max_tokens"] == 5 and chat["cache_salt"] == "s"
    assert {"request_id", "features", "model", "stream", "priority"} <= chat.keys()
    (completion,) = post(engine.url, "/v1/completions/render", {"prompt": "Hello world"})
    assert completion["token_ids"] == TOK.encode("Hello world")


def test_detokenize_inverts_tokenize(engine: Served) -> None:
    tok = post(engine.url, "/tokenize", {"messages": CHAT, "tools": TOOLS})
    text = post(engine.url, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})["prompt"]
    assert text == TOK.render_chat(CHAT, TOOLS)
    error = post(engine.url, "/detokenize", {"tokens": [1, 99_999]}, status=400)
    assert "99999" in error["error"]["message"] and "not a token id" in error["error"]["message"]


def test_a_render_is_kept_for_one_generation_and_a_generation_keeps_nothing(
    engine: Served,
) -> None:
    prompts = engine.app.state.prompts  # the app's, shared by its data-parallel ranks
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    post(engine.url, "/v1/chat/completions/render", body)
    post(engine.url, "/v1/chat/completions/render", {**body, "cache_salt": "other"})
    assert len(prompts) == 2  # one per (text, salt)
    post(engine.url, "/v1/chat/completions", body)
    assert len(prompts) == 1  # the generation took its render's ids
    post(engine.url, "/v1/chat/completions", body)
    assert len(prompts) == 1  # a repeat is tokenized again, as in vLLM: no timing channel


def test_usage_counts_the_real_tokens(engine: Served) -> None:
    ids = post(engine.url, "/tokenize", {"messages": CHAT, "tools": TOOLS})["tokens"]
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 6}
    answer = post(engine.url, "/v1/chat/completions", body)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    text = answer["choices"][0]["message"]["content"]
    output = TOK.encode(text)  # the reply is real vocabulary ids, detokenized
    assert len(output) == 6 == answer["usage"]["completion_tokens"]
    assert set(output) <= set(TOK.word_ids)


def test_the_prefix_cache_follows_the_real_token_blocks(engine: Served) -> None:
    first = [CHAT[0], {"role": "user", "content": "Task:" + words("one", 90)}]
    second = [CHAT[0], {"role": "user", "content": "Task:" + words("two", 90)}]
    a, b = (post(engine.url, "/tokenize", {"messages": m})["tokens"] for m in (first, second))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    post(engine.url, "/v1/chat/completions", {"messages": first, "max_tokens": 1})
    usage = post(engine.url, "/v1/chat/completions", {"messages": second, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == common // 16 * 16 > 0


def test_the_context_check_counts_real_tokens(start_engines: Callable[..., list[Served]]) -> None:
    (engine,) = start_engines(1, max_model_len=200)
    prompt = words("long", 195)  # exactly 195 tokens
    post(engine.url, "/v1/completions", {"prompt": prompt, "max_tokens": 5})
    error = post(engine.url, "/v1/completions", {"prompt": prompt, "max_tokens": 6}, status=400)
    assert "201 tokens (195 in the messages, 6 in the completion)" in error["error"]["message"]


def test_a_token_id_prompt_is_used_as_given(engine: Served) -> None:
    ids = TOK.encode("Once upon a time")
    answer = post(engine.url, "/v1/completions", {"prompt": ids, "max_tokens": 2})
    assert answer["usage"]["prompt_tokens"] == len(ids)
    error = post(engine.url, "/v1/completions", {"prompt": [1, 4097]}, status=400)
    assert "4097" in error["error"]["message"]


def test_an_image_is_placeholder_tokens_and_its_blocks_are_keyed_by_its_bytes(
    start_engines: Callable[..., list[Served]],
) -> None:
    (engine,) = start_engines(1, mm_tokens_per_image=48)
    system = {"role": "system", "content": "Look closely." + words("img-sys", 40)}
    cat, dog = CAT, data_url(b"\x89PNG dog" * 50)
    body = {"model": MODEL, "messages": [system, image_message(cat)], "max_tokens": 1}
    ids = post(engine.url, "/tokenize", body)["tokens"]
    start = ids.index(TOK.image_token_id)
    assert ids[start : start + 48] == [TOK.image_token_id] * 48 and ids.count(4096) == 48
    text = TOK.render_chat(body["messages"])  # one placeholder, then the text on its line
    assert "<|im_start|>user\n<|image_pad|>\nWhat is in this picture?" in text
    assert ids == [
        *TOK.encode(text)[:start],
        *ids[start : start + 48],
        *TOK.encode(text)[start + 1 :],
    ]
    post(engine.url, "/v1/chat/completions", body)
    again = post(engine.url, "/v1/chat/completions", body)["usage"]
    assert again["prompt_tokens"] == len(ids)
    assert again["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    other = {**body, "messages": [system, image_message(dog)]}
    assert post(engine.url, "/tokenize", other)["tokens"] == ids  # the same ids ...
    usage = post(engine.url, "/v1/chat/completions", other)["usage"]
    # ... but no block holding a placeholder of the other image: only those before it hit
    assert usage["prompt_tokens_details"]["cached_tokens"] == start // 16 * 16


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "needs a string 'image_url.url'",
        ),
        (
            {"messages": [image_message("https://example.com/cat.png")]},
            "image URLs are not fetched",
        ),
        ({"messages": [image_message("data:image/png;base64,@@@")]}, "not valid base64"),
        (
            {"messages": [{"role": "system", "content": "<|image_pad|>"}, image_message(CAT)]},
            "2 image placeholders for 1 images",
        ),
        ({"messages": [image_message("data:text/plain;base64,AAAA")]}, "data:image/<type>"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "not valid JSON",
        ),
        (
            {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
            "cannot both be true",
        ),
        ({"messages": CHAT, "add_generation_prompt": "yes"}, "true or false"),
        ({"messages": CHAT, "tools": {"a": 1}}, "'tools' must be a list"),
    ],
)
def test_malformed_chats_get_a_400_naming_the_problem(
    engine: Served, body: dict[str, Any], message: str
) -> None:
    for path in ("/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"):
        error = post(engine.url, path, body, status=400)
        assert message in error["error"]["message"], (path, error)
