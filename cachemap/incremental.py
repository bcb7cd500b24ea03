"""Render a chat continuation from its cached prefix: only the new messages go through the
template.

With R(M, agp) the template's rendering of messages M (`ChatTemplate.render`), S(k) = R(M[:k],
agp=False) the rendering of the first k messages without a generation prompt, and G the
generation prompt:

    R(M, True)  = R(M, False) + G                            (G checked on probes at load)
    R(M, False) = S(k) + tail(M, k)
    tail(M, k)  = R(W, False)[len(L):]      W = [M[k-1]] + M[k:],  L = R([M[k-1]], False),
                                            both without tools; only when R(W) starts with L

That is: the messages after the prefix are rendered with one message of left context (so
`loop.previtem`, the first message's special case, a run of tool results are seen as in the
whole), and the context's own rendering is cut off. It holds for templates that render a
message from itself and its neighbours (ChatML and its tools layout, Llama 3, ...), which is
checked two ways: at load, on probe conversations of every shape the front ends produce (a
template that fails any probe is always rendered whole: `enabled` false); per call, the
window's rendering must start with its context's (a tool result followed by another leaves
its turn open: not a boundary), and the tail must start with an added token, so that the
tokenizer, which splits at added tokens first, gives ids(S(k)) + ids(tail) for the whole.
A template that looks further (e.g. Qwen3 hiding the reasoning of turns before the last user
query) is caught by the window check where the effect is one message away and by the
gateway's sampled whole-render comparison otherwise (`gateway.events.prompts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachemap.chat_template import ChatTemplate, ChatTemplateError

_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
_CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
}
_PROBES: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "What is in a.py?"},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            },
        ],
        None,
    ),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is in a.py and b.py?"},
            {"role": "assistant", "content": None, "tool_calls": [_CALL, _CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
            {"role": "tool", "tool_call_id": "c1", "content": "print(2)"},
            {"role": "assistant", "content": "Two prints."},
            {"role": "user", "content": "And c.py?"},
            {"role": "assistant", "content": "Reading it.", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "print(3)"},
        ],
        [_TOOL],
    ),
    (
        [
            {"role": "user", "content": "What is in a.py?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
            {"role": "user", "content": "Thanks."},
        ],
        [_TOOL],
    ),
)


class IncrementalTemplate:
    """A chat template's renderings from a prefix (module docstring).

    `enabled`: every probe's whole rendering equals S(k) + tail for every k the window allows,
    and R(M, True) = R(M, False) + G; otherwise `tail` always answers None (render whole)."""

    def __init__(self, template: ChatTemplate, added_tokens: Sequence[str]) -> None:
        self.template = template
        self.added_tokens = tuple(t for t in added_tokens if t)
        self.generation_prompt = ""
        self.enabled = self._probe()

    def whole(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> str:
        """S(len(messages)): the rendering without a generation prompt."""
        return self.template.render(messages, tools, add_generation_prompt=False)

    def tail(self, messages: Sequence[Any], k: int) -> str | None:
        """R(messages, False)[len(S(k)):], rendered from messages k-1 on; None when this
        template, or this boundary, does not allow it (render whole then)."""
        return self._tail(messages, k) if self.enabled else None

    def _tail(self, messages: Sequence[Any], k: int) -> str | None:
        if not 1 <= k < len(messages):
            return None
        try:
            left = self.template.render(messages[k - 1 : k], None, add_generation_prompt=False)
            window = self.template.render(messages[k - 1 :], None, add_generation_prompt=False)
        except ChatTemplateError:  # e.g. a template that insists on user/assistant order
            return None
        if not window.startswith(left):
            return None
        tail = window[len(left) :]
        if not tail.startswith(self.added_tokens):
            return None
        return tail

    def _probe(self) -> bool:
        for messages, tools in _PROBES:
            try:
                whole = self.whole(messages, tools)
                with_prompt = self.template.render(messages, tools, add_generation_prompt=True)
            except ChatTemplateError:
                return False
            if not with_prompt.startswith(whole):
                return False
            prompt = with_prompt[len(whole) :]
            if messages is _PROBES[0][0]:
                self.generation_prompt = prompt
            elif prompt != self.generation_prompt:
                return False
            for k in range(1, len(messages)):
                tail = self._tail(messages, k)
                if tail is not None and self.whole(messages[:k], tools) + tail != whole:
                    return False
        return True
