"""A non-streamed answer assembled from the engine's stream.

The gateway asks the engine to stream even when the client did not (so a fan-out leader's
first token releases its siblings, and the first-byte and idle timeouts bound every request);
the client then gets the body the engine would have sent. The rules, per OpenAI's streaming
format (chat `chat.completion.chunk`, completions `text_completion`):

    top level   every key of the chunks, the first value kept (id, created, model, ...);
                `object` "chat.completion.chunk" becomes "chat.completion"; `usage` the last
    choices     by `index`, in index order; chat `delta` becomes `message`:
                  strings concatenated (content, reasoning_content, refusal; completion text)
                  tool_calls merged by their `index`: id, type, name first seen, arguments
                  concatenated (the `index` key dropped, as in a whole message)
                  logprobs: lists concatenated key by key (`content`, `tokens`, ...)
                  finish_reason, stop_reason: the last one sent; other keys: lists
                  concatenated, anything else the last value

So a whole answer equals the engine's own up to fields the engine leaves out of its stream
(vLLM omits unset fields from chunks and writes them as null in a whole response).
"""

from __future__ import annotations

from typing import Any

_CHUNK_OBJECTS = {"chat.completion.chunk": "chat.completion"}
_LAST = frozenset({"finish_reason", "stop_reason"})
_CONCATENATED = frozenset({"content", "refusal", "reasoning_content", "reasoning"})


class Assembler:
    """Feed it a stream's chunks (`add`), in order; `body()` is the whole answer."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def add(self, chunk: dict[str, Any]) -> None:
        for key, value in chunk.items():
            if key == "choices":
                continue
            if key == "usage":
                if value is not None:
                    self.usage = value
                continue
            self.head.setdefault(key, value)
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict):
                self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        into = self.choices.setdefault(index if isinstance(index, int) else 0, {})
        for key, value in choice.items():
            if key == "delta" and isinstance(value, dict):
                _merge_message(into.setdefault("message", {}), value)
            elif key == "text" and isinstance(value, str):
                into["text"] = into.get("text", "") + value
            elif key == "logprobs":
                if value is not None or key not in into:
                    into[key] = _merge_lists(into.get(key), value)
            elif key in _LAST:
                if value is not None or key not in into:
                    into[key] = value
            else:
                into[key] = _merge_lists(into.get(key), value)

    def body(self) -> dict[str, Any]:
        out = dict(self.head)
        obj = out.get("object")
        if isinstance(obj, str):
            out["object"] = _CHUNK_OBJECTS.get(obj, obj)
        out["choices"] = [self.choices[i] for i in sorted(self.choices)]
        if self.usage is not None:
            out["usage"] = self.usage
        return _finish_calls(out)


def _merge_message(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "tool_calls" and isinstance(value, list):
            calls: list[dict[str, Any]] = message.setdefault("tool_calls", [])
            for call in value:
                if isinstance(call, dict):
                    _merge_call(calls, call)
        elif key == "function_call" and isinstance(value, dict):
            _merge_function(message.setdefault("function_call", {}), value)
        elif key in _CONCATENATED and isinstance(value, str):
            before = message.get(key)
            message[key] = before + value if isinstance(before, str) else value
        elif message.get(key) is None:
            message[key] = value  # role and the rest: the first value sent


def _merge_call(calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    index = delta.get("index", 0)
    found = next((c for c in calls if c.get("_index") == index), None)
    if found is None:
        found = {"_index": index}
        calls.append(found)
    for key, value in delta.items():
        if key == "index":
            continue
        if key == "function" and isinstance(value, dict):
            _merge_function(found.setdefault("function", {}), value)
        elif found.get(key) is None:
            found[key] = value


def _merge_function(function: dict[str, Any], delta: dict[str, Any]) -> None:
    for name, part in delta.items():
        if name == "arguments" and isinstance(part, str):
            function["arguments"] = function.get("arguments", "") + part
        elif function.get(name) is None:
            function[name] = part


def _merge_lists(old: Any, new: Any) -> Any:
    """Lists concatenate, dicts merge key by key, anything else: the new value."""
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for key, value in new.items():
            merged[key] = _merge_lists(old.get(key), value)
        return merged
    return new if new is not None or old is None else old


def _finish_calls(body: dict[str, Any]) -> dict[str, Any]:
    """Drop the merge bookkeeping from the tool calls (their order is their index's)."""
    for choice in body.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            calls.sort(key=lambda c: c.get("_index", 0))
            for call in calls:
                call.pop("_index", None)
    return body
