"""Anthropic Messages → the OpenAI chat shape: one conversation, one rendering, breakpoints at
exact byte offsets, and a 400 naming the field for every refused request."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from cachemap.rendering import IM_END
from gateway.api.anthropic.convert import parse_messages
from gateway.api.openai.parse import parse_chat
from gateway.errors import InvalidRequest
from gateway.request.cache_control import Breakpoint, provisional_cache_usage

MAX = 1 << 22
EPHEMERAL = {"type": "ephemeral"}
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}

ANTHROPIC: dict[str, Any] = {
    "model": "m",
    "max_tokens": 16,
    "tools": [{"name": "read", "description": "Read a file", "input_schema": SCHEMA}],
    "system": [
        {"type": "text", "text": "You are a coding agent. "},
        {"type": "text", "text": "Be brief."},
    ],
    "messages": [
        {"role": "user", "content": "Fix the bug in main.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "main.py"}},
                {"type": "tool_use", "id": "t2", "name": "read", "input": {"path": "util.py"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "def f(): pass"}],
                },
                {"type": "text", "text": "Go on."},
            ],
        },
    ],
}

OPENAI: dict[str, Any] = {
    "model": "m",
    "tools": [
        {
            "type": "function",
            "function": {"name": "read", "description": "Read a file", "parameters": SCHEMA},
        }
    ],
    "messages": [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "Fix the bug in main.py"},
        {
            "role": "assistant",
            "content": "Reading it.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path": "main.py"}'},
                },
                {
                    "id": "t2",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path":"util.py"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "t2", "content": "def f(): pass"},
        {"role": "user", "content": "Go on."},
    ],
}


def parse(body: dict[str, Any]) -> Any:
    return parse_messages(orjson.dumps(body), MAX)


def refused(body: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    return info.value.message


def test_an_anthropic_conversation_renders_exactly_as_its_openai_twin() -> None:
    parsed = parse(ANTHROPIC)
    twin = parse_chat(orjson.dumps(OPENAI), MAX)
    assert parsed.rendered == twin.rendered
    # the upstream body is OpenAI-shaped: tool results became tool messages, in order
    roles = [m["role"] for m in parsed.body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    call = parsed.body["messages"][2]["tool_calls"][0]
    assert orjson.loads(call["function"]["arguments"]) == {"path": "main.py"}
    assert parsed.body["max_tokens"] == 16 and parsed.breakpoints == ()


def test_cache_control_never_enters_the_rendering_and_marks_land_right_after_their_blocks() -> None:
    body = copy.deepcopy(ANTHROPIC)
    body["tools"][0]["cache_control"] = ONE_HOUR
    body["system"][0]["cache_control"] = ONE_HOUR
    body["messages"][1]["content"][1]["cache_control"] = EPHEMERAL  # the first of two tool calls
    body["messages"][2]["content"][2]["cache_control"] = EPHEMERAL  # the last block
    parsed = parse(body)
    assert parsed.rendered == parse(ANTHROPIC).rendered
    text = parsed.rendered.decode()
    tools, system, call, last = parsed.breakpoints
    assert [b.ttl for b in parsed.breakpoints] == ["1h", "1h", "5m", "5m"]
    assert [b.offset for b in parsed.breakpoints] == sorted(b.offset for b in parsed.breakpoints)
    # the last tool covers the whole tools segment; a part inside a message ends after its text
    assert text[: tools.offset].endswith("]" + IM_END)
    assert text[: system.offset].endswith("You are a coding agent. ")
    assert text[: call.offset].endswith('"name":"read"}') and "t2" not in text[: call.offset]
    assert text[: last.offset].endswith("Go on." + IM_END)
    assert system.where == "system[0]" and last.where == "messages[2].content[2]"
    # the next turn's rendering starts with everything this turn's breakpoints cover
    body["messages"] += [{"role": "assistant", "content": "Done."}]
    assert parse(body).rendered.startswith(parsed.rendered)


def test_automatic_caching_marks_the_end_of_the_last_message_once() -> None:
    body = {**ANTHROPIC, "cache_control": EPHEMERAL}
    parsed = parse(body)
    (auto,) = parsed.breakpoints
    assert parsed.rendered[: auto.offset].endswith(("Go on." + IM_END).encode())
    assert parsed.rendered[auto.offset :] == b"<|im_start|>assistant\n"
    # an explicit mark on the same block is the same breakpoint, not a second one
    body = copy.deepcopy(body)
    body["messages"][2]["content"][2]["cache_control"] = EPHEMERAL
    assert parse(body).breakpoints == (Breakpoint(auto.offset, "5m", "messages[2].content[2]"),)


def test_at_most_four_breakpoints_and_one_hour_before_five_minutes() -> None:
    body = copy.deepcopy(ANTHROPIC)
    body["system"][0]["cache_control"] = EPHEMERAL
    body["system"][1]["cache_control"] = EPHEMERAL
    body["messages"][1]["content"][0]["cache_control"] = EPHEMERAL
    body["messages"][2]["content"][0]["cache_control"] = EPHEMERAL
    assert len(parse(body).breakpoints) == 4
    body["messages"][2]["content"][2]["cache_control"] = EPHEMERAL
    assert "at most 4 cache_control breakpoints, found 5" in refused(body)
    body = copy.deepcopy(ANTHROPIC)
    body["system"][0]["cache_control"] = EPHEMERAL
    body["messages"][0]["content"] = [{"type": "text", "text": "Fix it", "cache_control": ONE_HOUR}]
    message = refused(body)
    assert "1h cache_control breakpoint must come before every 5m one" in message
    assert "messages[0].content[0] (1h) follows system[0] (5m)" in message


def test_a_prewarm_keeps_max_tokens_0_for_billing_and_refuses_streaming_and_forced_tools() -> None:
    parsed = parse({**ANTHROPIC, "max_tokens": 0})
    assert parsed.prewarm and parsed.body["max_tokens"] == 0  # the director sends 1 upstream
    assert "cannot be streamed" in refused({**ANTHROPIC, "max_tokens": 0, "stream": True})
    forced = {**ANTHROPIC, "max_tokens": 0, "tool_choice": {"type": "tool", "name": "read"}}
    assert "cannot force a tool" in refused(forced)
    chosen = parse({**ANTHROPIC, "tool_choice": {"type": "tool", "name": "read"}})
    assert chosen.body["tool_choice"] == {"type": "function", "function": {"name": "read"}}


def test_sampling_fields_map_to_the_openai_names() -> None:
    parsed = parse(
        {
            **ANTHROPIC,
            "temperature": 0.2,
            "top_k": 5,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u1"},
            "stream": True,
        }
    )
    body = parsed.body
    assert (body["temperature"], body["top_k"], body["stop"], body["user"]) == (
        0.2,
        5,
        ["END"],
        "u1",
    )
    assert parsed.stream and body["stream"] is True


def test_images_become_image_url_parts() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    parsed = parse({**ANTHROPIC, "messages": [{"role": "user", "content": [image]}]})
    part = parsed.body["messages"][-1]["content"][0]
    assert part == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_tokens": None}, "'max_tokens' is required and must be an integer >= 0"),
        ({"max_tokens": -1}, "'max_tokens' is required"),
        ({"model": ""}, "'model' is required"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"n": 2}, "unknown fields ['n']; /v1/messages accepts"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role must be one of assistant, user"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
            "type must be one of text, tool_use in a assistant message",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "thinking"}]}]},
            "type must be one of text, image, tool_result",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "tool_use_id must be a non-empty string",
        ),
        ({"system": [{"type": "image"}]}, "system[0].type must be 'text'"),
        ({"tools": [{"name": "x"}]}, "input_schema must be an object"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "is a server tool"),
        ({"tool_choice": {"type": "maybe"}}, "must be one of auto, any, none, tool"),
        ({"tool_choice": {"type": "tool"}}, "'tool_choice.name' must name a tool"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "extended thinking"),
        ({"cache_control": {"type": "persistent"}}, "cache_control.type must be 'ephemeral'"),
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "ttl must be one of 5m, 1h"),
        ({"stop_sequences": [""]}, "'stop_sequences' must be a list of non-empty strings"),
        ({"top_k": -1}, "'top_k' must be an integer >= 0"),
    ],
)
def test_a_bad_request_is_refused_with_the_field_named(
    change: dict[str, Any], message: str
) -> None:
    assert message in refused({**ANTHROPIC, **change})


def test_an_oversized_prompt_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="the maximum is 100"):
        parse_messages(orjson.dumps(ANTHROPIC), 100)


def test_the_provisional_usage_split_follows_the_mixed_ttl_rule() -> None:
    # 1,000 prompt tokens over 4,000 rendered bytes: a 1h breakpoint at byte 2,000 (500
    # tokens), a 5m one at byte 3,600 (900 tokens); the engine held 300 tokens
    breakpoints = (Breakpoint(2000, "1h", "system[0]"), Breakpoint(3600, "5m", "messages[0]"))
    engine = {"prompt_tokens": 1000, "completion_tokens": 7, "engine_cached_tokens": 300}
    usage = provisional_cache_usage(engine, breakpoints, 4000)
    assert usage == {
        "input_tokens": 100,
        "output_tokens": 7,
        "cache_creation_input_tokens": 600,
        "cache_read_input_tokens": 300,
        "cache_creation": {"ephemeral_5m_input_tokens": 400, "ephemeral_1h_input_tokens": 200},
        "engine_cached_tokens": 300,
    }
    # a hit beyond the 1h breakpoint leaves nothing to write at 1h; beyond the last, nothing
    assert provisional_cache_usage({**engine, "engine_cached_tokens": 700}, breakpoints, 4000)[
        "cache_creation"
    ] == {"ephemeral_5m_input_tokens": 200, "ephemeral_1h_input_tokens": 0}
    read_all = provisional_cache_usage({**engine, "engine_cached_tokens": 990}, breakpoints, 4000)
    assert (read_all["cache_read_input_tokens"], read_all["input_tokens"]) == (900, 100)
    # a hit under one engine block short of the last breakpoint (the engine's whole blocks, the
    # byte-scaled estimate) is the prefix read whole: nothing written, as Anthropic reports
    near = provisional_cache_usage({**engine, "engine_cached_tokens": 896}, breakpoints, 4000)
    assert (near["cache_read_input_tokens"], near["cache_creation_input_tokens"]) == (900, 0)
    short = provisional_cache_usage({**engine, "engine_cached_tokens": 880}, breakpoints, 4000)
    assert (short["cache_read_input_tokens"], short["cache_creation_input_tokens"]) == (880, 20)
    # no breakpoint: nothing is read or written, whatever the engine held; a pre-warm outputs 0
    plain = provisional_cache_usage(engine, (), 4000, prewarm=True)
    assert (plain["input_tokens"], plain["cache_read_input_tokens"], plain["output_tokens"]) == (
        1000,
        0,
        0,
    )


def test_an_empty_system_list_is_no_system_message() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_empty = parse({"model": "m", "max_tokens": 1, "system": [], "messages": messages})
    without = parse({"model": "m", "max_tokens": 1, "messages": messages})
    assert (
        with_empty.rendered
        == without.rendered
        == b"<|im_start|>user\nhi" + (IM_END + "<|im_start|>assistant\n").encode()
    )
