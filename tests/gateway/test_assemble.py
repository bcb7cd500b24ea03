"""A non-streamed answer assembled from the engine's stream is the body the engine would have
sent: against the simulated engine itself (chat and completions, usage included), and on the
shapes it does not make (tool calls in fragments, reasoning, logprobs, several choices)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.pipeline.assemble import Assembler
from tests.conftest import MODEL
from tests.servers import Served


def assembled(raw: bytes) -> dict[str, Any]:
    assembler = Assembler()
    for event in raw.split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if data and data != b"[DONE]":
            assembler.add(orjson.loads(data))
    return assembler.body()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("path", "prompt"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me more"}]}),
        ("/v1/completions", {"prompt": "once upon a time"}),
    ],
)
def test_the_assembled_body_is_the_engines_own(
    path: str, prompt: dict[str, Any], start_engines: Callable[..., list[Served]]
) -> None:
    (engine,) = start_engines(1)
    body = {"model": MODEL, "max_tokens": 12, **prompt}
    whole = httpx.post(engine.url + path, json=body).json()
    streamed = httpx.post(
        engine.url + path,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ).content
    mine = assembled(streamed)
    for key in ("id", "created"):  # each answer's own
        assert isinstance(mine.pop(key), type(whole.pop(key)))
    assert mine == whole


def test_tool_calls_in_fragments_reasoning_logprobs_and_choices_merge_by_index() -> None:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**head, "choices": [{"index": 1, "delta": {"role": "assistant", "content": "B"}}]},
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "reasoning_content": "think",
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_a",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"x"'},
                            }
                        ],
                    },
                    "logprobs": {"content": [{"token": "a", "logprob": -0.1}]},
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",  # some engines repeat it: kept once
                        "reasoning_content": "ing",
                        "tool_calls": [
                            {"index": 1, "id": "call_b", "function": {"name": "g"}},
                            {"index": 0, "function": {"arguments": ": 1}"}},
                        ],
                    },
                    "logprobs": {"content": [{"token": "b", "logprob": -0.2}]},
                    "finish_reason": "tool_calls",
                }
            ],
        },
        {**head, "choices": [{"index": 1, "delta": {"content": "C"}, "finish_reason": "stop"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    ]
    assembler = Assembler()
    for chunk in chunks:
        assembler.add(chunk)
    body = assembler.body()
    assert body["object"] == "chat.completion" and body["id"] == "c1"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4}
    first, second = body["choices"]
    assert first["message"] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "thinking",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "f", "arguments": '{"x": 1}'},
            },
            {"id": "call_b", "function": {"name": "g"}},
        ],
    }
    assert first["logprobs"] == {
        "content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]
    }
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "BC"}
    assert second["finish_reason"] == "stop"
